"""The paged prefill kernel's launch configs, beside the paths it replaced and dense varlen attention.

    python bench/paged_prefill.py            # on a GPU: Qwen2.5-7B heads, bf16
    python bench/paged_prefill.py --quick    # tiny shapes under TRITON_INTERPRET=1 (checks the script)

For each shape (bench/attention.py's paged prefill shapes): every candidate LaunchConfig of
`modalmesh.kernels.paged_prefill` (TFLOP/s, max error against torch_naive), then the peers from the
same run: SDPA over gathered pages (what the LLM ran for such steps before, `sdpa_efficient`'s paged
path) and, for one-sequence shapes, as the bar for a kernel that reads its keys from pages, a flash
kernel on the same attention laid out densely (no pages: `fa3`, `torch_varlen` or `fa2`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.attention import Shape, make_call, run, shapes, timed  # noqa: E402
from modalmesh.attention import registry  # noqa: E402
from modalmesh.attention.backends.naive import NaiveBackend  # noqa: E402
from modalmesh.kernels.paged_prefill import DEFAULT, LaunchConfig, paged_prefill, plan_blocks  # noqa: E402

CANDIDATES = [DEFAULT] + [LaunchConfig(m, n, w, s) for m, n, w, s in (
    (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
    (64, 128, 4, 2), (256, 64, 8, 2))]


def dense_peer(shape: Shape, device: torch.device):
    """(name, seconds) of the first flash kernel installed on the same attention laid out densely: one
    sequence's new tokens as q, its whole context as k/v, causal bottom-right (flash's alignment). Only for
    one-sequence shapes; (None, None) otherwise."""
    if len(shape.query_lens) != 1 or device.type != "cuda":
        return None, None
    probe = next((p for p in map(registry.probe, ("fa3", "torch_varlen", "fa2")) if p.ok), None)
    if probe is None:
        return None, None
    kv = shape.kv_heads or shape.heads
    q = torch.randn(1, shape.query_lens[0], shape.heads, shape.head_dim, device=device, dtype=shape.dtype)
    k = torch.randn(1, shape.context_lens[0], kv, shape.head_dim, device=device, dtype=shape.dtype)
    v = torch.randn_like(k)
    return probe.name, timed(lambda: probe.backend.dense(q, k, v, causal=True, scale=shape.head_dim ** -0.5,
                                                         window=None), device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    chosen = [s for s in shapes(device.type == "cpu") if s.layout == "paged" and max(s.query_lens) > 1]
    if device.type == "cpu":  # Triton's interpreter computes bf16 dots wrongly (numpy has no bf16): the script's check
        chosen = [dataclasses.replace(s, dtype=torch.float32) for s in chosen]
    for shape in chosen:
        q, k_cache, v_cache, meta = make_call(shape, device)
        reference = run(NaiveBackend(registry.spec("torch_naive")), shape,
                        (q.float(), k_cache.float(), v_cache.float(), meta))
        rows = [0, *accumulate(shape.query_lens)]
        group = shape.heads // (shape.kv_heads or shape.heads)
        flops = shape.flops()
        print(f"\n== {shape.name}  ({flops / 1e9:.1f} GFLOP)")
        best = None
        for cfg in CANDIDATES:
            if cfg.block_m < group:
                continue
            plan = plan_blocks(shape.query_lens, shape.context_lens, rows, group=group, config=cfg, device=device)
            call = lambda: paged_prefill(q, k_cache, v_cache, meta.block_table, plan,  # noqa: E731
                                         scale=shape.head_dim ** -0.5)
            try:
                err = (call().float() - reference).abs().max().item()
                seconds = timed(call, device)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a row of the table
                print(f"   {cfg}  error {type(exc).__name__}: {str(exc)[:80]}")
                continue
            mark = " (DEFAULT)" if cfg == DEFAULT else ""
            print(f"   {cfg}  {seconds * 1e3:8.3f} ms  {flops / seconds / 1e12:7.1f} TFLOP/s  max err {err:.2e}{mark}")
            best = min(best or (seconds, cfg), (seconds, cfg), key=lambda t: t[0])
        if best:
            print(f"   best: {best[1]} at {flops / best[0] / 1e12:.1f} TFLOP/s")
        gather = registry.probe("sdpa_efficient" if device.type == "cuda" else "sdpa_math")
        if gather.ok:
            seconds = timed(lambda: run(gather.backend, shape, (q, k_cache, v_cache, meta)), device)
            print(f"   peer: {gather.name} over gathered pages  {seconds * 1e3:8.3f} ms  "
                  f"{flops / seconds / 1e12:7.1f} TFLOP/s")
        name, seconds = dense_peer(shape, device)
        if seconds:
            print(f"   bar: {name} on dense q and k (no pages)  {seconds * 1e3:8.3f} ms  "
                  f"{flops / seconds / 1e12:7.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
