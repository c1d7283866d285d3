"""All-reduce latency of a tensor-parallel decode step, two GPUs: what the layers pay 2 x num_layers times a step.

    python bench/allreduce.py            # 2 ranks (NCCL), sizes of a Qwen2.5-7B decode at batch 1, 32 and 256
    python bench/allreduce.py --quick    # 2 CPU ranks over gloo (checks the script, not speed)

For each size: NCCL through torch.distributed, eager and replayed from a CUDA
graph (as our decode graphs capture it), beside PyTorch's symmetric-memory
one-shot all-reduce (peer-to-peer loads, the custom all-reduce vLLM and SGLang
use for small messages; no NVLink multicast), and beside the limit: the bytes
each rank must read from its peer over the measured peer-to-peer copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from modalmesh import distributed  # noqa: E402

HIDDEN = 3584  # Qwen2.5-7B


def _time(fn, n: int, cuda: bool) -> float:
    for _ in range(5):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n


def _worker(rank: int, world: int, batches: list[int], quick: bool) -> None:
    cuda = not quick
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = {}
    p2p_bw = float("nan")
    if cuda and rank == 0:
        x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:1")
        y = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:0")
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize()
        p2p_bw = 10 * x.numel() / (time.perf_counter() - t0)
        del x, y
    symm = None
    if cuda:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            symm = symm_mem
        except ImportError:
            symm = None
    for b in batches:
        x = torch.randn(b, HIDDEN, dtype=dtype, device=device)
        row = {"bytes": x.numel() * x.element_size()}
        row["nccl_eager_us"] = _time(lambda: dist.all_reduce(x), 200, cuda) * 1e6
        if cuda:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dist.all_reduce(x)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                for _ in range(10):
                    dist.all_reduce(x)
            row["nccl_graph_us"] = _time(graph.replay, 50, cuda) * 1e6 / 10
        if symm is not None:
            try:
                buf = symm.empty(b, HIDDEN, dtype=dtype, device=device)
                symm.rendezvous(buf, dist.group.WORLD.group_name)
                buf.copy_(x)
                op = torch.ops.symm_mem.one_shot_all_reduce
                row["symm_one_shot_us"] = _time(lambda: op(buf, "sum", dist.group.WORLD.group_name), 200, cuda) * 1e6
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(10):
                        op(buf, "sum", dist.group.WORLD.group_name)
                row["symm_one_shot_graph_us"] = _time(graph.replay, 50, cuda) * 1e6 / 10
            except Exception as exc:  # noqa: BLE001 - report why the peer column is missing
                row["symm_error"] = f"{type(exc).__name__}: {exc}"[:200]
        row["limit_us"] = row["bytes"] / p2p_bw * 1e6 if p2p_bw == p2p_bw else float("nan")
        rows[b] = row
    if rank == 0:
        print(f"peer-to-peer copy GPU1->GPU0: {p2p_bw / 1e9:.1f} GB/s" if cuda else "gloo on CPU")
        print(f"{'batch':>6} {'bytes':>9} {'NCCL eager us':>14} {'NCCL graph us':>14} {'symm 1-shot us':>15} "
              f"{'symm graph us':>14} {'limit us':>9}")
        for b, r in rows.items():
            print(f"{b:>6} {r['bytes']:>9} {r['nccl_eager_us']:>14.1f} {r.get('nccl_graph_us', float('nan')):>14.1f} "
                  f"{r.get('symm_one_shot_us', float('nan')):>15.1f} "
                  f"{r.get('symm_one_shot_graph_us', float('nan')):>14.1f} {r['limit_us']:>9.2f}")
            if "symm_error" in r:
                print(f"   symmetric memory: {r['symm_error']}")
        print("RESULT " + json.dumps({str(b): {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
                                      for b, r in rows.items()}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", default="1,32,256")
    args = parser.parse_args()
    distributed.launch(2, _worker, [int(b) for b in args.batches.split(",")], args.quick,
                       backend="gloo" if args.quick else "nccl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
