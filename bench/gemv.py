"""Batch-1 decode's weight products alone, one CUDA graph: which call reads the weights fastest.

    python bench/gemv.py             # Qwen2.5-7B shape, bf16, 28 layers + the LM head, one token
    python bench/gemv.py --quick     # tiny, on the CPU (checks the script, not speed; the Triton
                                     # columns only under TRITON_INTERPRET=1)

A decode step at batch 1 is bound by reading the weights once. This replays the step's products
(qkv, o, gate_up, down per layer, then the LM head) in one graph, with each layer's own weights (no
L2 reuse), as `F.linear(x, W)` (what the layers call: cuBLAS picks split-K for down_proj at M=1 and
adds a reduce kernel), as `torch.mv(W, x)` (cuBLAS's matrix-vector path) and as the Triton GEMV
(`modalmesh.kernels.gemv`, its default launch config), and prints each product's time, the whole
chain as tokens/s, and the weight-read limit beside them. Then every launch config in the kernel's
CANDIDATES is timed per product, and the chain again with the best config of each product: how far
the one default is from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.llm import QUICK, QWEN25_7B, copy_bandwidth  # noqa: E402
from modalmesh.kernels import gemv  # noqa: E402


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each product of one layer, and the LM head."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (cfg["vocab_size"], h)}


def product(kind: str, configs: dict[str, gemv.GemvConfig] | None = None):
    """`f(name, x, w)`: the product named `name` by one method; "triton" takes `configs[name]` (None: the default)."""
    if kind == "linear":
        return lambda name, x, w: torch.nn.functional.linear(x, w)
    if kind == "triton":
        return lambda name, x, w: gemv.gemv(x, w, config=(configs or {}).get(name))
    return lambda name, x, w: torch.mv(w, x[0])[None]


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
    reps = 20 if device.type == "cuda" else 1  # the CPU only checks the script (and interprets Triton slowly)
    with_triton = gemv.usable(inputs["qkv"], weights["qkv"][0])
    kinds = ("linear", "mv", "triton") if with_triton else ("linear", "mv")
    per_op, chain, agree = {}, {}, {}

    def rel_err(f, name):
        x, w = inputs[name], weights[name][0]
        ref = torch.nn.functional.linear(x.float(), w.float())
        return float((f(name, x, w).float() - ref).abs().max() / ref.abs().max())

    def time_op(f, name):
        ws, x = weights[name], inputs[name]
        return time_graph(lambda: [f(name, x, w) for w in ws], device, reps) / len(ws)

    def time_chain(f):
        def step():
            for layer in range(layers):
                for name in ("qkv", "o", "gate_up", "down"):
                    f(name, inputs[name], weights[name][layer])
            f("lm_head", inputs["lm_head"], weights["lm_head"][0])

        return time_graph(step, device, reps)

    for kind in kinds:
        f = product(kind)
        for name in weights:
            per_op[kind, name] = time_op(f, name)
            agree[kind, name] = rel_err(f, name)
        chain[kind] = time_chain(f)
    sweep, best = {}, {}
    if with_triton:
        for name, ws in weights.items():
            for config in gemv.CANDIDATES:  # the default among them (tests/test_gemv.py)
                sweep[config, name] = time_op(product("triton", {name: config}), name)
            best[name] = min((c for c, nm in sweep if nm == name), key=lambda c: sweep[c, name])
            agree["best", name] = rel_err(product("triton", best), name)
        chain["triton_best"] = time_chain(product("triton", best))

    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"weights {nbytes / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    if not with_triton:
        print("triton columns skipped: the GEMV kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU) and Triton")
    errs = (*kinds[1:], *(("best",) if with_triton else ()))
    print(f"{'product':>8} {'shape':>16} " + " ".join(f"{k + ' us':>9} {k + ' TB/s':>11}" for k in kinds)
          + (f" {'best config':>12} {'best us':>8} {'best TB/s':>9}" if with_triton else "")
          + "".join(f" {k + ' err':>10}" for k in errs))
    for name, ws in weights.items():
        b = ws[0].numel() * ws[0].element_size()
        row = f"{name:>8} {str(tuple(ws[0].shape)):>16} " + " ".join(
            f"{per_op[k, name] * 1e6:9.1f} {b / per_op[k, name] / 1e12:11.2f}" for k in kinds)
        if with_triton:
            t = sweep[best[name], name]
            row += f" {str(best[name]):>12} {t * 1e6:8.1f} {b / t / 1e12:9.2f}"
        print(row + "".join(f" {agree[k, name]:10.1e}" for k in errs))
    if with_triton:
        defaults = ", ".join(f"{n} {gemv.default_config(*ws[0].shape)}" for n, ws in weights.items())
        print(f"triton sweep, us per product (defaults: {defaults}):")
        print(f"{'config':>12} " + " ".join(f"{n:>9}" for n in weights))
        for config in gemv.CANDIDATES:
            print(f"{str(config):>12} " + " ".join(f"{sweep[config, n] * 1e6:9.1f}" for n in weights))
    limit = bandwidth / nbytes
    print("chain of one decode step's products: " + ", ".join(f"{k} {v * 1e3:.3f} ms ({1 / v:.1f} tok/s)"
                                                               for k, v in chain.items())
          + f"; weight-read limit {limit:.1f} tok/s")
    print("RESULT " + json.dumps({"chain_ms": {k: round(v * 1e3, 3) for k, v in chain.items()},
                                  "us": {f"{k}/{n}": round(v * 1e6, 2) for (k, n), v in per_op.items()},
                                  "triton_best": {n: str(c) for n, c in best.items()},
                                  "sweep_us": {f"{c}/{n}": round(v * 1e6, 2) for (c, n), v in sweep.items()},
                                  "limit_tok_s": round(limit, 1) if limit == limit else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
