"""What the benches share: percentiles, the compiled peer (`--peer-compile`) and the kernel profile (`--profile`).

torch is imported inside the functions that use it: the serving benches import this module without it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nearest rank); NaN for none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


def samples(text: str) -> list:
    """Every sample of a Prometheus exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def scrape(metrics_port: int) -> list:
    """Every sample a service exports now (one /metrics read)."""
    import urllib.request

    return samples(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode())


def total(samples_: list, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples_ if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def mean_ms_between(before: list, after: list, histogram: str, **labels) -> float:
    """Mean ms of what `histogram` (samples whose labels include `labels`) observed between two readings."""
    count = total(after, histogram + "_count", **labels) - total(before, histogram + "_count", **labels)
    seconds = total(after, histogram + "_sum", **labels) - total(before, histogram + "_sum", **labels)
    return seconds / count * 1e3 if count else float("nan")


def llm_slot_flags(max_num_seqs: int) -> list[str]:
    """A benched LLM service's sequence slots, and a step budget that holds a decode row for each: the service's
    default budget, or the slots where they are more (the service refuses a budget below them)."""
    from services.llm.config import LLMConfig

    return ["--max-num-seqs", str(max_num_seqs),
            "--max-batch-tokens", str(max(LLMConfig.max_batch_tokens, max_num_seqs))]


def timer(fn, device: torch.device, warmup: int, iters: int, repeat: int = 1) -> float:
    """Median milliseconds per call over `iters` timings of `repeat` calls back to back: CUDA events on a GPU,
    the wall clock elsewhere."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / repeat)
        else:
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            times.append((time.perf_counter() - start) * 1e3 / repeat)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the peer under torch.compile ----------------------------------------------------------------------------------

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PEER_COMPILE_HELP = ("also time the peer under torch.compile, one column per mode, comma-separated (default, "
                     "reduce-overhead, max-autotune, max-autotune-no-cudagraphs); 'none' skips it. max-autotune "
                     "takes minutes per shape on a GPU: opt in")


def peer_compile_modes(spec: str, flag: str = "--peer-compile") -> list[str]:
    """The torch.compile modes `flag` names, in order; [] for 'none' or ''."""
    modes = [m.strip() for m in spec.split(",") if m.strip() and m.strip() != "none"]
    unknown = [m for m in modes if m not in COMPILE_MODES]
    if unknown:
        raise SystemExit(f"{flag}: unknown mode(s) {', '.join(unknown)}")
    return modes


def compile_unavailable(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device` on this machine, or None when it can."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is missing or does not support this GPU"
        # Triton builds its launcher with a C compiler at the first kernel launch (CC, else clang, else gcc).
        if not (os.environ.get("CC") or shutil.which("clang") or shutil.which("gcc")):
            return "no C compiler for Triton's launcher (set CC)"
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()  # inductor's CPU kernels are C++ it builds at run time
    except Exception as exc:  # noqa: BLE001 - InvalidCxxCompiler and whatever an odd toolchain raises
        return f"no C++ compiler for inductor's CPU kernels ({type(exc).__name__}; set CXX)"
    return None


def inductor_cache_state() -> str:
    """Where inductor keeps compiled artefacts and whether it holds any yet: a warm cache shortens the first
    call, so the compile seconds are a cold start only where this says 'empty'."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    entries = sum(len(files) for _, _, files in os.walk(root))
    return f"{root}: {'empty' if entries == 0 else f'{entries} files'}"


def compile_peer(target, call: Callable[[object], object], mode: str,
                 device: torch.device) -> tuple[Callable[[], object] | None, float, str]:
    """`target` (the peer's module or function) under ``torch.compile(mode=mode)`` and its first call.

    `call(compiled)` runs one forward of the compiled target. Returns (that forward as a zero-argument
    callable, the first call's wall seconds: tracing, inductor's code generation and, for max-autotune, the
    autotuning), or (None, NaN, why) when it does not compile here. Each call starts from an empty dynamo
    cache, so the seconds are a compile from scratch in this process, not a recompile riding on an earlier
    column's graphs. ``dynamic=False``: one graph per shape, as a user timing one shape would get (the
    automatic dynamic shapes of a second shape would change the kernels)."""
    import torch

    why = compile_unavailable(device)
    if why:
        return None, math.nan, why
    # diffusers' up-sampling calls an lru_cache'd version check; dynamo's warning about it repeats after each reset.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    torch._dynamo.reset()
    compiled = torch.compile(target, mode=mode, dynamic=False)
    forward = lambda: call(compiled)  # noqa: E731
    sync(device)
    start = time.perf_counter()
    try:
        forward()
        sync(device)
    except Exception as exc:  # noqa: BLE001 - a peer that does not compile is a missing column, not a failed run
        torch._dynamo.reset()
        return None, math.nan, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc) else ''}"
    return forward, time.perf_counter() - start, ""


def release_compiled(device: torch.device) -> None:
    """Drop dynamo's graphs (and the CUDA graphs of the cudagraph modes) and their memory before the next column."""
    import torch

    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- where the time of one call goes ------------------------------------------------------------------------------

# Checked in order: cuDNN's convolutions are implicit GEMMs ("fprop"), so convolution comes before GEMM; the
# CPU's leaf aten ops stand for kernels there. "layout" is cuDNN's NCHW <-> NHWC conversions and other transposes
# (the NHWC question); "upsample" the VAE's nearest-neighbour up-sampling before each conv.
KERNEL_FAMILIES = (
    ("conv", re.compile(r"conv|fprop|dgrad|wgrad|winograd|implicit_gemm|im2col|col2im", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|softmax", re.I)),
    ("GEMM", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|aten::(mm|addmm|bmm|baddbmm|linear)\b", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("layout", re.compile(r"nchwToNhwc|nhwcToNchw|transpose|permute", re.I)),
    ("upsample", re.compile(r"upsample|interpolate", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|triton_|copy|fill|cat|gelu|silu|tanh|sigmoid|add|"
                               r"mul|div|sub|neg|pow|sqrt|exp|sin|cos|where|clamp|index|gather|scatter|pad", re.I)),
)


def kernel_family(name: str) -> str:
    """conv, attention, GEMM, norm, layout, upsample, elementwise or other, from a kernel's (or CPU op's) name."""
    return next((family for family, pattern in KERNEL_FAMILIES if pattern.search(name)), "other")


def profile_kernels(calls: dict[str, Callable[[], object]], device: torch.device, iters: int,
                    top: int = 10) -> dict:
    """Per named zero-argument call: wall ms per call (synchronised each call), busy ms per call (summed kernel
    time from torch.profiler; CPU op time on a CPU), kernels per call, ms per call of each kernel family, and the
    `top` kernels as (name, ms per call, count per call). Wall well above busy is launch-bound (host overhead,
    bubbles between kernels); busy itself is what faster kernels would shrink."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    with torch.inference_mode():
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                fn()
                sync(device)
            wall = (time.perf_counter() - start) * 1e3 / iters
            with profile(activities=activities) as prof:
                for _ in range(iters):
                    fn()
                sync(device)
            if cuda:
                kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
                self_us = lambda e: e.self_device_time_total  # noqa: E731
            else:  # leaf CPU ops stand for kernels
                kernels = [e for e in prof.key_averages() if e.key.startswith("aten::") and e.self_cpu_time_total > 0]
                self_us = lambda e: e.self_cpu_time_total  # noqa: E731
            families: dict[str, float] = {}
            for e in kernels:
                family = kernel_family(e.key)
                families[family] = families.get(family, 0.0) + self_us(e) / 1e3 / iters
            ranked = sorted(kernels, key=self_us, reverse=True)[:top]
            out[name] = {"wall_ms": wall, "busy_ms": sum(self_us(e) for e in kernels) / 1e3 / iters,
                         "kernels_per_call": sum(e.count for e in kernels) / iters,
                         "families": dict(sorted(families.items(), key=lambda kv: -kv[1])),
                         "top": [(e.key, self_us(e) / 1e3 / iters, e.count / iters) for e in ranked],
                         "iters": iters}
    return out


def print_profile(profiled: dict, device: torch.device, title: str) -> None:
    """`profile_kernels`'s result: the wall / busy / idle table, each call's kernel families and top kernels."""
    unit = "CUDA kernel" if device.type == "cuda" else "CPU op"
    print(f"\nprofile, {title} ({unit} time per call; idle = wall - busy: launch gaps and host work):")
    width = max([28] + [len(name) for name in profiled])
    print(f"{'call':<{width}} {'wall ms':>8} {'busy ms':>8} {'idle ms':>8} {'kernels':>8}")
    for name, r in profiled.items():
        print(f"{name:<{width}} {r['wall_ms']:>8.2f} {r['busy_ms']:>8.2f} {r['wall_ms'] - r['busy_ms']:>8.2f} "
              f"{r['kernels_per_call']:>8.0f}")
    for name, r in profiled.items():
        busy = r["busy_ms"] or math.nan
        print(f"kernel families, {name}: " + ", ".join(f"{family} {ms:.2f} ms ({ms / busy:.0%})"
                                                       for family, ms in r["families"].items()))
        print(f"top kernels, {name} (over {r['iters']} calls: total ms, ms per call, share of busy, count per call):")
        for key, ms, count in r["top"]:
            print(f"  {ms * r['iters']:9.2f} {ms:8.3f} {ms / busy:6.1%} x{count:<5.0f} {kernel_family(key):<11} "
                  f"{key[:100]}")
