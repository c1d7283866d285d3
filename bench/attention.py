"""Attention backends head to head: TFLOP/s per backend and shape, and whether the selector's pick is right.

    python bench/attention.py            # on a GPU: the real shapes, bf16 (+ one FP32 VAE shape)
    python bench/attention.py --quick    # tiny shapes; also runs on CPU (checks the script, not speed)

For each shape every backend that declares support is timed (CUDA events,
warm-up, best of several trials) and checked against torch_naive; then the
selector picks for the same needs, and the table says whether the pick is
within 5% of the fastest correct backend. Use the output to update ranking.py.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from modalmesh.attention import AttentionSelector, Needs, PagedMetadata, VarlenMetadata, registry  # noqa: E402
from modalmesh.attention.backends.naive import NaiveBackend  # noqa: E402
from modalmesh.attention.capability import dtype_name  # noqa: E402
from modalmesh.attention.paged import store_kv  # noqa: E402
from modalmesh.metrics import Metrics  # noqa: E402

WITHIN = 0.05


@dataclass
class Shape:
    name: str
    component: str
    layout: str
    heads: int
    head_dim: int
    kv_heads: int | None = None
    causal: bool = False
    dtype: torch.dtype = torch.bfloat16
    batch: int = 1  # dense
    seq: int = 0  # dense
    seqlens: tuple[int, ...] = ()  # varlen
    query_lens: tuple[int, ...] = ()  # paged
    context_lens: tuple[int, ...] = ()  # paged
    page_size: int = 16
    results: dict = field(default_factory=dict)

    def needs(self) -> Needs:
        return Needs(self.dtype, self.head_dim, layouts=(self.layout,), causal=self.causal,
                     gqa=(self.kv_heads or self.heads) != self.heads,
                     page_size=self.page_size if self.layout == "paged" else None,
                     seqlen_hint=self.seq if self.layout == "dense" else None)

    def flops(self) -> float:
        """Forward FLOPs (2 matmuls x 2 FLOP/MAC); causal counts the visible half."""
        if self.layout == "dense":
            pairs = [(self.seq, self.seq)] * self.batch
        elif self.layout == "varlen":
            pairs = [(n, n) for n in self.seqlens]
        else:
            pairs = list(zip(self.query_lens, self.context_lens))
        total = 0.0
        for q, k in pairs:
            visible = q * k - (q * (q - 1) / 2 if self.causal else 0)
            total += 4 * self.heads * self.head_dim * visible
        return total


def shapes(quick: bool) -> list[Shape]:
    if quick:
        return [
            Shape("dense hd64 s64 causal", "llm", "dense", 4, 64, batch=2, seq=64, causal=True),
            Shape("packed hd80 [48,17,1]", "vision_encoder", "varlen", 4, 80, seqlens=(48, 17, 1)),
            Shape("paged decode hd128 gqa", "llm", "paged", 4, 128, kv_heads=2, causal=True,
                  query_lens=(1, 1), context_lens=(40, 7)),
            Shape("paged prefill hd128 gqa prefix", "llm", "paged", 6, 128, kv_heads=2, causal=True,
                  query_lens=(1, 37), context_lens=(40, 70)),
        ]
    vision = (1024,) * 8  # Qwen2-VL tower, 8 x 448^2 images
    mixed = (4096, 3000, 2048, 1024, 1024, 512, 300, 200, 37, 1)
    return [
        Shape("dense hd128 s4096 non-causal", "llm", "dense", 16, 128, batch=4, seq=4096),
        Shape("dense hd128 s4096 causal", "llm", "dense", 16, 128, batch=4, seq=4096, causal=True),
        Shape("dense hd64 s1024 non-causal", "audio_encoder", "dense", 16, 64, batch=16, seq=1024),
        Shape("dense hd64 s1500 whisper", "audio_encoder", "dense", 20, 64, batch=16, seq=1500),
        Shape("dense hd72 s729 siglip", "vision_encoder", "dense", 16, 72, batch=32, seq=729),
        Shape("dense fp32 hd512 s4096 vae", "vae", "dense", 1, 512, batch=1, seq=4096, dtype=torch.float32),
        Shape("dense fp32 hd512 s16384 vae", "vae", "dense", 1, 512, batch=1, seq=16384, dtype=torch.float32),
        Shape("dense bf16 hd512 s4096 vae", "vae", "dense", 1, 512, batch=4, seq=4096),
        Shape("dense bf16 hd512 s16384 vae", "vae", "dense", 1, 512, batch=1, seq=16384),
        Shape("packed hd128 mixed lengths", "llm", "varlen", 16, 128, seqlens=mixed),
        Shape("packed hd80 8x1024 vision", "vision_encoder", "varlen", 16, 80, seqlens=vision),
        Shape("paged prefill hd128 gqa prefix", "llm", "paged", 32, 128, kv_heads=8, causal=True,
              query_lens=(512,) * 8, context_lens=(2048,) * 8),
        Shape("paged decode hd128 gqa b64 ctx2048", "llm", "paged", 32, 128, kv_heads=8, causal=True,
              query_lens=(1,) * 64, context_lens=(2048,) * 64),
        # Qwen2.5-7B's heads (28 over 4 kv heads): a multi-turn prompt's last chunk over its cached history, and
        # an eager mixed step of decode rows beside two prompt chunks that continue a prefix
        Shape("paged prefill hd128 gqa7 q2048 prefix 6144", "llm", "paged", 28, 128, kv_heads=4, causal=True,
              query_lens=(2048,), context_lens=(8192,)),
        Shape("paged mixed hd128 gqa7 64 decodes + 2 chunks", "llm", "paged", 28, 128, kv_heads=4, causal=True,
              query_lens=(1,) * 64 + (512, 512), context_lens=(2048,) * 64 + (1536, 2560)),
    ]


def make_call(shape: Shape, device: torch.device):
    """(layout, args) for backend calls, inputs built once."""
    gen = torch.Generator(device=device).manual_seed(0)
    kv = shape.kv_heads or shape.heads

    def rand(*dims):
        return torch.randn(*dims, generator=gen, device=device, dtype=shape.dtype)

    if shape.layout == "dense":
        b, s = shape.batch, shape.seq
        return (rand(b, s, shape.heads, shape.head_dim), rand(b, s, kv, shape.head_dim),
                rand(b, s, kv, shape.head_dim))
    if shape.layout == "varlen":
        t = sum(shape.seqlens)
        meta = VarlenMetadata.from_seqlens(shape.seqlens, device)
        return rand(t, shape.heads, shape.head_dim), rand(t, kv, shape.head_dim), rand(t, kv, shape.head_dim), meta
    page = shape.page_size
    per_seq = [math.ceil(c / page) for c in shape.context_lens]
    num_pages = sum(per_seq)
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = order[start:start + n]
        start += n
    meta = PagedMetadata.build(shape.query_lens, shape.context_lens, table.to(device), page)
    k_cache, v_cache = rand(num_pages, page, kv, shape.head_dim), rand(num_pages, page, kv, shape.head_dim)
    t = sum(shape.query_lens)
    store_kv(rand(t, kv, shape.head_dim), rand(t, kv, shape.head_dim), k_cache, v_cache, meta.slot_mapping)
    return rand(t, shape.heads, shape.head_dim), k_cache, v_cache, meta


def run(backend, shape: Shape, call):
    kw = dict(causal=shape.causal, scale=shape.head_dim**-0.5, window=None)
    return getattr(backend, shape.layout)(*call, **kw)


def timed(fn, device: torch.device, trials: int = 3, min_seconds: float = 0.05) -> float:
    """Best-of-trials mean seconds per call, after warm-up."""
    for _ in range(3):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    reps = max(3, min(200, int(min_seconds / max(time.perf_counter() - start, 1e-6))))
    best = math.inf
    for _ in range(trials):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3 / reps
        else:
            begin = time.perf_counter()
            for _ in range(reps):
                fn()
            seconds = (time.perf_counter() - begin) / reps
        best = min(best, seconds)
    return best


def bench_shape(shape: Shape, selector: AttentionSelector, device: torch.device) -> dict:
    call = make_call(shape, device)
    reference = run(NaiveBackend(registry.spec("torch_naive")), shape,
                    tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in call))
    tol = 1e-4 if shape.dtype == torch.float32 else 2e-2
    needs = shape.needs()
    print(f"\n== {shape.name}  ({shape.component}, {shape.layout}, {dtype_name(shape.dtype)}, "
          f"{shape.flops() / 1e9:.1f} GFLOP)")
    print(f"   {'backend':16} {'ms':>9} {'TFLOP/s':>9}  correct  note")
    rows = {}
    for name in registry.names():
        why = selector.verdict(name, needs)
        if name == "torch_naive":
            why = why or "reference (not timed)"
        if why:
            print(f"   {name:16} {'-':>9} {'-':>9}  {'-':7}  {why[:90]}")
            continue
        backend = registry.probe(name).backend
        try:
            out = run(backend, shape, call)
            err = (out.float() - reference).abs().max().item()
            correct = torch.allclose(out.float(), reference, atol=tol, rtol=tol)
            seconds = timed(lambda: run(backend, shape, call), device)
        except Exception as exc:  # noqa: BLE001 - a failing kernel is a result worth printing
            print(f"   {name:16} {'-':>9} {'-':>9}  {'error':7}  {type(exc).__name__}: {str(exc)[:80]}")
            continue
        rows[name] = (seconds, correct)
        tflops = shape.flops() / seconds / 1e12
        print(f"   {name:16} {seconds * 1e3:9.3f} {tflops:9.2f}  {'yes' if correct else 'NO':7}  max err {err:.2e}")
    pick = selector.select(shape.component, needs)
    correct_rows = {n: s for n, (s, ok) in rows.items() if ok}
    fastest = min(correct_rows, key=correct_rows.get) if correct_rows else None
    within = pick.backend in correct_rows and correct_rows[pick.backend] <= correct_rows[fastest] * (1 + WITHIN)
    verdict = "YES" if within else "NO"
    print(f"   selector picked {pick.backend} ({pick.reason}); fastest correct: {fastest}; within 5%: {verdict}")
    del call, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ratio = correct_rows[fastest] / correct_rows[pick.backend] if pick.backend in correct_rows else None
    return dict(shape=shape.name, pick=pick.backend, fastest=fastest, within=within, speedup=ratio)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (runs on CPU too)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="", help="run shapes whose name contains this text")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    selector = AttentionSelector("", device=device, metrics=Metrics("bench", process_metrics=False))
    print(f"platform: {selector.platform.describe()}  torch {torch.__version__}")
    summary = []
    for shape in shapes(args.quick or device.type == "cpu"):
        if args.only in shape.name:
            summary.append(bench_shape(shape, selector, device))
    print("\n== summary")
    for row in summary:
        ratio = f"{row['speedup']:.2f}x of fastest" if row["speedup"] else "pick not timed"
        print(f"   {row['shape']:38} pick {row['pick']:15} fastest {str(row['fastest']):15} "
              f"within 5%: {'YES' if row['within'] else 'NO '}  ({ratio})")
    misses = [r for r in summary if not r["within"]]
    print(f"   {len(summary) - len(misses)}/{len(summary)} picks within 5% of the fastest correct backend")
    return 0


if __name__ == "__main__":
    sys.exit(main())
