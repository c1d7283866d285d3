"""The attention backends: one module per kernel family, each an `AttentionBackend`.

Their capability records are data in modalmesh/attention/builtin_backends.py; the
registry imports a module here only when it probes that backend.

    base.py           AttentionBackend: the interface every backend implements
    sdpa.py           torch SDPA pinned to one kernel (cuDNN, flash, efficient, math)
    torch_varlen.py   torch's varlen flash attention (cu_seqlens)
    fa2.py / fa3.py   the flash-attn 2 / FlashAttention-3 wheels
    triton_paged.py   our Triton paged-KV decode kernel (CUDA-graph safe)
    naive.py          the reference (test oracle)
"""
