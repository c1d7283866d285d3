"""Load generator for the LLM service: N concurrent gRPC streams, fixed prompt / output lengths.

    python bench/serve.py --target 127.0.0.1:50053 --concurrency 256 --requests 512
    python bench/serve.py --start              # starts `python -m services.llm` itself
                                               # (Qwen2.5-7B shape, random weights, bf16 on a GPU)
    python bench/serve.py --start --concurrency 1,16 --requests 8,64 --prompt-len 3968 --output-len 64
                                               # one load after the other on one started service

Reports output tokens/s, time to first token and time per output token
percentiles, measured at the client, the numbers a user compares with vLLM /
SGLang. Prompts are random token ids (ignore_eos, so every request produces
exactly --output-len tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench import llm_slot_flags, percentile  # noqa: E402
from modalmesh import pb  # noqa: E402
from modalmesh.rpc.channel import aio_channel  # noqa: E402


async def one(stub, prompt: list[int], output_len: int, results: list) -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True))
    start = time.perf_counter()
    stamps, tokens = [], 0
    async for reply in stub.Generate(request, timeout=3600):
        if reply.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(reply.token_ids)
    results.append((start, stamps, tokens))


async def load(target: str, concurrency: int, prompts: list[list[int]], output_len: int,
               go_at: float | None = None) -> tuple[list, float, float]:
    """`concurrency` streams over `prompts`: (start, token stamps, tokens) per request, the load's start, its end.
    `go_at` (time.perf_counter, one clock for every process of the host): start then, with the other clients."""
    results: list = []
    async with aio_channel(target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        await one(stub, prompts[0][:8], 2, [])  # warm-up
        queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)

        async def worker():
            while not queue.empty():
                await one(stub, queue.get_nowait(), output_len, results)

        if go_at is not None:
            await asyncio.sleep(max(0.0, go_at - time.perf_counter()))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, start, time.perf_counter()


def _client_process(args: tuple) -> tuple[list, float, float]:
    return asyncio.run(load(*args))


def run(target: str, concurrency: int, requests: int, prompt_len: int, output_len: int, vocab: int,
        client_procs: int = 1, seed: int = 0) -> dict:
    """The load from `client_procs` processes (streams and requests split evenly), so that the client's own
    event loop is never what limits a fast server; every figure is over all of them. Each `seed` gives other
    prompts, so a later load on the same service finds none of an earlier one's in the prefix cache."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    client_procs = min(client_procs, concurrency, requests)  # each process runs a stream and has a prompt
    if client_procs <= 1:
        results, start, end = asyncio.run(load(target, concurrency, prompts, output_len))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        go_at = time.perf_counter() + 5.0  # every client connected and warmed up by then
        shares = [(target, concurrency // client_procs + (i < concurrency % client_procs), prompts[i::client_procs],
                   output_len, go_at) for i in range(client_procs)]
        with cf.ProcessPoolExecutor(client_procs, mp_context=mp.get_context("spawn")) as pool:
            parts = list(pool.map(_client_process, shares))
        results = [r for part in parts for r in part[0]]
        start, end = min(p[1] for p in parts), max(p[2] for p in parts)
    wall = end - start
    ttft = [stamps[0] - s for s, stamps, _ in results if stamps]
    tpot = [(stamps[-1] - stamps[0]) / (n - 1) for _, stamps, n in results if n > 1]
    total = sum(n for _, _, n in results)
    return dict(requests=len(results), output_tokens=total, wall_s=wall, output_tok_s=total / wall,
                ttft_p50_ms=percentile(ttft, 50) * 1e3, ttft_p99_ms=percentile(ttft, 99) * 1e3,
                tpot_p50_ms=percentile(tpot, 50) * 1e3, tpot_p99_ms=percentile(tpot, 99) * 1e3,
                tpot_mean_ms=statistics.mean(tpot) * 1e3 if tpot else float("nan"), client_procs=client_procs)


def start_service(max_num_seqs: int, quick: bool, tp: int = 1, extra: tuple[str, ...] = ()):
    from bench.llm import QUICK, QWEN25_7B, make_checkpoint
    from modalmesh.ops.launcher import ServiceProcess

    ckpt = make_checkpoint(QUICK if quick else QWEN25_7B)
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--model", str(ckpt), "--dummy-weights",
             *llm_slot_flags(max_num_seqs), "--max-queue", "100000", "--max-model-len", "4096",
             "--tensor-parallel-size", str(tp)]
    if quick:
        flags += ["--device", "cpu", "--kv-cache-tokens", "65536"]
    proc = ServiceProcess("llm", [*flags, *extra], echo=False).start()
    proc.wait_serving(timeout=900)
    return proc, (QUICK if quick else QWEN25_7B)["vocab_size"]


def gc_pauses(proc) -> dict | None:
    """The started service's modalmesh_gc_pause_seconds, {generation: {"n": count, "s": seconds}}."""
    if proc is None or not getattr(proc, "metrics_port", None):
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    out = {g: {"n": 0.0, "s": 0.0} for g in range(3)}
    for family in text_string_to_metric_families(body):
        if family.name == "modalmesh_gc_pause_seconds":
            for sample in family.samples:
                key = {"modalmesh_gc_pause_seconds_count": "n", "modalmesh_gc_pause_seconds_sum": "s"}.get(sample.name)
                if key:
                    out[int(sample.labels["generation"])][key] = sample.value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:50053")
    parser.add_argument("--start", action="store_true", help="start a local LLM service (random weights)")
    parser.add_argument("--quick", action="store_true", help="with --start: a tiny model on the CPU")
    parser.add_argument("--tp", type=int, default=1, help="with --start: --tensor-parallel-size")
    parser.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[256],
                        help="concurrent streams; a comma list runs one load after the other on the same service")
    parser.add_argument("--requests", type=lambda v: [int(r) for r in v.split(",")], default=[512],
                        help="requests of each load: one number for all, or a comma list beside --concurrency's")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--client-procs", type=int, default=None,
                        help="load-generating processes (default 4; 1 with --quick): one Python client's event loop "
                             "can be the limit of a fast server")
    parser.add_argument("--llm-flag", action="append", default=[],
                        help="with --start: one more flag for the service (repeat), e.g. --llm-flag=--no-gc-freeze")
    args = parser.parse_args()
    if len(args.requests) not in (1, len(args.concurrency)):
        parser.error("--requests: one number, or as many as --concurrency has")
    requests = args.requests * len(args.concurrency) if len(args.requests) == 1 else args.requests
    proc = None
    if args.start:
        proc, args.vocab = start_service(max(args.concurrency), args.quick, args.tp, tuple(args.llm_flag))
        args.target = proc.target
    lines = []
    try:
        for seed, (concurrency, n) in enumerate(zip(args.concurrency, requests)):
            gc_before = gc_pauses(proc)
            stats = run(args.target, concurrency, n, args.prompt_len, args.output_len, args.vocab,
                        args.client_procs if args.client_procs is not None else (1 if args.quick else 4), seed)
            gc_after = gc_pauses(proc)
            if gc_before is not None and gc_after is not None:  # the service's collector pauses during the load
                stats.update({f"gc_gen{g}_{'n' if k == 'n' else 'ms'}": (gc_after[g][k] - gc_before[g][k]) * (1e3 if k == "s" else 1)
                              for g in range(3) for k in ("n", "s")})
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in stats.items()}, indent=1))
            lines.append(f"TP={args.tp}{' ' + ' '.join(args.llm_flag) if args.llm_flag else ''}: {concurrency} concurrent streams, {args.prompt_len} in / {args.output_len} out: "
                         f"{stats['output_tok_s']:.0f} output tok/s, TTFT p50 {stats['ttft_p50_ms']:.0f} ms "
                         f"p99 {stats['ttft_p99_ms']:.0f} ms, TPOT p50 {stats['tpot_p50_ms']:.1f} ms")
    finally:
        print("\n".join(lines))  # every finished load's line, also when a later one fails
        if proc is not None:
            proc.terminate(timeout=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
