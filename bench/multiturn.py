"""Multi-turn image chat through the real services, with the LLM's prefix cache on and off.

    python bench/multiturn.py                 # one GPU: Qwen2-VL-7B shape, random weights, bf16
    python bench/multiturn.py --quick         # tiny checkpoint on the CPU (checks the script)

N conversations at once, each T turns: a system prompt every conversation shares (about
--system-tokens tokens), then one image and a question in the first user turn, then a new
question per turn, the whole history sent again each time (as an OpenAI client does). One
vision encoder and one LLM on the same GPU; the LLM runs the load twice, started with
`--no-prefix-caching` and then with the cache (its default), each run on its own images so
the encoder's embedding cache treats both alike.

Prints TTFT of turn 1 and of turns 2..T for both runs and their ratio, beside the ratio's
bound from prefill alone (a turn's prompt tokens over the ones it must still compute; the
cache also skips the image's Encode, which this bound leaves out), output tokens/s, the share
of prompt tokens found cached and the Encode calls each run made.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import llm_slot_flags, percentile  # noqa: E402
from bench.placement import metric, qwen2_vl_7b  # noqa: E402
from modalmesh import pb  # noqa: E402
from modalmesh.ops.launcher import ServiceProcess  # noqa: E402
from modalmesh.rpc.channel import aio_channel  # noqa: E402
from modalmesh.testing import tiny  # noqa: E402

WORDS = ("assistant answers questions about images clearly and briefly describing colours shapes objects people "
         "places light texture and mood while never inventing details that the picture does not show").split()
QUESTIONS = ["What is in this picture?", "Which colours stand out the most?", "Describe the shapes you can see.",
             "What mood does it have?", "Anything unusual about it?", "Summarise it in one line."]


def png(side: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def system_prompt(model_dir: Path, tokens: int, salt: str = "") -> str:
    """About `tokens` tokens of instructions (counted with the checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words, i = [salt] if salt else [], 0
    while len(tok(" ".join(words))["input_ids"]) < tokens:
        words += WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)]
        i += 7
    text = " ".join(words)
    ids = tok(text)["input_ids"][:tokens]
    return tok.decode(ids)


async def conversation(stub, system: str, image: bytes, turns: int, output_len: int, records: list) -> None:
    messages = [pb.ChatMessage(role="system", content=[pb.ContentPart(text=system)])]
    for turn in range(turns):
        content = [pb.ContentPart(text=QUESTIONS[turn % len(QUESTIONS)])]
        if turn == 0:
            content.insert(0, pb.ContentPart(item=pb.MultimodalItem(modality=pb.IMAGE,
                                                                    input=pb.EncodeItem(data=image))))
        messages.append(pb.ChatMessage(role="user", content=content))
        request = pb.GenerateRequest(chat=pb.Chat(messages=messages), sampling=pb.SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True))
        start, first, text, tokens, usage = time.perf_counter(), None, "", 0, None
        async for reply in stub.Generate(request, timeout=3600):
            if reply.token_ids and first is None:
                first = time.perf_counter() - start
            tokens += len(reply.token_ids)
            text += reply.text
            if reply.HasField("usage") and reply.usage.prompt_tokens:
                usage = reply.usage
        records.append(dict(turn=turn, ttft=first, tokens=tokens, prompt=usage.prompt_tokens,
                            cached=usage.cached_tokens))
        messages.append(pb.ChatMessage(role="assistant", content=[pb.ContentPart(text=text)]))


async def load(target: str, system: str, images: list[bytes], turns: int, output_len: int) -> tuple[list, float]:
    records: list = []
    async with aio_channel(target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(conversation(stub, system, image, turns, output_len, records) for image in images))
        return records, time.perf_counter() - start


def run(label: str, common: list[str], vision: ServiceProcess, model_dir: Path, args, seed: int,
        extra: list[str]) -> dict:
    flags = [*common, "--vision-encoder", vision.target, *llm_slot_flags(max(args.conversations, 8)),
             "--max-model-len", "8192", *extra]
    flags += ["--kv-cache-tokens", "65536"] if args.quick else ["--mem-fraction", "0.8"]
    llm = ServiceProcess("llm", flags).start()
    try:
        llm.wait_serving(timeout=1800)
        # Warm-up: its own system prompt and image, so nothing the measured load uses is cached by it.
        asyncio.run(load(llm.target, system_prompt(model_dir, 64, salt="warm"), [png(args.side, seed + 999)], 2, 4))
        system = system_prompt(model_dir, args.system_tokens)
        images = [png(args.side, seed + c) for c in range(args.conversations)]
        encodes = metric(vision, "modalmesh_requests_total", rpc="Encode", code="OK")
        records, wall = asyncio.run(load(llm.target, system, images, args.turns, args.output_len))
        encodes = metric(vision, "modalmesh_requests_total", rpc="Encode", code="OK") - encodes
    finally:
        llm.terminate(timeout=120)
    first = [r["ttft"] for r in records if r["turn"] == 0]
    later = [r["ttft"] for r in records if r["turn"] > 0]
    later_records = [r for r in records if r["turn"] > 0]
    return dict(
        run=label, conversations=args.conversations, turns=args.turns, wall_s=wall,
        output_tok_s=sum(r["tokens"] for r in records) / wall,
        ttft_turn1_p50_ms=percentile(first, 50) * 1e3, ttft_turn1_mean_ms=statistics.mean(first) * 1e3,
        ttft_later_p50_ms=percentile(later, 50) * 1e3, ttft_later_mean_ms=statistics.mean(later) * 1e3,
        ttft_later_p99_ms=percentile(later, 99) * 1e3,
        prompt_tokens_later_mean=statistics.mean(r["prompt"] for r in later_records),
        cached_share_later=sum(r["cached"] for r in later_records) / sum(r["prompt"] for r in later_records),
        cached_share_all=sum(r["cached"] for r in records) / sum(r["prompt"] for r in records),
        encode_calls=encodes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint on the CPU")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--side", type=int, default=448, help="image side in pixels")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.output_len, args.side = (
            min(args.conversations, 4), min(args.turns, 3), min(args.system_tokens, 96), min(args.output_len, 6),
            min(args.side, 56))
        model_dir = tiny.ensure("qwen2_vl", Path(tempfile.gettempdir()) / "modalmesh-bench-multiturn")
        common = ["--device", "cpu"]
    else:
        model_dir = qwen2_vl_7b(Path(tempfile.mkdtemp(prefix="bench-multiturn-")))
        common = ["--dummy-weights", "--dtype", "bfloat16"]
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--model", str(model_dir), *common]
    vision = ServiceProcess("vision_encoder", common).start()
    try:
        vision.wait_listening(900)
        vision.wait_serving(timeout=900)
        rows = [run("cache off", common, vision, model_dir, args, 0, ["--no-prefix-caching"]),
                run("cache on", common, vision, model_dir, args, 100_000, [])]
    finally:
        vision.terminate(timeout=120)
    print(json.dumps([{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rows], indent=1))
    off, on = rows
    limit = 1 / (1 - on["cached_share_later"]) if on["cached_share_later"] < 1 else float("inf")
    print(f"\n{args.conversations} conversations x {args.turns} turns, ~{args.system_tokens}-token shared system "
          f"prompt, one {args.side}x{args.side} image, {args.output_len} output tokens per turn")
    print(f"{'':>10} | {'TTFT turn 1 p50':>15} | {'TTFT turns 2+ p50':>17} | {'mean':>9} | {'out tok/s':>9} | "
          f"{'cached (2+)':>11} | Encode calls")
    for r in rows:
        print(f"{r['run']:>10} | {r['ttft_turn1_p50_ms']:12.0f} ms | {r['ttft_later_p50_ms']:14.0f} ms | "
              f"{r['ttft_later_mean_ms']:6.0f} ms | {r['output_tok_s']:9.0f} | {r['cached_share_later']:10.1%} | "
              f"{r['encode_calls']:.0f}")
    print(f"TTFT turns 2+: {off['ttft_later_p50_ms'] / on['ttft_later_p50_ms']:.2f}x lower with the cache (p50), "
          f"{off['ttft_later_mean_ms'] / on['ttft_later_mean_ms']:.2f}x (mean); prefill-only bound {limit:.1f}x (prompt "
          f"tokens over uncached ones, {on['prompt_tokens_later_mean']:.0f} per turn; Encode skipped on top)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
