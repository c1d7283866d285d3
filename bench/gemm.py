"""The towers' GEMMs alone, beside this GPU's best cuBLAS rate: what bounds a tower whose time is mostly GEMM.

    python bench/gemm.py                   # on a GPU: SigLIP b32, Qwen2-VL 8 x 448², Whisper b16; bf16
    python bench/gemm.py --quick           # tiny shapes, also on CPU (checks the script, not speed)
    python bench/gemm.py --autotune 2      # also each tower's 2 costliest GEMMs under torch.compile max-autotune

Each tower (built as bench/vision.py and bench/audio.py build ours: dummy weights, the service's fused kernels)
runs its forward once under a TorchDispatchMode that records every matrix multiply it calls (aten linear, mm,
addmm, _addmm_activation, bmm, baddbmm: the arguments' shapes, strides and dtypes, and the scalars). Each distinct
call is then timed alone on fresh random tensors of the same layout (CUDA events, median of --iters, after warm-up) and
counted as often as the forward made it. Printed per tower:

  per GEMM       M x N x K, calls per forward, ms per call, TFLOP/s, % of the best square rate, ms per forward;
                 "x128" the same call with N and K rounded up to multiples of 128 (padding a layer's width, where
                 that would change the shape); "autotuned" (--autotune) the call under torch.compile
                 (max-autotune-no-cudagraphs: inductor's Triton templates and cuBLAS, the fastest kept)
  per tower      the forward's ms (timed here), its GEMMs' summed ms and share, their mean TFLOP/s, and the
                 forward's ms were every GEMM to run at the best square rate (the rest unchanged): the tower's
                 ceiling with cuBLAS on this GPU, in items/s. Convolutions (Whisper's stem) count in the rest.
  epilogue       (--autotune) Whisper's and Qwen2-VL's fc1 with the activation that follows it, which the tower runs as
                 a pass of its own (erf and quick GELU have no cuBLASLt epilogue), as ours runs them beside both
                 under max-autotune, where inductor may fuse the activation into a Triton GEMM

"best square rate": the fastest of cuBLAS's 4096³, 8192³ and 16384 x 8192 x 8192 bf16 GEMMs here, which is as
close to the GPU's dense peak (989 TFLOP/s on H100 / H200 at boost clock) as cuBLAS gets under sustained load.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import compile_peer, release_compiled, timer  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
# aten.linear is seen whole only under inference_mode (as the forward runs here); otherwise it reaches the mode as
# its addmm / mm. aten.bmm.dtype: the chunked attention's score products in float32 (CUDA).
GEMMS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten._addmm_activation.default, aten.bmm.default,
         aten.bmm.dtype, aten.baddbmm.default}


@dataclass(frozen=True)
class Arg:
    """One argument of a recorded call: a tensor's layout, or a scalar as given."""

    shape: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    value: object = None

    def make(self, device: torch.device):
        if self.shape is None:
            return self.value
        # random values, not zeros: a GEMM's power draw (and so its sustained clock) depends on them
        base = torch.randn(max(1, sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1), device=device,
                           dtype=torch.float32).to(self.dtype)
        return base.as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class Call:
    op: object
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        return str(self.op).split(".")[1]  # "aten.addmm.default" -> "addmm"

    @property
    def mnk(self) -> tuple[int, int, int, int]:
        """(batch, M, N, K) of the product."""
        if self.name == "linear":  # (input, weight, bias): input (..., K), weight (N, K)
            x, w = self.args[0], self.args[1]
            return 1, math.prod(x.shape[:-1]), w.shape[0], w.shape[1]
        a, b = (self.args[0], self.args[1]) if self.name in ("mm", "bmm") else (self.args[1], self.args[2])
        if len(a.shape) == 3:
            return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
        return 1, a.shape[0], b.shape[1], a.shape[1]

    @property
    def flop(self) -> float:
        batch, m, n, k = self.mnk
        return 2.0 * batch * m * n * k

    def label(self) -> str:
        batch, m, n, k = self.mnk
        name = self.name
        if name == "_addmm_activation":
            gelu = dict(self.kwargs).get("use_gelu", False)  # keyword-only; without it the epilogue is ReLU
            name = "addmm+gelu" if gelu else "addmm+relu"
        return f"{name} {f'{batch}x' if batch > 1 else ''}{m}x{n}x{k}"

    def padded(self, multiple: int = 128) -> Call | None:
        """This call with N and K rounded up to `multiple` (contiguous operands), or None where they already are."""
        batch, m, n, k = self.mnk
        up = lambda v: -(-v // multiple) * multiple  # noqa: E731
        if (up(n), up(k)) == (n, k) or self.name in ("bmm", "baddbmm"):
            return None
        dtype = next(a.dtype for a in self.args if a.dtype is not None)
        x = Arg((m, up(k)), (up(k), 1), dtype)
        if self.name == "linear":
            bias = (Arg((up(n),), (1,), dtype),) if len(self.args) > 2 and self.args[2].shape else ()
            return Call(self.op, (x, Arg((up(n), up(k)), (up(k), 1), dtype), *bias), self.kwargs)
        w = Arg((up(k), up(n)), (1, up(k)), dtype)  # a (N, K) weight transposed, as F.linear passes it
        if self.name == "mm":
            return Call(self.op, (x, w), self.kwargs)
        return Call(self.op, (Arg((up(n),), (1,), dtype), x, w, *self.args[3:]), self.kwargs)

    def runner(self, device: torch.device):
        args = [a.make(device) for a in self.args]
        kwargs = dict(self.kwargs)
        return lambda: self.op(*args, **kwargs)


class GemmRecorder(TorchDispatchMode):
    """Counts every matrix multiply a forward makes, by layout (`Call`)."""

    def __init__(self):
        super().__init__()
        self.counts: dict[Call, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS:
            described = tuple(Arg(tuple(a.shape), tuple(a.stride()), a.dtype) if isinstance(a, torch.Tensor)
                              else Arg(value=a) for a in args)
            call = Call(func, described, tuple(sorted(kwargs.items())))
            self.counts[call] = self.counts.get(call, 0) + 1
        return func(*args, **kwargs)


@dataclass
class Tower:
    name: str
    items: int  # images or clips per forward
    unit: str
    forward: object
    fc1_width: int = 0  # the MLP's hidden width (the epilogue probe's fc1 is the linear of that many outputs)
    counts: dict[Call, int] = field(default_factory=dict)


def median_ms(fn, device: torch.device, iters: int, repeat: int = 5) -> float:
    """Median ms per call over `iters` timings of `repeat` back-to-back calls, after 3 warm-up calls."""
    return timer(fn, device, 3, iters, repeat)


def best_square_tflops(device: torch.device, dtype: torch.dtype, iters: int, quick: bool) -> tuple[float, str]:
    shapes = [(256, 256, 256)] if quick else [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)]
    best = (0.0, "")
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype).t()
        ms = median_ms(lambda: torch.mm(a, b), device, iters)
        tflops = 2.0 * m * n * k / ms / 1e9
        print(f"square  mm {m}x{n}x{k}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")
        best = max(best, (tflops, f"{m}x{n}x{k}"))
        del a, b
    return best


def vision_towers(device, dtype, quick: bool, names: list[str]) -> list[Tower]:
    from bench import vision

    towers = []
    for case in vision.CASES:
        if case.name not in names:
            continue
        if quick:
            case = vision.Case(case.name, case.family, min(case.batch, 2), 56)
        cfg, proc = vision.hf_config(case.family, quick)
        with tempfile.TemporaryDirectory() as tmp:
            vision.write_checkpoint(cfg, proc, Path(tmp))
            ours = vision.build_ours(tmp, device, dtype)
        _, _, pixels, grids = vision.tower_inputs(ours, case, vision.case_side(case, quick), device, dtype)
        forward = (lambda o=ours, p=pixels: o.tower(p)) if grids is None else \
            (lambda o=ours, p=pixels, g=grids: o.tower(p, g))
        vis = getattr(cfg, "vision_config", None)
        width = vis.embed_dim * vis.mlp_ratio if case.family == "qwen2_vl" else 0
        towers.append(Tower(case.name, case.batch, "img/s", forward, fc1_width=width))
    return towers


def audio_tower(device, dtype, quick: bool, batch: int) -> Tower:
    from bench import audio

    shape = audio.QUICK if quick else audio.LARGE_V3
    ours = audio.build_encoder_model(audio.make_checkpoint(shape), device=device, dtype=dtype, dummy=True,
                                     options={"warmup": False})
    batch = min(batch, 2) if quick else batch
    mels = torch.randn(batch, shape["num_mel_bins"], 3000, device=device).to(dtype)
    return Tower(f"whisper-b{batch}", batch, "clips/s", lambda: ours.module(mels),
                 fc1_width=shape["encoder_ffn_dim"])


def autotuned(fn, args: list, device: torch.device, iters: int) -> tuple[str, str]:
    """(ms per call, compile s) of `fn(*args)` under torch.compile max-autotune (`bench.compile_peer`: its first
    call's seconds), printable; ("n/a", why) where inductor does not compile here."""
    forward, compile_s, why = compile_peer(fn, lambda compiled: compiled(*args), "max-autotune-no-cudagraphs",
                                           device)
    if forward is None:
        return "n/a", why[:40]
    ms = median_ms(forward, device, iters)
    release_compiled(device)
    return f"{ms:.3f}", f"{compile_s:.1f}"


def activations() -> dict:
    """The towers whose MLP runs its activation as a pass of its own after fc1 (--autotune's epilogue probe): the
    activation as the tower runs it (SigLIP's tanh GELU is already cuBLASLt's epilogue)."""
    from modalmesh.kernels import activation as kernels
    from modalmesh.layers import mlp

    def quick_gelu(h):
        return kernels.quick_gelu(h) if h.is_cuda else mlp._quick_gelu(h)

    return {"whisper": ("erf GELU", torch.nn.functional.gelu, torch.nn.functional.gelu),
            "qwen2vl": ("quick GELU", quick_gelu, mlp._quick_gelu)}


def epilogue_probe(tower: Tower, device: torch.device, iters: int) -> str | None:
    """fc1 + its activation as the tower runs them (two passes), against both under torch.compile max-autotune
    (inductor can fuse the activation into a Triton GEMM's epilogue)."""
    family = next((f for f in activations() if tower.name.startswith(f)), None)
    fc1 = [c for c in tower.counts if c.name == "linear" and c.mnk[2] == tower.fc1_width]
    if family is None or not fc1:
        return None
    call = max(fc1, key=lambda c: c.flop)
    label, ours_act, plain_act = activations()[family]
    x, w, *bias = [a.make(device) for a in call.args]
    ours_ms = median_ms(lambda: ours_act(torch.nn.functional.linear(x, w, *bias)), device, iters)
    plain_ms = median_ms(lambda: torch.nn.functional.linear(x, w, *bias), device, iters)
    tuned_ms, compile_s = autotuned(lambda *a: plain_act(torch.nn.functional.linear(*a)), [x, w, *bias], device,
                                    iters)
    calls = tower.counts[call]
    return (f"{tower.name}: fc1 {call.label()} + {label}, {calls} per forward: as ours runs it {ours_ms:.3f} ms "
            f"(the GEMM alone {plain_ms:.3f}); under max-autotune {tuned_ms} ms (compile {compile_s} s)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--only", default="siglip-b32,qwen2vl-8x448,whisper-b16",
                        help="towers, comma-separated: vision cases of bench/vision.py, whisper-bN")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--autotune", type=int, default=0, metavar="N",
                        help="also each tower's N costliest GEMMs under torch.compile max-autotune (minutes each)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        print("no CUDA device: use --quick (tiny shapes) to check the script on CPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        args.iters = min(args.iters, 2)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# the towers' GEMMs on {gpu}, {str(dtype).removeprefix('torch.')}, torch {torch.__version__}, "
          f"median of {args.iters}{' (quick shapes)' if args.quick else ''}")
    best, best_shape = best_square_tflops(device, dtype, args.iters, args.quick)
    print(f"best square rate: {best:.1f} TFLOP/s ({best_shape})")

    names = [n for n in args.only.split(",") if n]
    towers = vision_towers(device, dtype, args.quick, [n for n in names if not n.startswith("whisper-b")])
    towers += [audio_tower(device, dtype, args.quick, int(n.removeprefix("whisper-b")))
               for n in names if n.startswith("whisper-b")]
    for tower in towers:
        with torch.inference_mode():
            with GemmRecorder() as recorder:
                tower.forward()
            tower.counts = recorder.counts
            forward_ms = median_ms(tower.forward, device, args.iters, repeat=1)
            print(f"\n## {tower.name}: forward {forward_ms:.2f} ms ({tower.items / forward_ms * 1e3:.1f} "
                  f"{tower.unit}), {sum(tower.counts.values())} GEMM calls of {len(tower.counts)} layouts")
            print(f"{'GEMM':<34}{'calls':>6}{'ms/call':>9}{'TFLOP/s':>9}{'% best':>8}{'ms/fwd':>8}"
                  f"{'x128 TFLOP/s':>14}{'autotuned ms':>14}{'compile s':>10}")
            rows = []
            for call, calls in tower.counts.items():
                ms = median_ms(call.runner(device), device, args.iters)
                rows.append((call, calls, ms))
            rows.sort(key=lambda r: -r[1] * r[2])
            gemm_ms = at_best_ms = flop = 0.0
            for rank, (call, calls, ms) in enumerate(rows):
                tflops = call.flop / ms / 1e9
                gemm_ms += calls * ms
                at_best_ms += calls * call.flop / best / 1e9
                flop += calls * call.flop
                padded = call.padded()
                pad = f"{padded.flop / median_ms(padded.runner(device), device, args.iters) / 1e9:.1f}" if padded \
                    else "-"
                tuned = ("-", "-")
                if rank < args.autotune:
                    kwargs = dict(call.kwargs)
                    tuned = autotuned(lambda *a, op=call.op: op(*a, **kwargs), [a.make(device) for a in call.args],
                                      device, args.iters)
                print(f"{call.label():<34}{calls:>6}{ms:>9.3f}{tflops:>9.1f}{100 * tflops / best:>8.1f}"
                      f"{calls * ms:>8.2f}{pad:>14}{tuned[0]:>14}{tuned[1]:>10}")
            if args.autotune:
                probe = epilogue_probe(tower, device, args.iters)
                if probe:
                    print(probe)
            rest = forward_ms - gemm_ms
            ceiling = rest + at_best_ms
            print(f"{tower.name}: GEMMs {gemm_ms:.2f} of {forward_ms:.2f} ms ({100 * gemm_ms / forward_ms:.0f} %), "
                  f"{flop / gemm_ms / 1e9:.1f} TFLOP/s; the rest {rest:.2f} ms; at the best square rate the GEMMs "
                  f"take {at_best_ms:.2f} ms and the forward {ceiling:.2f} ms: ceiling "
                  f"{tower.items / ceiling * 1e3:.1f} {tower.unit} (now {tower.items / forward_ms * 1e3:.1f})")
        del tower.forward
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
