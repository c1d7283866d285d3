"""The Triton GroupNorm(+SiLU) at the SDXL decoder's shapes: each launch config against PyTorch's, beside the
memory-bandwidth limit.

    python bench/group_norm.py            # 1024² decode's GroupNorms, bf16, channels-last, on the GPU
    python bench/group_norm.py --quick    # tiny shapes on the CPU (checks the script; the kernels only under
                                          # TRITON_INTERPRET=1)
    python bench/group_norm.py --passes   # each pass alone per shape, GB/s beside PyTorch's own elementwise
                                          # kernel and the copy bandwidth, over warps and tiles per program

A decode at 1024² runs 30 GroupNorms over 3.7 GB of activations (bf16). The kernels read each input twice
(stats, then apply) and write it once, so the limit is 3 bytes moved per input byte at the device's copy
bandwidth. Each config of `STATS` and `APPLY` is timed over the decoder's whole list of shapes (weighted by how
often each occurs), for the stats pass's parameters and the apply pass's separately, then the best of each
together: how far the default (`group_norm.DEFAULT`) is from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import timer  # noqa: E402
from bench.llm import copy_bandwidth  # noqa: E402
from modalmesh.kernels import group_norm as gn  # noqa: E402

# (channels, side, count) of the SDXL decoder's GroupNorm inputs at 1024² (latent 128²): the mid block's and
# the up blocks' resnets (norm1, norm2), the mid attention's, and conv_norm_out
SDXL_1024 = ((512, 128, 11), (512, 256, 6), (512, 512, 1), (256, 512, 5), (256, 1024, 1), (128, 1024, 6))
QUICK = ((16, 8, 2), (8, 16, 1))
STATS = [dict(stats_tile=t, programs=p, stats_block_c=c) for t in (2048, 4096, 8192) for p in (1024, 2048, 4096)
         for c in (64, 128, 256)]
APPLY = [dict(apply_tile=t, apply_block_c=c) for t in (1024, 2048, 4096, 8192) for c in (64, 128, 256)]
# --passes: the apply pass's parallelism per SM (bytes in flight) rather than its tile shape, which APPLY sweeps
APPLY_PASSES = [dict(apply_tile=t, apply_warps=w, apply_tiles=k) for t in (2048, 4096, 8192) for w in (4, 8, 16)
                for k in (1, 4) if t // (32 * w) >= 4]
STATS_PASSES = [dict(stats_tile=t, programs=p, stats_warps=w) for t in (2048, 4096) for p in (1024, 4096)
                for w in (4, 8)]


def decoder_ms(inputs, run, device, iters) -> float:
    """ms of the decoder's GroupNorms: each shape's time times how often it occurs."""
    return sum(count * timer(lambda x=x: run(x), device, 2, iters) for x, count in inputs)


def per_call_ms(fn, device, iters, repeat=10) -> float:
    """ms per call of `fn` launched `repeat` times back to back: the device's time, not the host's launch."""
    return timer(lambda: [fn() for _ in range(repeat)], device, 2, iters) / repeat


def passes(inputs, weight, bias, groups, device, iters, bandwidth) -> None:
    """Each pass alone, per shape: µs and GB/s (bytes read + written; "apply" includes group_moments, a
    program per group over the small partials) beside PyTorch's own elementwise
    kernel over the same tensor (x * 1.5, one read and one write) and the copy bandwidth."""
    print(f"\n# each pass alone (copy bandwidth {bandwidth / 1e9:.0f} GB/s); apply reads and writes x, stats reads it")
    print("| C x side | x MB | torch x*1.5 GB/s | apply default GB/s | apply no SiLU GB/s | best apply GB/s "
          "(config) | stats default GB/s | best stats GB/s (config) |")
    print("|---|---|---|---|---|---|---|---|")
    totals: dict[str, float] = {}
    for x, count in inputs:
        c, nbytes = x.shape[1], x.numel() * x.element_size()
        moments = gn._partial_moments(x, None, gn.DEFAULT)
        g = groups(x)

        def apply(config, silu=True, x=x, c=c, g=g, moments=moments):
            return lambda: gn.group_norm(x, g, weight[c], bias[c], 1e-6, silu=silu, moments=moments, config=config)

        def stats(config, x=x):
            return lambda: gn._partial_moments(x, None, config)

        gbs = lambda ms, moved: moved / ms / 1e6  # noqa: E731
        torch_ms = per_call_ms(lambda x=x: x * 1.5, device, iters)
        rows = {}
        for name, space, make, moved in (("apply", APPLY_PASSES, apply, 2 * nbytes),
                                         ("stats", STATS_PASSES, stats, nbytes)):
            timed = sorted((per_call_ms(make(dataclasses.replace(gn.DEFAULT, **p)), device, iters), str(p))
                           for p in space)
            default = per_call_ms(make(gn.DEFAULT), device, iters)
            rows[name] = (gbs(default, moved), gbs(timed[0][0], moved), timed[0][1])
            for ms, key in timed:
                totals[f"{name} {key}"] = totals.get(f"{name} {key}", 0.0) + count * ms
            totals[f"{name} default"] = totals.get(f"{name} default", 0.0) + count * default
        no_silu = gbs(per_call_ms(apply(gn.DEFAULT, silu=False), device, iters), 2 * nbytes)
        print(f"| {c} x {x.shape[-1]} (x{count}) | {nbytes / 1e6:.0f} | {gbs(torch_ms, 2 * nbytes):.0f} | "
              f"{rows['apply'][0]:.0f} | {no_silu:.0f} | {rows['apply'][1]:.0f} ({rows['apply'][2]}) | "
              f"{rows['stats'][0]:.0f} | {rows['stats'][1]:.0f} ({rows['stats'][2]}) |")
    print("\ndecoder total per config (ms, each shape times its count):")
    for name in ("apply", "stats"):
        ranked = sorted((ms, key) for key, ms in totals.items() if key.startswith(name))
        print(f"  {name} default: {totals[f'{name} default']:.3f} ms; fastest:")
        for ms, key in ranked[:4]:
            print(f"    {ms:.3f} ms  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--layout", default="channels_last", choices=["channels_last", "nchw"])
    parser.add_argument("--passes", action="store_true", help="each pass alone per shape (see above), then stop")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fmt = torch.channels_last if args.layout == "channels_last" else torch.contiguous_format
    shapes = QUICK if args.quick else SDXL_1024
    inputs = [(torch.randn(1, c, side, side, device=device, dtype=dtype).contiguous(memory_format=fmt), count)
              for c, side, count in shapes]
    weight = {c: torch.randn(c, device=device, dtype=dtype) for c, _, _ in shapes}
    bias = {c: torch.randn(c, device=device, dtype=dtype) for c, _, _ in shapes}

    def groups(x):  # SDXL's 32; the quick shapes' channels are not all multiples of 32
        return 32 if x.shape[1] % 32 == 0 else 4

    def ours(config):
        return lambda x: gn.group_norm(x, groups(x), weight[x.shape[1]], bias[x.shape[1]], 1e-6, silu=True,
                                       config=config)

    def pytorch(x):
        return F.silu(F.group_norm(x, groups(x), weight[x.shape[1]], bias[x.shape[1]], 1e-6))

    nbytes = sum(count * x.numel() * x.element_size() for x, count in inputs)
    bandwidth = copy_bandwidth(device)
    limit = 3 * nbytes / bandwidth * 1e3
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {dtype}, {args.layout}; "
          f"{nbytes / 1e9:.2f} GB of GroupNorm inputs; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"limit (3 bytes moved per input byte) {limit:.2f} ms")
    if args.passes:
        passes(inputs, weight, bias, groups, device, args.iters, bandwidth)
        return
    torch_ms = decoder_ms(inputs, pytorch, device, args.iters)
    default_ms = decoder_ms(inputs, ours(gn.DEFAULT), device, args.iters)
    print(f"PyTorch GroupNorm + SiLU: {torch_ms:.2f} ms; ours, default {gn.DEFAULT}: {default_ms:.2f} ms "
          f"({limit / default_ms:.0%} of the limit)")
    best = {}
    for name, space in (("stats", STATS), ("apply", APPLY)):
        rows = []
        for params in space:
            config = dataclasses.replace(gn.DEFAULT, **params)
            rows.append((decoder_ms(inputs, ours(config), device, args.iters), params))
        rows.sort(key=lambda r: r[0])
        print(f"{name} pass, fastest 5 of {len(rows)} (the other pass at its default):")
        for ms, params in rows[:5]:
            print(f"  {ms:8.2f} ms  {params}")
        best[name] = rows[0][1]
    config = dataclasses.replace(gn.DEFAULT, **best["stats"], **best["apply"])
    ms = decoder_ms(inputs, ours(config), device, args.iters)
    print(f"best together {config}: {ms:.2f} ms ({limit / ms:.0%} of the limit; default {default_ms:.2f})")


if __name__ == "__main__":
    main()
