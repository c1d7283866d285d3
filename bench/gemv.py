"""Batch-1 decode's weight products alone, one CUDA graph: which cuBLAS call reads the weights fastest.

    python bench/gemv.py             # Qwen2.5-7B shape, bf16, 28 layers + the LM head, one token
    python bench/gemv.py --quick     # tiny, on the CPU (checks the script, not speed)

A decode step at batch 1 is bound by reading the weights once. This replays the step's products
(qkv, o, gate_up, down per layer, then the LM head) in one graph, with each layer's own weights (no
L2 reuse), as `F.linear(x, W)` (what the layers call: cuBLAS picks split-K for down_proj at M=1 and
adds a reduce kernel) and as `torch.mv(W, x)` (cuBLAS's matrix-vector path), and prints each
product's time, the whole chain as tokens/s, and the weight-read limit beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.llm import QUICK, QWEN25_7B, copy_bandwidth  # noqa: E402


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each product of one layer, and the LM head."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (cfg["vocab_size"], h)}


def product(kind: str):
    if kind == "linear":
        return lambda x, w: torch.nn.functional.linear(x, w)
    return lambda x, w: torch.mv(w, x[0])[None]


def time_graph(fn, device, reps: int = 20) -> float:
    """Seconds per call of `fn` replayed from a CUDA graph (eagerly on the CPU)."""
    if device.type != "cuda":
        import time

        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = QUICK if args.quick else QWEN25_7B
    layers = cfg["num_hidden_layers"]
    g = torch.Generator(device=device).manual_seed(0)
    weights = {name: [torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02
                      for _ in range(1 if name == "lm_head" else layers)]
               for name, shape in shapes(cfg).items()}
    inputs = {name: torch.randn(1, shape[1], generator=g, device=device, dtype=dtype)
              for name, shape in shapes(cfg).items()}
    nbytes = sum(w.numel() * w.element_size() for ws in weights.values() for w in ws)
    bandwidth = copy_bandwidth(device)
    per_op, chain, agree = {}, {}, {}
    for kind in ("linear", "mv"):
        f = product(kind)
        for name, ws in weights.items():
            x = inputs[name]
            per_op[kind, name] = time_graph(lambda ws=ws, x=x: [f(x, w) for w in ws], device) / len(ws)
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            agree[kind, name] = float((f(x, ws[0]).float() - ref).abs().max() / ref.abs().max())

        def step():
            for layer in range(layers):
                for name in ("qkv", "o", "gate_up", "down"):
                    f(inputs[name], weights[name][layer])
            f(inputs["lm_head"], weights["lm_head"][0])

        chain[kind] = time_graph(step, device)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"weights {nbytes / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'product':>8} {'shape':>14} {'linear us':>10} {'mv us':>8} {'linear TB/s':>12} {'mv TB/s':>8} "
          f"{'mv rel err':>10}")
    for name, ws in weights.items():
        b = ws[0].numel() * ws[0].element_size()
        lin, mv = per_op["linear", name], per_op["mv", name]
        print(f"{name:>8} {str(tuple(ws[0].shape)):>14} {lin * 1e6:10.1f} {mv * 1e6:8.1f} {b / lin / 1e12:12.2f} "
              f"{b / mv / 1e12:8.2f} {agree['mv', name]:10.1e}")
    limit = bandwidth / nbytes
    print(f"chain of one decode step's products: linear {chain['linear'] * 1e3:.3f} ms ({1 / chain['linear']:.1f} "
          f"tok/s), mv {chain['mv'] * 1e3:.3f} ms ({1 / chain['mv']:.1f} tok/s); weight-read limit {limit:.1f} tok/s")
    print("RESULT " + json.dumps({"chain_ms": {k: round(v * 1e3, 3) for k, v in chain.items()},
                                  "us": {f"{k}/{n}": round(v * 1e6, 2) for (k, n), v in per_op.items()},
                                  "limit_tok_s": round(limit, 1) if limit == limit else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
