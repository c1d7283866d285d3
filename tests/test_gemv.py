"""The Triton GEMV (modalmesh.kernels.gemv) equals F.linear, and the linear layers route through it only when asked.

Every launch config in CANDIDATES, M = 1..MAX_ROWS, with and without bias, on
N and K that are not multiples of the blocks (K once shorter than a block and
once several blocks plus a tail): float32 must agree to float32 rounding,
bfloat16 to one rounding of the output (against a float32 reference).

The kernel runs on CUDA (the device machine), where the real decode shapes are
also checked and captured in a CUDA graph; without a GPU it runs under Triton's
interpreter (``TRITON_INTERPRET=1`` with Triton installed) on tiny shapes, and
is skipped where neither is available. Compiling every candidate for sm_90
needs Triton alone (no GPU): it checks that the launch configs build and that
their loops prefetch.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from modalmesh import kernels
from modalmesh.kernels import gemv as gemv_kernels
from modalmesh.kernels.gemv import CANDIDATES, MAX_ROWS, GemvConfig, default_config, gemv
from modalmesh.layers import ColumnParallelLinear, GatedMLP, LinearBase, QKVParallelLinear, RowParallelLinear
from modalmesh.layers.linear import enable_gemv
from tests.test_kernels import decode_logits

DEVICES = []
if kernels.triton_importable() and torch.cuda.is_available():
    DEVICES.append("cuda")
if kernels.triton_importable() and os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES.append("cpu")
cuda = pytest.mark.skipif(not (kernels.triton_importable() and torch.cuda.is_available()), reason="needs CUDA")


def _tol(dtype, ref):
    """float32: its rounding; half types: one rounding of the output (the interpreter truncates to bfloat16),
    relative to the largest output, since sums of mixed signs can land near zero."""
    scale = float(ref.abs().max())
    return dict(atol=1e-5 * scale, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2 * scale, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CANDIDATES, ids=str)
@pytest.mark.parametrize("dtype,k", [(torch.float32, 100), (torch.bfloat16, 100), (torch.float32, 2100)],
                         ids=["f32-short", "bf16-short", "f32-tail"])  # the loop and its tail do not depend on dtype
def test_gemv_equals_linear_for_every_candidate(device, config, dtype, k):
    torch.manual_seed(0)
    n = 19  # not a multiple of any BLOCK_N: the last program is masked
    weight = torch.randn(n, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    for m in range(1, MAX_ROWS + 1):
        x = torch.randn(m, k, device=device).to(dtype)
        assert gemv_kernels.usable(x, weight)
        for b in (None, bias):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            got = gemv(x, weight, b, config)
            assert got.dtype == dtype and got.shape == (m, n)
            torch.testing.assert_close(got.float(), want, **_tol(dtype, want))


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_default_config_on_a_tiny_shape(device):
    x, weight = torch.randn(2, 24, device=device), torch.randn(5, 24, device=device)
    assert default_config(5, 24) == GemvConfig(8, 32)  # a block no wider than K
    torch.testing.assert_close(gemv(x, weight), F.linear(x, weight))


def test_the_default_config_is_the_one_measured_and_among_the_candidates():
    for n, k in [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584)]:
        assert default_config(n, k) == GemvConfig(8, 512) and default_config(n, k) in CANDIDATES


def test_usable_only_for_few_contiguous_rows_of_the_weights_dtype():
    weight = torch.randn(8, 16)
    ok = torch.randn(2, 16)
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and kernels.triton_importable()
    assert gemv_kernels.usable(ok, weight) == interpret  # CPU tensors: only under the interpreter
    for x in (torch.randn(MAX_ROWS + 1, 16), torch.randn(0, 16), torch.randn(16, 2).t(), torch.randn(2, 16).half(),
              torch.randn(1, 2, 16), torch.randn(2, 8)):
        assert not gemv_kernels.usable(x, weight)


def _tiny_stack():
    torch.manual_seed(0)
    stack = torch.nn.ModuleDict({
        "qkv": QKVParallelLinear(48, 8, 4, 2, bias=True, tp_rank=0, tp_size=1),
        "o": RowParallelLinear(32, 48, bias=True, tp_rank=0, tp_size=1),
        "mlp": GatedMLP(48, 40, "silu", tp_rank=0, tp_size=1),
        "up": ColumnParallelLinear(48, 24, bias=False, tp_rank=0, tp_size=1),
    })
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return stack


def _forward(stack, x):
    q, k, v = stack["qkv"].split(stack["qkv"](x))
    h = x + stack["o"](q.contiguous())  # as attention's output is
    return torch.cat([stack["mlp"](h), stack["up"](h), k, v], dim=-1)


def test_enable_gemv_flags_every_linear_layer_and_defaults_off():
    stack = _tiny_stack()
    linears = [m for m in stack.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 5 and not any(m.gemv for m in linears)  # qkv, o, gate_up, down, up
    assert enable_gemv(stack) == 5 and all(m.gemv for m in linears)
    assert enable_gemv(stack, False) == 5 and not any(m.gemv for m in linears)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_with_gemv_enabled_equal_disabled(device, monkeypatch):
    stack = _tiny_stack().to(device)
    calls = []
    monkeypatch.setattr(gemv_kernels, "gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    with torch.inference_mode():
        for rows in (1, 2, MAX_ROWS + 3):
            x = torch.randn(rows, 48, device=device)
            enable_gemv(stack, False)
            want = _forward(stack, x)
            assert not calls
            enable_gemv(stack)
            got = _forward(stack, x)
            # one row through the kernel; more (slower there than cuBLAS, ROUTED_ROWS) through F.linear
            assert len(calls) == (5 if rows <= gemv_kernels.ROUTED_ROWS else 0), calls
            calls.clear()
            torch.testing.assert_close(got, want, **_tol(torch.float32, want))


def test_row_parallel_with_gemv_adds_the_bias_once_after_the_reduce(monkeypatch):
    """tp > 1: each rank's partial product goes through the kernel without the bias; the bias is added after
    the all-reduce, once (here the reduce is a sum over the ranks' shards in one process)."""
    torch.manual_seed(0)
    tp, w, b, x = 2, torch.randn(6, 8), torch.randn(6), torch.randn(1, 8)
    seen = []
    monkeypatch.setattr(gemv_kernels, "usable", lambda x, weight: True)
    monkeypatch.setattr(gemv_kernels, "gemv", lambda x, weight, bias=None: seen.append(bias) or F.linear(x, weight))
    partial = []
    for rank in range(tp):
        layer = RowParallelLinear(8, 6, bias=True, tp_rank=rank, tp_size=tp, reduce_results=False)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        enable_gemv(layer)
        partial.append(layer(x.chunk(tp, -1)[rank].contiguous()) - b)  # bias on each rank's output, then removed
    assert seen == [None, None]
    torch.testing.assert_close(sum(partial) + b, F.linear(x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_decoder_with_gemv_equals_the_decoder_without(device, tmp_path, monkeypatch):
    """A tiny Qwen2 (q|k|v bias): every projection of a decode step's single row takes the kernel (their inputs
    are contiguous in the real decoder), the prefill's rows do not, and the logits do not change."""
    from modalmesh.testing import tiny
    from services.llm.loader import load_llm

    model, cfg, _ = load_llm(tiny.ensure("qwen2", tmp_path), device=torch.device(device), dtype=torch.float32)
    prompt, steps = [5, 77, 301, 12, 9, 250], 2  # the interpreter runs ~4 ms per program: few steps
    want = decode_logits(model, cfg, device, prompt, steps)
    calls = []
    monkeypatch.setattr(gemv_kernels, "gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or gemv(x, *a, **kw))
    assert enable_gemv(model) == 4 * cfg.num_layers  # qkv, o, gate_up, down; the LM head is not a LinearBase
    got = decode_logits(model, cfg, device, prompt, steps)
    assert calls == [1] * (4 * cfg.num_layers * steps)
    torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def _compiles_for_nvidia() -> bool:
    """Triton with its NVIDIA backend and the ptxas it ships (what compiling for sm_90 without a GPU needs)."""
    if not kernels.triton_importable() or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter compiles nothing
        return False
    import importlib.util

    spec = importlib.util.find_spec("triton.backends.nvidia")
    return spec is not None and os.path.exists(os.path.join(os.path.dirname(spec.origin), "bin", "ptxas"))


@pytest.mark.skipif(not _compiles_for_nvidia(), reason="needs Triton's NVIDIA backend and its ptxas, not the interpreter")
def test_every_candidate_compiles_for_sm90_and_prefetches():
    """On the host, no GPU: the launch configs build for an H100/H200 (a bad one fails here, not on the device),
    and num_stages > 1 turns the weight loads into cp.async prefetches (a loop without tl.dot is pipelined only
    through tl.range's num_stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = gemv_kernels._kernel()
    sig = {name: "*bf16" for name in ("X", "W", "B", "Out")} | {name: "i32" for name in
                                                             ("N", "K", "stride_x", "stride_w", "stride_o")}
    for config in CANDIDATES:
        constexprs = dict(ROWS=MAX_ROWS, HAS_BIAS=True, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                          NUM_STAGES=config.num_stages)
        src = ASTSource(fn, sig | {name: "constexpr" for name in constexprs}, constexprs,
                        {(i,): [["tt.divisibility", 16]] for i in range(9)})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
        assert ("cp.async" in compiled.asm["ptx"]) == (config.num_stages > 1), config


QWEN7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
          "lm_head": (152064, 3584)}


@cuda
@pytest.mark.parametrize("shape", QWEN7B.values(), ids=QWEN7B.keys())
def test_gemv_on_decode_shapes_in_bf16_and_in_a_cuda_graph(shape):
    n, k = shape
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, MAX_ROWS):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, weight, bias)
        for config in (None, *CANDIDATES):
            torch.testing.assert_close(gemv(x, weight, bias, config).float(), want.float(),
                                       **_tol(torch.bfloat16, want.float()))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eager = gemv(x, weight)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    x.copy_(torch.randn_like(x))  # the graph reads the new input
    graph.replay()
    torch.testing.assert_close(out, gemv(x, weight), atol=0, rtol=0)


def test_the_llm_config_turns_the_gemv_on_in_every_linear_layer_of_the_runner(tmp_path):
    """LLMConfig.gemv_kernels (on unless --no-gemv-kernels) reaches every linear layer of the model the runner builds."""
    from modalmesh.layers.linear import LinearBase
    from modalmesh.testing import tiny
    from services.llm.config import LLMConfig
    from services.llm.runner import ModelRunner

    path = tiny.ensure("qwen2", tmp_path)
    for wanted in (False, True):
        runner = ModelRunner(LLMConfig(model_dir=path, kv_cache_tokens=256, max_model_len=128, gemv_kernels=wanted))
        flags = {m.gemv for m in runner.model.modules() if isinstance(m, LinearBase)}
        runner.shutdown()
        assert flags == {wanted}
