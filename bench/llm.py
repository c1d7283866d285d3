"""LLM decode throughput: our engine vs Hugging Face `generate`, same GPU, same run, beside the limit.

    python bench/llm.py              # Qwen2.5-7B shape, bf16, random weights, 128 in / 128 out
    python bench/llm.py --tp 2       # the same over two GPUs (rank 1 spawned; HF column skipped)
    python bench/llm.py --quick      # tiny shape on CPU (checks the script, not speed)

Prints output tokens/s at batch 1, 32 and the largest batch that fits, for ours
and HF, plus the memory-bandwidth limit at batch 1 (weight bytes / measured
device copy bandwidth) and time to first token of a 2k-token prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import sync  # noqa: E402
from modalmesh.metrics import Metrics  # noqa: E402
from modalmesh.testing import tiny  # noqa: E402
from services.llm.config import LLMConfig  # noqa: E402
from services.llm.engine import LLMEngine  # noqa: E402
from services.llm.inputs import PreparedPrompt  # noqa: E402
from services.llm.runner import ModelRunner  # noqa: E402
from services.llm.sampling import SamplingParams  # noqa: E402

QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
QUICK = dict(QWEN25_7B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted once each)."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    start, n = time.perf_counter(), 10
    for _ in range(n):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * n / (time.perf_counter() - start)


def make_checkpoint(shape: dict) -> Path:
    root = Path(tempfile.mkdtemp(prefix="bench-llm-"))
    (root / "config.json").write_text(json.dumps(shape))
    # Random weights sample any of the model's ids: the tokenizer covers them all, as a real one does.
    tiny.build_tokenizer(tiny.QWEN_SPECIALS, eos="<|im_end|>", fill_to=shape["vocab_size"]).save_pretrained(root)
    return root


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(output tokens/s, mean time to first token) for all prompts submitted at once."""
    import threading

    # Each delta is stamped and kept when the engine emits it; the engine thread takes no lock per token
    # (a queue per request did: its put contended with this thread's get, and cost the engine's post phase
    # up to half its time at batch 256).
    outs: list[list] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(out: list, finished: threading.Event):
        def emit(delta) -> None:
            out.append((time.perf_counter(), delta))
            if delta.finish_reason:
                finished.set()
        return emit

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(f"b{i}", PreparedPrompt(list(ids)), params, emitter(outs[i], done[i]))
    total, ttft, end = 0, [], start
    for out, finished in zip(outs, done):
        if not finished.wait(timeout=600):
            raise TimeoutError("a request did not finish in 600 s")
        first = None
        for stamp, delta in out:
            if delta.error is not None:
                raise delta.error
            if first is None and delta.token_ids:
                first = stamp - start
            total += len(delta.token_ids)
            if delta.finish_reason:
                end = max(end, stamp)
        ttft.append(first)
    return total / (end - start), sum(ttft) / len(ttft)


def run_hf(model, prompts: list[list[int]], new_tokens: int, device) -> float:
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="also trace 16 decode steps per batch: GPU busy time per step and the top kernels")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs); the HF column needs 1")
    parser.add_argument("--no-fused-kernels", action="store_true", help="the layers' unfused PyTorch path (A/B)")
    parser.add_argument("--no-gemv", action="store_true", help="one-row products through cuBLAS, not the GEMV (A/B)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="the engine without its prefix cache (A/B: random prompts share nothing)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = QUICK if args.quick else QWEN25_7B
    ckpt = make_checkpoint(shape)
    batches = [int(b) for b in args.batches.split(",")]
    g = torch.Generator().manual_seed(0)

    def prompts(n, length=args.prompt_len):
        return torch.randint(0, shape["vocab_size"], (n, length), generator=g).tolist()

    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"shape {'quick' if args.quick else 'Qwen2.5-7B'}  {dtype}  {args.prompt_len} in / {args.new_tokens} out")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    max_len = args.prompt_len + args.new_tokens
    kv_tokens = max(batches) * max_len + 4096 if device.type == "cpu" else None
    config = LLMConfig(model_dir=ckpt, device_type=device.type, dtype=dtype, dummy_weights=True,
                       max_model_len=max(max_len, 2048 + 8), kv_cache_tokens=kv_tokens, mem_fraction=0.5,
                       max_num_seqs=max(batches), max_batch_tokens=max(8192, 2048 + 8), tensor_parallel_size=args.tp,
                       fused_kernels=not args.no_fused_kernels, gemv_kernels=not args.no_gemv, prefix_caching=not args.no_prefix_caching)
    metrics = Metrics("llm", process_metrics=False)
    runner = ModelRunner.launch(config, metrics)
    model, pool = runner.model, runner.pool
    # Every rank holds 1/tp of the weights and reads its shard each decode step, in parallel.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * args.tp
    engine = LLMEngine(runner, tokenizer, eos_token_ids=(), metrics=metrics)
    engine.start()
    run_ours(engine, prompts(2, 16), 4)  # warm-up
    graphs = engine.runner.graphs is not None
    print(f"attention backend (llm): {model_backend(model)}; KV pool {pool.allocator.capacity_tokens} tokens")
    bw = copy_bandwidth(device)
    limit = bw / weight_bytes
    limit *= args.tp  # each rank streams its shard at the full bandwidth of its own GPU
    print(f"weights {weight_bytes / 1e9:.2f} GB over {args.tp} GPU(s); copy bandwidth {bw / 1e12:.2f} TB/s per GPU; "
          f"batch-1 limit {limit:.0f} tok/s")
    ours, phases = {}, {}
    for i, b in enumerate(batches):  # a batch size listed twice is measured twice (cold, then warm)
        before, steps = dict(engine.phase_seconds), engine.steps
        result = run_ours(engine, prompts(b), args.new_tokens)
        n = max(1, engine.steps - steps)
        if b in ours:
            print(f"batch {b}, run {batches[:i].count(b) + 1}: {result[0]:.1f} tok/s, TTFT {result[1] * 1e3:.1f} ms "
                  f"(earlier run: {ours[b][0]:.1f} tok/s, TTFT {ours[b][1] * 1e3:.1f} ms)")
        ours[b] = result
        phases[b] = {k: (engine.phase_seconds[k] - before[k]) / n * 1e3 for k in before}
    batches = list(dict.fromkeys(batches))
    _, ttft_2k = run_ours(engine, prompts(1, 2048), 1)
    if args.profile and device.type == "cuda":
        for b in batches:
            profile_decode(engine, prompts(b), b)
    engine.stop()
    runner.shutdown()
    del engine, model, pool, runner
    torch.cuda.empty_cache() if device.type == "cuda" else None
    hf = {}
    if not args.no_hf and args.tp == 1:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        hf_cfg = Qwen2Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
        with torch.device(device):
            hf_model = Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
        for b in batches:
            try:
                hf[b] = run_hf(hf_model, prompts(b), args.new_tokens, device)
            except torch.OutOfMemoryError:
                hf[b] = float("nan")
                torch.cuda.empty_cache()
    print(f"\nTP={args.tp}  fused kernels: {'no' if args.no_fused_kernels else 'yes'}  gemv: {'no' if args.no_gemv else 'yes'}  prefix cache: "
          f"{'off' if args.no_prefix_caching else 'on'}")
    print(f"{'batch':>6} {'ours tok/s':>12} {'HF tok/s':>10} {'speedup':>8} {'ours TTFT ms':>13}")
    for b in batches:
        tps, ttft = ours[b]
        h = hf.get(b, float("nan"))
        print(f"{b:>6} {tps:>12.1f} {h:>10.1f} {tps / h if h == h else float('nan'):>7.1f}x {ttft * 1e3:>13.1f}")
    print(f"batch-1 limit {limit:.0f} tok/s: ours at {ours[batches[0]][0] / limit * 100:.1f}% of it")
    print(f"CUDA graphs for decode: {'yes' if graphs else 'no'}; mean ms per engine step by phase:")
    for b in batches:
        print(f"   batch {b:>4}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases[b].items()))
    print(f"TTFT of a 2048-token prompt, idle engine: {ttft_2k * 1e3:.1f} ms")
    print("RESULT " + json.dumps({"tp": args.tp, "fused": not args.no_fused_kernels, "gemv": not args.no_gemv, "prefix_cache": not args.no_prefix_caching, "tok_s": {b: round(ours[b][0], 1) for b in batches},
                                  "hf_tok_s": {b: round(hf[b], 1) for b in hf}, "limit_b1": round(limit) if limit == limit else None,
                                  "step_ms": {b: round(sum(phases[b].values()), 2) for b in batches}}))
    return 0


def profile_decode(engine: LLMEngine, prompts: list[list[int]], batch: int) -> None:
    """Rank 0's view of decode steps: wall time per step against the GPU's busy time, and where it goes."""
    from torch.profiler import ProfilerActivity, profile

    run_ours(engine, prompts, 4)  # prefill outside the trace as far as possible
    steps = engine.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run_ours(engine, prompts, 17)
        wall = time.perf_counter() - start
    n = max(1, engine.steps - steps)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\nprofile, batch {batch}: {n} steps, wall {wall / n * 1e3:.2f} ms/step, GPU busy "
          f"{gpu_us / n / 1e3:.2f} ms/step (kernels summed)")
    print(events.table(sort_by="self_cuda_time_total", row_limit=int(os.environ.get("PROFILE_ROWS", "14")),
                       max_name_column_width=90))


def model_backend(model) -> str:
    for m in model.modules():
        if hasattr(m, "backend_name"):
            return m.backend_name
    return "?"


if __name__ == "__main__":
    code = main()
    from modalmesh import distributed

    if distributed.joined_a_group():  # rank 0 of a group: no interpreter finalisation (see exit_rank)
        distributed.exit_rank(code)
    raise SystemExit(code)
