"""`triton_paged`: our own paged-KV attention kernels (Triton), for the LLM.

Decode (one new token per sequence) runs one Triton program per (sequence, kv
head): it walks the sequence's pages through the block table, keeps an online
softmax for the whole GQA group of query heads, and never gathers pages into a
dense copy. It reads lengths and pages from device tensors only, so a decode
step can be captured in a CUDA graph. Prefill is delegated: new sequences (no
cached prefix) go to the fastest varlen kernel installed (FA3, torch varlen,
FA2) on the new tokens.

An eager mixed step (continuous batching: decode rows beside new prompts and
chunks that continue a cached prefix) is split by sequence: new prompts go to
the varlen delegate, decode rows to the decode kernel, and chunks that continue
a prefix to the paged prefill kernel (`modalmesh.kernels.paged_prefill`), blocks
of a chunk's tokens reading each key block once. A mixed step replayed from a
CUDA graph comes with every token a decode query of its own (`token_seq`,
`token_ctx`: no host lengths), which the decode kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from modalmesh.attention import registry
from modalmesh.attention.backends.base import AttentionBackend
from modalmesh.attention.metadata import VarlenMetadata, host_to_device
from modalmesh.kernels.paged_prefill import BlockPlan, config_for, paged_prefill, plan_blocks

_VARLEN_DELEGATES = ("fa3", "torch_varlen", "fa2")
_BLOCK_N = 32


def _kernel():
    import triton
    import triton.language as tl

    # Triton specialises integer arguments on divisibility by 16; the block table's row stride varies with
    # the longest sequence of a step, so each new width would compile the kernel again mid-serving.
    @triton.jit(do_not_specialize=["stride_bt"])
    def paged_decode(
        Q, K, V, Out, PartM, PartL, BlockTable, ContextLens, TokenSeq, scale,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        DV: tl.constexpr, DV_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOW_LEFT: tl.constexpr, IEEE: tl.constexpr, PER_TOKEN: tl.constexpr, SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)  # a query token; its sequence's block-table row is `seq`
        scale = scale.to(tl.float32)  # float64 under torch.compile: the softmax's loop-carried state stays float32
        kvh = tl.program_id(1)
        split = tl.program_id(2)  # with SPLITS > 1: this program's share of the context (flash-decoding)
        ctx = tl.load(ContextLens + row)  # per token (PER_TOKEN) or per sequence: the same index
        if PER_TOKEN:
            seq = tl.load(TokenSeq + row)
        else:
            seq = row
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        heads = kvh * GROUP + g
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=(g[:, None] < GROUP) & (d[None, :] < D), other=0.0)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DV_PAD), tl.float32)
        start = 0
        if WINDOW_LEFT >= 0:
            start = tl.maximum(ctx - 1 - WINDOW_LEFT, 0) // BLOCK_N * BLOCK_N
        stop = ctx
        if SPLITS > 1:  # whole blocks per split; the last splits of a short context get none
            per = tl.cdiv(tl.cdiv(ctx - start, BLOCK_N), SPLITS) * BLOCK_N
            start = start + split * per
            stop = tl.minimum(ctx, start + per)
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < ctx
            if WINDOW_LEFT >= 0:
                valid = valid & (n >= ctx - 1 - WINDOW_LEFT)
            page = tl.load(BlockTable + seq * stride_bt + n // PAGE, mask=n < ctx, other=0)
            offset = n % PAGE
            k = tl.load(K + page[:, None] * stride_kp + offset[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                        mask=valid[:, None] & (d[None, :] < D), other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * stride_vp + offset[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                        mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SPLITS > 1:
            # float32 partials [row, head, split]: this split's normalised output, its max and its sum.
            part = (row * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split
            tl.store(Out + part[:, None] * DV + dv[None, :], out, mask=(g[:, None] < GROUP) & (dv[None, :] < DV))
            tl.store(PartM + part, m_i, mask=g < GROUP)
            tl.store(PartL + part, l_i, mask=g < GROUP)
        else:
            tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + dv[None, :], out.to(Out.dtype.element_ty),
                     mask=(g[:, None] < GROUP) & (dv[None, :] < DV))

    @triton.jit
    def combine_splits(Part, PartM, PartL, Out, stride_ot, stride_oh, HEADS: tl.constexpr, SPLITS: tl.constexpr,
                       DV: tl.constexpr, DV_PAD: tl.constexpr):
        """One (row, head): the splits' partial outputs weighted by their softmax mass (exp(m - max) * l)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        dv = tl.arange(0, DV_PAD)
        base = (row * HEADS + head) * SPLITS
        m = tl.load(PartM + base + sp)
        l = tl.load(PartL + base + sp)
        top = tl.max(m, 0)
        w = tl.where(l > 0, tl.exp(m - tl.where(top > float("-inf"), top, 0.0)) * l, 0.0)
        o = tl.load(Part + (base + sp)[:, None] * DV + dv[None, :], mask=dv[None, :] < DV, other=0.0)
        total = tl.sum(w, 0)
        out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + row * stride_ot + head * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < DV)

    return paged_decode, combine_splits


def _pad(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (n - 1).bit_length())


# Flash-decoding: with few (row, kv head) programs the GPU is mostly idle (batch 1 of a 4-kv-head model
# is 4 programs on 132 SMs: 9.4 us a layer on the H200), so each program's context is split across
# up to MAX_SPLITS programs and the partial results combined by a second kernel. The split count is
# chosen from the batch and head counts alone (host values fixed per captured graph), never from the
# context lengths, which live on the device.
MAX_SPLITS = 16
_SMS: dict[int, int] = {}


def decode_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (row, kv head): enough to fill the GPU's SMs once, a power of two up to MAX_SPLITS."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = sms // max(1, rows * kv_heads)
    return 1 if want < 2 else min(MAX_SPLITS, 1 << (want.bit_length() - 1))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, *, scale: float, window=None, kernel=None,
                 token_seq: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """q (B, H, D) of one new token per sequence -> (B, H, Dv), attending over each sequence's pages.

    With `token_seq` (int32 (N,)), q holds N query tokens: token i belongs to block-table row token_seq[i]
    and attends to the first context_lens[i] tokens of it (its causal length). `splits`: programs per
    (row, kv head), a power of two (default `decode_splits`)."""
    decode, combine = kernel or _kernel()
    batch, heads, dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    group = heads // kv_heads
    out = q.new_empty((batch, heads, dim_v))
    if batch == 0:
        return out
    splits = decode_splits(batch, kv_heads, q.device) if splits is None else splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits={splits}: a power of two >= 1")
    left = -1 if window is None or window[0] < 0 else int(window[0])
    if splits > 1:
        target = torch.empty((batch, heads, splits, dim_v), dtype=torch.float32, device=q.device)
        part_m = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        target, part_m, part_l = out, out, out  # the partial buffers are not touched
    decode[(batch, kv_heads, splits)](
        q, k_cache, v_cache, target, part_m, part_l, block_table, context_lens,
        context_lens if token_seq is None else token_seq, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_table.stride(0),
        GROUP=group, GROUP_PAD=_pad(group), D=dim, D_PAD=_pad(dim), DV=dim_v, DV_PAD=_pad(dim_v), PAGE=page,
        BLOCK_N=_BLOCK_N, WINDOW_LEFT=left, IEEE=q.dtype == torch.float32, PER_TOKEN=token_seq is not None,
        SPLITS=splits,
    )
    if splits > 1:
        combine[(batch, heads)](target, part_m, part_l, out, out.stride(0), out.stride(1), HEADS=heads,
                                SPLITS=splits, DV=dim_v, DV_PAD=_pad(dim_v))
    return out


class TritonPaged(AttentionBackend):
    def probe(self) -> None:
        import triton  # noqa: F401 - an ImportError becomes the recorded reason

        self._decode = _kernel()

    def _sdpa(self, q: torch.Tensor):
        """SDPA for what the kernel does not do; the efficient kernel wants head dims in multiples of 8."""
        name = "sdpa_efficient" if q.device.type == "cuda" and q.shape[-1] % 8 == 0 else "sdpa_math"
        return registry.probe(name).backend

    def dense(self, q, k, v, *, causal, scale, window):
        return self._sdpa(q).dense(q, k, v, causal=causal, scale=scale, window=window)

    def paged(self, q, k_cache, v_cache, meta, *, causal, scale, window):
        if meta.token_seq is not None:  # a captured mixed step: every token a query of its own
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.token_ctx, scale=scale, window=window,
                                kernel=self._decode, token_seq=meta.token_seq)
        if meta.is_decode:
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.context_lens, scale=scale,
                                window=window, kernel=self._decode)
        delegate = self._varlen_delegate(q) if window is None and causal else None
        if meta.without_prefix and delegate is not None:
            return self._new_prompts(delegate, q, k_cache, v_cache, meta.slot_mapping, meta.cached(
                "varlen_meta", lambda: VarlenMetadata(meta.cu_seqlens_q, meta.max_seqlen_q, meta.query_lens)),
                scale)
        if not causal:
            return self._sdpa(q).paged(q, k_cache, v_cache, meta, causal=causal, scale=scale, window=window)
        group = q.shape[1] // k_cache.shape[2]
        plan = meta.cached(("mixed_plan", delegate is not None, group, q.shape[-1]),
                           lambda: MixedPlan.of(meta, delegate is not None, group, q.shape[-1]))
        out = q.new_empty((*q.shape[:-1], v_cache.shape[-1]))
        if plan.prompt_rows is not None:
            out[plan.prompt_rows] = self._new_prompts(delegate, q[plan.prompt_rows], k_cache, v_cache,
                                                      meta.slot_mapping[plan.prompt_rows], plan.prompt_meta, scale)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = paged_decode(q[plan.decode_rows], k_cache, v_cache, meta.block_table,
                                                 plan.decode_ctx, scale=scale, window=window, kernel=self._decode,
                                                 token_seq=plan.decode_seq)
        if plan.blocks is not None:
            paged_prefill(q, k_cache, v_cache, meta.block_table, plan.blocks, scale=scale, window=window, out=out)
        return out

    def warm_paged(self, q, k_cache, v_cache, *, causal, scale, window, max_seqs):
        """Every launch form the Triton kernels take in steps of up to `max_seqs` sequences, compiled now: the
        decode kernel per split count (`decode_splits` of the row count) with the per-sequence and the
        per-token context, their combine, and the paged prefill kernel. Triton compiles each form on its first
        launch, and a compile holds the engine thread (and its GIL) for most of a second: on an H100, image +
        text load spent 15 % of the engine thread's time compiling decode forms (py-spy, issue 18)."""
        if q.device.type != "cuda" or not causal:
            return
        device, kv_heads = q.device, k_cache.shape[2]
        forms: dict[int, int] = {}  # split count -> the fewest rows that take it
        for rows in range(1, max_seqs + 1):
            forms.setdefault(decode_splits(rows, kv_heads, device), rows)
        for splits, rows in forms.items():
            # Row r reads one token of page 0: enough for the kernels to run whole; their outputs are dropped.
            queries = q.expand(rows, *q.shape[1:]).contiguous()
            table = torch.zeros((rows, 1), dtype=torch.int32, device=device)
            ones = torch.ones(rows, dtype=torch.int32, device=device)
            paged_decode(queries, k_cache, v_cache, table, ones, scale=scale, window=window, kernel=self._decode,
                         splits=splits)
            paged_decode(queries, k_cache, v_cache, table, ones, scale=scale, window=window, kernel=self._decode,
                         token_seq=torch.arange(rows, dtype=torch.int32, device=device), splits=splits)
        group = q.shape[1] // kv_heads
        table = torch.zeros((1, 1), dtype=torch.int32, device=device)
        blocks = plan_blocks([1], [1], [0, 1], group=group, config=config_for(q.shape[-1], group), device=device)
        paged_prefill(q, k_cache, v_cache, table, blocks, scale=scale, window=window)

    @staticmethod
    def _new_prompts(delegate, q, k_cache, v_cache, slots, varlen: VarlenMetadata, scale):
        """Causal attention of sequences that are all new tokens, over their k/v just written to the pool."""
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        return delegate.varlen(q, k, v, varlen, causal=True, scale=scale, window=None)

    def _varlen_delegate(self, q):
        for name in _VARLEN_DELEGATES:
            probe = registry.probe(name)
            target = probe.backend and next((t for t in probe.backend.spec.targets if t.kind == q.device.type), None)
            if target is not None and q.dtype in target.dtypes and _fits(target, q.shape[-1]):
                return probe.backend
        return None


# Above this many (token x context) pairs, a mixed step's tokens as decode queries of their own (the form
# a CUDA graph takes: `PagedMetadata.token_seq`) re-read more context than an eager step costs, which runs
# the paged prefill kernel instead: 64 decode rows of 8k tokens each.
PER_TOKEN_BUDGET = 64 * 8192


@dataclass(frozen=True)
class MixedPlan:
    """How an eager mixed step's sequences split, by kernel: `prompt_rows` (sequences of new tokens only, to
    the varlen delegate, with `prompt_meta`); `decode_rows` (sequences of one new token, the decode kernel's
    rows: block-table row `decode_seq`, context `decode_ctx`); `blocks` (the chunks of every other sequence,
    for the paged prefill kernel). All on the device, built once per step
    on the host. One-token sequences stay with the decode kernel: a block of one token would fill a
    fraction of the prefill kernel's rows, and the decode kernel's per-group tile is its size."""

    blocks: BlockPlan | None
    decode_rows: torch.Tensor | None
    decode_seq: torch.Tensor | None
    decode_ctx: torch.Tensor | None
    prompt_rows: torch.Tensor | None
    prompt_meta: VarlenMetadata | None

    @classmethod
    def of(cls, meta, varlen: bool, group: int, head_dim: int) -> MixedPlan:
        rows = [0, *accumulate(meta.query_lens)]
        prompts, decodes, chunks = [], [], []
        for b, (q, c) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
            if q:
                (prompts if varlen and q == c else decodes if q == 1 else chunks).append(b)
        device = meta.device
        blocks = plan_blocks(meta.query_lens, meta.context_lens_host, rows, group=group,
                             config=config_for(head_dim, group), device=device, seqs=chunks) if chunks else None
        prompt_meta = prompt_rows = None
        if prompts:
            lens = [meta.query_lens[b] for b in prompts]
            prompt_meta = VarlenMetadata(host_to_device([0, *accumulate(lens)], torch.int32, device), max(lens),
                                         tuple(lens))
            prompt_rows = host_to_device([t for b in prompts for t in range(rows[b], rows[b + 1])], torch.int64,
                                         device)

        def on_device(values, dtype):
            return host_to_device(values, dtype, device) if decodes else None

        return cls(blocks=blocks,
                   decode_rows=on_device([rows[b] for b in decodes], torch.int64),
                   decode_seq=on_device(decodes, torch.int32),
                   decode_ctx=on_device([meta.context_lens_host[b] for b in decodes], torch.int32),
                   prompt_rows=prompt_rows, prompt_meta=prompt_meta)


def _fits(target, head_dim: int) -> bool:
    return (target.max_head_dim is None or head_dim <= target.max_head_dim) and head_dim % target.head_dim_multiple == 0


__all__ = ["MixedPlan", "TritonPaged", "decode_splits", "paged_decode"]
