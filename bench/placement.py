"""Where the encoder runs: image+text load through the real services, by GPU placement.

    python bench/placement.py                  # two GPUs: Qwen2-VL-7B shape, random weights, bf16
    python bench/placement.py --quick          # tiny checkpoint on the CPU (checks the script)

Runs the same load — N concurrent Generate calls, each one image (its own pixels, so no
cache hits) and a short text, fixed output length — against three layouts, each process
pinned with CUDA_VISIBLE_DEVICES as compose pins a container:

  shared        vision encoder and LLM on GPU 0
  split         vision encoder on GPU 0, LLM on GPU 1
  two-replicas  vision encoders on GPU 0 and GPU 1 behind the LLM's round_robin channel, LLM on GPU 1
  embeddings    the LLM alone on GPU 0; each client sends its image's embedding (random rows of the
                encoder's answer shape, its own per request), as an encoder's answer would reach it:
                what the LLM's GPU can serve of this load whatever the encoder pool does (one GPU)

and prints requests/s, output tok/s and TTFT percentiles per layout, plus each vision
replica's Encode count (both replicas must take load).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import llm_slot_flags, percentile, scrape, total  # noqa: E402
from modalmesh import pb  # noqa: E402
from modalmesh.ops.launcher import ServiceProcess  # noqa: E402
from modalmesh.rpc.channel import aio_channel  # noqa: E402
from modalmesh.testing import tiny  # noqa: E402
from services.llm.step_inputs import STEP_PATHS  # noqa: E402  (modalmesh_engine_steps_total)

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
LAYOUTS = {  # name: (GPUs of the vision replicas, GPU of the LLM)
    "shared": (["0"], "0"),
    "split": (["0"], "1"),
    "two-replicas": (["0", "1"], "1"),
    "embeddings": ([], "0"),
}


QWEN2_VL_VOCAB = 152064


def qwen2_vl_7b(root: Path) -> Path:
    """config.json (Qwen2-VL-7B shape), tokenizer and image processor; weights come from --dummy-weights."""
    import transformers as tf

    # fill_to: random weights sample any of the model's ids, and the tokenizer covers them all, as a real one does.
    tok = tiny.build_tokenizer(tiny.QWEN_SPECIALS, chat_template=tiny.QWEN_CHAT_TEMPLATE, eos="<|im_end|>",
                               pad="<|endoftext|>", fill_to=QWEN2_VL_VOCAB)
    ids = {t: tok.convert_tokens_to_ids(t) for t in tiny.QWEN_SPECIALS}
    text = dict(vocab_size=QWEN2_VL_VOCAB, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    vision = dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
                           architectures=["Qwen2VLForConditionalGeneration"])
    root.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(root)
    tok.save_pretrained(root)
    tf.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).save_pretrained(root)
    return root


def png(side: int, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def image_item(data: bytes) -> pb.MultimodalItem:
    return pb.MultimodalItem(modality=pb.IMAGE, input=pb.EncodeItem(data=data))


def embedding_items(ckpt: Path, side: int, count: int, seed: int, dtype) -> list[pb.MultimodalItem]:
    """`count` image embeddings as the checkpoint's vision encoder answers for a side x side image: the patch
    grid of the image as its processor resizes it (`image_grid`: sides to multiples of patch x merge, within
    the pixel bounds), (h / merge) * (w / merge) rows of the LLM's hidden size, in the services' `dtype`.
    Random rows, each request its own, so no prefix-cache hit."""
    import torch

    from modalmesh.image_grid import ImageGrid, smart_resize
    from modalmesh.rpc.codec import to_proto

    cfg = json.loads((ckpt / "config.json").read_text())
    grid = ImageGrid.from_preprocessor(json.loads((ckpt / "preprocessor_config.json").read_text()))
    factor = grid.patch_size * grid.merge_size
    h, w = smart_resize(side, side, factor, grid.min_pixels, grid.max_pixels)
    thw, rows = [1, h // grid.patch_size, w // grid.patch_size], (h // factor) * (w // factor)
    hidden = cfg.get("text_config", cfg)["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    return [pb.MultimodalItem(modality=pb.IMAGE, embedding=pb.Embedding(
        embedding=to_proto(torch.randn(rows, hidden, generator=gen).to(dtype)),
        grid_thw=thw, num_placeholder_tokens=rows)) for _ in range(count)]


async def load(target: str, items: list[pb.MultimodalItem], concurrency: int, output_len: int) -> dict:
    ttfts, tokens = [], 0
    queue: asyncio.Queue = asyncio.Queue()
    for i, item in enumerate(items):
        queue.put_nowait((i, item))

    async def worker(stub):
        nonlocal tokens
        while not queue.empty():
            i, item = queue.get_nowait()
            request = pb.GenerateRequest(
                text=f"{VISION} Picture {i}: describe it.", items=[item],
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
            start, first = time.perf_counter(), None
            async for reply in stub.Generate(request, timeout=1800):
                if reply.token_ids and first is None:
                    first = time.perf_counter() - start
                tokens += len(reply.token_ids)
            ttfts.append(first)

    async with aio_channel(target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(worker(stub) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return dict(requests_s=len(items) / wall, output_tok_s=tokens / wall, wall_s=wall,
                ttft_p50_ms=percentile(ttfts, 50) * 1e3, ttft_p99_ms=percentile(ttfts, 99) * 1e3,
                ttft_mean_ms=statistics.mean(ttfts) * 1e3)


def metric(proc: ServiceProcess, name: str, **labels) -> float:
    return total(scrape(proc.metrics_port), name, **labels)


def encode_count(samples: list) -> float:
    """Encode calls answered OK, in one scrape of a vision replica."""
    return total(samples, "modalmesh_requests_total", rpc="Encode", code="OK")


# Where a request's time goes, as the services see it: (row, service, histogram, labels). The LLM's set-up
# stages come before the engine has the request (its TTFT starts after them); the LLM's Encode calls (rpc, take)
# are per item, and the encoder's handler and its stages per Encode call; the encoder's device time per batch.
PHASES = (
    ("setup_link", "llm", "modalmesh_generate_setup_seconds", {"stage": "link"}),
    ("setup_validate", "llm", "modalmesh_generate_setup_seconds", {"stage": "validate"}),
    ("setup_prefix", "llm", "modalmesh_generate_setup_seconds", {"stage": "prefix"}),
    ("setup_encode", "llm", "modalmesh_generate_setup_seconds", {"stage": "encode"}),
    ("setup_admit", "llm", "modalmesh_generate_setup_seconds", {"stage": "admit"}),
    ("encode_rpc", "llm", "modalmesh_encode_call_seconds", {"stage": "rpc"}),
    ("encode_take", "llm", "modalmesh_encode_call_seconds", {"stage": "take"}),
    ("enc_handler", "vision", "modalmesh_request_duration_seconds", {"rpc": "Encode"}),
    ("engine_ttft", "llm", "modalmesh_time_to_first_token_seconds", {}),
    ("queue", "llm", "modalmesh_request_queue_time_seconds", {}),
    ("prefill", "llm", "modalmesh_request_prefill_time_seconds", {}),
    ("decode", "llm", "modalmesh_request_decode_time_seconds", {}),
    ("enc_prepare", "vision", "modalmesh_encode_stage_seconds", {"stage": "prepare"}),
    ("enc_batch", "vision", "modalmesh_encode_stage_seconds", {"stage": "batch"}),
    ("enc_device", "vision", "modalmesh_encode_stage_seconds", {"stage": "device"}),
    ("enc_respond", "vision", "modalmesh_encode_stage_seconds", {"stage": "respond"}),
    ("batch_device", "vision", "modalmesh_encoder_batch_seconds", {"phase": "device"}),
)
# The LLM's engine steps over the load: how many, and their mean sequences and tokens (batch_size, batch_tokens).
STEP_HISTOGRAMS = ("modalmesh_batch_size", "modalmesh_batch_tokens")
STEP_PHASES = ("schedule", "model", "post")  # modalmesh_engine_step_phase_seconds_total


def scrape_services(procs: dict[str, list[ServiceProcess]]) -> dict[str, list[list]]:
    """One scrape of each replica of each service."""
    return {svc: [scrape(p.metrics_port) for p in replicas] for svc, replicas in procs.items()}


def phase_totals(samples: dict[str, list[list]]) -> dict[str, tuple[float, float]]:
    """Each phase's (sum, count) over its services' replicas (`scrape_services`)."""
    return {col: (sum(total(s, name + "_sum", **labels) for s in samples[svc]),
                  sum(total(s, name + "_count", **labels) for s in samples[svc]))
            for col, svc, name, labels in PHASES}


def phase_means_ms(before: dict, after: dict) -> dict[str, float | None]:
    means = {}
    for col, (s1, c1) in after.items():
        s0, c0 = before[col]
        means[col] = (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None
    return means


def step_stats(before: list, after: list, wall_s: float) -> dict:
    """The LLM's engine steps between two scrapes: steps/s, mean sequences and tokens per step."""
    count = total(after, "modalmesh_batch_size_count") - total(before, "modalmesh_batch_size_count")
    means = {name: (total(after, name + "_sum") - total(before, name + "_sum")) / max(count, 1)
             for name in STEP_HISTOGRAMS}

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    return dict(steps_s=count / wall_s, seqs=means["modalmesh_batch_size"], tokens=means["modalmesh_batch_tokens"],
                step_ms=wall_s / count * 1e3 if count else float("nan"),
                paths={path: delta("modalmesh_engine_steps_total", path=path) for path in STEP_PATHS},
                busy={phase: delta("modalmesh_engine_step_phase_seconds_total", phase=phase) / wall_s
                      for phase in STEP_PHASES})


def run_layout(name: str, ckpt: Path, args) -> dict:
    vision_gpus, llm_gpu = LAYOUTS[name]
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--model", str(ckpt)]
    if args.quick:
        common += ["--device", "cpu"]
    else:
        common += ["--dummy-weights", "--dtype", "bfloat16"]
    procs: list[ServiceProcess] = []
    try:
        visions = [ServiceProcess("vision_encoder", common, env={"CUDA_VISIBLE_DEVICES": gpu}).start()
                   for gpu in vision_gpus]
        procs += visions
        for v in visions:
            v.wait_listening(600)
        targets = ",".join(f"127.0.0.1:{v.grpc_port}" for v in visions)
        llm_flags = [*common, *llm_slot_flags(args.concurrency), *shlex.split(args.llm_args)]
        if visions:
            llm_flags += ["--vision-encoder", f"ipv4:{targets}"]
        if args.quick:
            llm_flags += ["--kv-cache-tokens", "65536"]
        llm = ServiceProcess("llm", llm_flags, env={"CUDA_VISIBLE_DEVICES": llm_gpu}).start()
        procs.append(llm)
        for p in procs:
            p.wait_serving(timeout=1800)
        if visions:
            warm = [image_item(png(args.side, 10_000 + i)) for i in range(min(4, args.requests))]
            items = [image_item(png(args.side, i)) for i in range(args.requests)]
        else:
            import torch

            dtype = torch.float32 if args.quick else torch.bfloat16
            warm = embedding_items(ckpt, args.side, min(4, args.requests), 1, dtype)
            items = embedding_items(ckpt, args.side, args.requests, 0, dtype)
        asyncio.run(load(llm.target, warm, len(warm), 2))  # first calls: graphs, kernels, channels
        services = {"llm": [llm], "vision": visions}
        before = scrape_services(services)
        print(f"{name}: load starts", flush=True)  # a profiler attaches now (scripts/device.sh)
        stats = asyncio.run(load(llm.target, items, args.concurrency, args.output_len))
        after = scrape_services(services)
        stats["encode_calls_per_replica"] = [encode_count(a) - encode_count(b)
                                             for a, b in zip(after["vision"], before["vision"])]
        stats["phase_mean_ms"] = phase_means_ms(phase_totals(before), phase_totals(after))
        stats["llm_steps"] = step_stats(before["llm"][0], after["llm"][0], stats["wall_s"])
        stats["layout"] = name
        return stats
    finally:
        for p in reversed(procs):
            p.terminate(timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint on the CPU")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--side", type=int, default=448, help="image side in pixels")
    parser.add_argument("--llm-args", default="", help="more LLM service flags, e.g. '--max-batch-tokens 2048'")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.requests, args.output_len, args.side = min(args.concurrency, 8), \
            min(args.requests, 16), min(args.output_len, 8), min(args.side, 112)
        ckpt = tiny.ensure("qwen2_vl", Path(tempfile.gettempdir()) / "modalmesh-bench-placement")
    else:
        ckpt = qwen2_vl_7b(Path(tempfile.mkdtemp(prefix="bench-placement-")))
    rows = [run_layout(name, ckpt, args) for name in args.layouts.split(",")]
    print(json.dumps([{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()
                       if k not in ("phase_mean_ms", "llm_steps")}
                      for r in rows], indent=1))
    print(f"\n{args.requests} requests, {args.concurrency} concurrent, one {args.side}x{args.side} image each, "
          f"{args.output_len} output tokens" + (f"; LLM flags {args.llm_args}" if args.llm_args else ""))
    print(f"{'layout':>13} | {'req/s':>7} | {'out tok/s':>9} | {'TTFT p50':>9} | {'TTFT p99':>9} | Encode calls per replica")
    for r in rows:
        print(f"{r['layout']:>13} | {r['requests_s']:7.2f} | {r['output_tok_s']:9.0f} | {r['ttft_p50_ms']:7.0f} ms | "
              f"{r['ttft_p99_ms']:7.0f} ms | {r['encode_calls_per_replica']}")
    print("\nmean ms, from the services' histograms: per request (LLM set-up and engine), per item (LLM's Encode "
          "calls), per Encode call (vision handler and stages), per batch (batch_device); client TTFT = set-up + "
          "engine TTFT + the stream's first message")
    print("\nthe LLM's engine steps over the load: per second, mean ms apart, mean sequences and tokens each, "
          "steps by path, and the engine thread's share of the wall time by phase")
    for r in rows:
        st = r["llm_steps"]
        print(f"{r['layout']:>13} | {st['steps_s']:7.1f} steps/s | {st['step_ms']:6.2f} ms | {st['seqs']:6.1f} seqs | "
              f"{st['tokens']:7.1f} tokens | " + " ".join(f"{k} {v:.0f}" for k, v in st["paths"].items()) + " | "
              + " ".join(f"{k} {v:.0%}" for k, v in st["busy"].items()))
    print(f"\n{'phase':>14} | " + " | ".join(f"{r['layout']:>12}" for r in rows))
    print(f"{'client TTFT':>14} | " + " | ".join(f"{r['ttft_mean_ms']:12.1f}" for r in rows))
    for col, *_ in PHASES:
        cells = (r["phase_mean_ms"][col] for r in rows)
        print(f"{col:>14} | " + " | ".join(f"{v:12.1f}" if v is not None else f"{'-':>12}" for v in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
