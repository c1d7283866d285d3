"""Linear layers that shard themselves for tensor parallelism and load their own weights.

Megatron-style: a ColumnParallelLinear splits the output features over the TP
ranks (no communication), a RowParallelLinear splits the input features and
all-reduces its output, so column -> row pairs (QKV -> O, gate_up -> down) need
one all-reduce per pair. Every parameter carries ``weight_loader(param, tensor,
shard_id=None)`` that takes the *full* checkpoint tensor and copies this rank's
slice, so checkpoints never need resharding.

The TP rank and size default to the process's group (`modalmesh.distributed`);
passing them explicitly builds any rank's shard in a single process (tests).
Layers built under ``with torch.device("meta")`` allocate nothing until the
weight loader materialises them.

A layer whose ``gemv`` flag is set (`enable_gemv`) runs inputs of at most
``ROUTED_ROWS`` rows (one) through the Triton GEMV (`modalmesh.kernels.gemv`),
which reads the weight faster than cuBLAS at batch-1 decode; everything else
runs F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modalmesh import distributed
from modalmesh.errors import ConfigError
from modalmesh.kernels import gemv as gemv_kernels
from modalmesh.weights.errors import WeightMismatchError
from modalmesh.weights.param import copy_into, default_weight_loader, narrow_checked, set_weight_loader


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"{what} = {numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def padded(size: int, pad_to: int, what: str) -> int:
    """`size` rounded up to a multiple of `pad_to` (a layer's width that its GEMM runs faster at)."""
    if not isinstance(pad_to, int) or pad_to < 1:
        raise ConfigError(f"{what}: pad_to = {pad_to!r} should be a positive integer")
    return -(-size // pad_to) * pad_to


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_rank = distributed.tp_rank() if tp_rank is None else tp_rank
        self.tp_size = distributed.tp_size() if tp_size is None else tp_size
        self.input_size = input_size  # full (unsharded) sizes
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.gemv = False  # set by enable_gemv

    def _make_params(self, out_per_rank: int, in_per_rank: int, bias: bool, shard_ids: tuple = ()) -> None:
        self.weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank, dtype=self.params_dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader, shard_ids)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_per_rank, dtype=self.params_dtype), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader, shard_ids)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, self.weight, bias), through the GEMV kernel when enabled and `x` has few rows."""
        if self.gemv and x.shape[0] <= gemv_kernels.ROUTED_ROWS and gemv_kernels.usable(x, self.weight):
            return gemv_kernels.gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """The whole matrix on every rank (small projections, encoders that do not shard)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, **kw):
        super().__init__(input_size, output_size, bias=bias, **kw)
        self._make_params(output_size, input_size, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; `gather_output` re-assembles them (all-gather).

    `pad_to`: each rank's rows rounded up to a multiple of it, the rows past the checkpoint's held at zero (their
    outputs are the bias's zero): cuBLAS runs some widths much slower than the next multiple of 128 (SigLIP's
    4,304-wide fc1 at 583 TFLOP/s, 4,352 at 647 on an H100, `bench/gemm.py`). The layer reading these outputs
    (a RowParallelLinear with the same `pad_to`) holds zero columns for them.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, gather_output: bool = False,
                 pad_to: int = 1, **kw):
        super().__init__(input_size, output_size, bias=bias, **kw)
        self.gather_output = gather_output
        self.output_size_per_rank = divide(output_size, self.tp_size, "output size")
        self.rows_per_rank = padded(self.output_size_per_rank, pad_to, "column-parallel layer")
        if self.rows_per_rank != self.output_size_per_rank and (self._shard_ids() or gather_output):
            raise ConfigError("pad_to pads a plain column-parallel layer: a fused layer's outputs are split by "
                              "size and gathered outputs by rank")
        self._make_params(self.rows_per_rank, input_size, bias, self._shard_ids())

    def _shard_ids(self) -> tuple:
        return ()

    def _load_rows(self, param, loaded, *, dst_start: int, src_full: int, src_start: int, size: int, what: str):
        """Copy rows [src_start, src_start+size) of a checkpoint tensor with `src_full` rows into param rows at dst_start."""
        src = narrow_checked(loaded, 0, src_full, src_start, size, what, param)
        copy_into(param.narrow(0, dst_start, size), src)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is not None:
            raise WeightMismatchError(f"shard {shard_id!r} given for a column-parallel layer that is not fused")
        n = self.output_size_per_rank
        self._load_rows(param, loaded, dst_start=0, src_full=self.output_size, src_start=self.tp_rank * n,
                        size=n, what="column-parallel")
        with torch.no_grad():
            param[n:].zero_()  # the padding (`pad_to`), whatever the parameter held before loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return distributed.all_gather(y, dim=-1) if self.gather_output and self.tp_size > 1 else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate|up); shard id = index into `output_sizes`."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, **kw):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, **kw)
        self.sizes_per_rank = [divide(s, self.tp_size, f"output size #{i}") for i, s in enumerate(output_sizes)]

    def _shard_ids(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # a checkpoint that already fuses them (e.g. Phi-3 gate_up_proj)
            for i, part in enumerate(narrow_checked(loaded, 0, self.output_size, 0, self.output_size, "merged")
                                     .split(self.output_sizes, 0)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id!r}: expected 0..{len(self.output_sizes) - 1}")
        n = self.sizes_per_rank[shard_id]
        self._load_rows(param, loaded, dst_start=sum(self.sizes_per_rank[:shard_id]),
                        src_full=self.output_sizes[shard_id], src_start=self.tp_rank * n, size=n,
                        what=f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection, heads split over ranks.

    When the TP size exceeds the number of KV heads (GQA/MQA), each KV head is
    replicated on ``tp_size // num_kv_heads`` consecutive ranks: rank r holds KV
    head ``r // replicas``. Shard ids: "q", "k", "v"; None for a checkpoint that
    concatenates q|k|v (``wqkv``, ``qkv``); "qkv_per_head" for GPT-NeoX's
    ``query_key_value``, laid out as (heads, 3, head_dim) along the rows.
    """

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        *,
        v_head_size: int | None = None,
        **kw,
    ):
        # The per-rank geometry decides the parameter shape, so it is computed before
        # LinearBase.__init__ allocates (plain ints may be set before Module.__init__).
        tp_size = distributed.tp_size() if kw.get("tp_size") is None else kw["tp_size"]
        self.head_size = head_size
        self.v_head_size = v_head_size or head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= self.total_num_kv_heads:
            if tp_size % self.total_num_kv_heads:
                raise ConfigError(f"TP size {tp_size} cannot replicate {self.total_num_kv_heads} KV heads evenly")
            self.kv_replicas = tp_size // self.total_num_kv_heads
            self.num_kv_heads = 1
        else:
            self.kv_replicas = 1
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size, "number of KV heads")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self.v_size = self.num_kv_heads * self.v_head_size
        total_out = (total_num_heads + self.total_num_kv_heads) * head_size + self.total_num_kv_heads * self.v_head_size
        per_rank = self.q_size + self.kv_size + self.v_size
        super().__init__(hidden_size, per_rank * tp_size, bias, **kw)
        self.output_size = total_out  # the checkpoint's fused row count (KV replication makes it differ)

    def _shard_ids(self) -> tuple:
        return self.SHARD_IDS

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, k, v from the layer's output (last dim)."""
        return qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)

    def weight_loader(self, param, loaded, shard_id=None):
        H, KV, D, Dv = self.total_num_heads, self.total_num_kv_heads, self.head_size, self.v_head_size
        if shard_id is None:
            full = narrow_checked(loaded, 0, self.output_size, 0, self.output_size, "fused q|k|v")
            for sid, part in zip(self.SHARD_IDS, full.split([H * D, KV * D, KV * Dv], 0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "qkv_per_head":
            if KV != H or Dv != D:
                raise ValueError("qkv_per_head layout needs as many KV heads as heads and equal head dims")
            full = narrow_checked(loaded, 0, 3 * H * D, 0, 3 * H * D, "per-head interleaved q|k|v")
            per_head = full.reshape(H, 3, D, *full.shape[1:])
            for i, sid in enumerate(self.SHARD_IDS):
                self.weight_loader(param, per_head[:, i].reshape(H * D, *full.shape[1:]), sid)
            return
        kv_head0 = (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        if shard_id == "q":
            args = dict(dst_start=0, src_full=H * D, src_start=self.tp_rank * self.q_size, size=self.q_size)
        elif shard_id == "k":
            args = dict(dst_start=self.q_size, src_full=KV * D, src_start=kv_head0 * D, size=self.kv_size)
        elif shard_id == "v":
            args = dict(dst_start=self.q_size + self.kv_size, src_full=KV * Dv, src_start=kv_head0 * Dv,
                        size=self.v_size)
        else:
            raise ValueError(f"shard id {shard_id!r}: expected 'q', 'k', 'v', 'qkv_per_head' or None")
        self._load_rows(param, loaded, what=f"qkv shard {shard_id!r}", **args)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}/{self.total_num_heads}, kv_heads={self.num_kv_heads}/"
                f"{self.total_num_kv_heads} (x{self.kv_replicas}), head={self.head_size}, v_head={self.v_head_size}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}")


class RowParallelLinear(LinearBase):
    """Input features split over ranks; partial products are summed with one all-reduce.

    The bias is added once, after the reduction, so it is not counted tp_size times. `pad_to`: each rank's
    columns rounded up to a multiple of it, held at zero; the input is the padded output of a
    ColumnParallelLinear with the same `pad_to`.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *,
                 input_is_parallel: bool = True, reduce_results: bool = True, pad_to: int = 1, **kw):
        super().__init__(input_size, output_size, bias=bias, **kw)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_rank = divide(input_size, self.tp_size, "input size")
        self.columns_per_rank = padded(self.input_size_per_rank, pad_to, "row-parallel layer")
        if self.columns_per_rank != self.input_size_per_rank and not input_is_parallel:
            raise ConfigError("pad_to needs input_is_parallel: a whole input has no padding to read")
        self._make_params(output_size, self.columns_per_rank, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is not None or param.dim() == 1:  # the bias is whole on every rank
            default_weight_loader(param, loaded, shard_id)
            return
        n = self.input_size_per_rank
        copy_into(param[:, :n], narrow_checked(loaded, 1, self.input_size, self.tp_rank * n, n, "row-parallel", param))
        with torch.no_grad():
            param[:, n:].zero_()  # the padding (`pad_to`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._linear(x, self.bias)
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_rank, self.input_size_per_rank)
        y = self._linear(x, None)
        if self.reduce_results:
            y = distributed.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def enable_gemv(model: nn.Module, enabled: bool = True) -> int:
    """Set (or clear) the `gemv` flag of every linear layer in `model`; returns how many layers it set."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.gemv = enabled
    return len(layers)
