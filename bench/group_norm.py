"""The Triton GroupNorm(+SiLU) at the SDXL decoder's shapes: each launch config against PyTorch's, beside the
memory-bandwidth limit.

    python bench/group_norm.py            # 1024² decode's GroupNorms, bf16, channels-last, on the GPU
    python bench/group_norm.py --quick    # tiny shapes on the CPU (checks the script; the kernels only under
                                          # TRITON_INTERPRET=1)

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


def decoder_ms(inputs, run, device, iters) -> float:
    """ms of the decoder's GroupNorms: each shape's time times how often it occurs."""
    return sum(count * timer(lambda x=x: run(x), device, 2, iters) for x, count in inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--layout", default="channels_last", choices=["channels_last", "nchw"])
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
