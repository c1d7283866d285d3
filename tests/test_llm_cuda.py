"""The LLM on CUDA: FP32 greedy tokens equal HF generate; bf16 logits close to the FP32 reference.

Skipped without a GPU (CI has none); run on the device machine.
"""

import queue

import pytest
import torch

from modalmesh.attention import PagedMetadata
from modalmesh.kv.pool import build_kv_pool
from modalmesh.metrics import Metrics
from modalmesh.testing import tiny
from services.llm.config import LLMConfig
from services.llm.engine import LLMEngine
from services.llm.inputs import PreparedPrompt
from services.llm.loader import load_llm
from services.llm.runner import ModelRunner
from services.llm.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAMILIES = ("llama", "qwen2", "qwen3", "gpt_neox")
PROMPTS = [[5, 77, 301, 12, 9, 250, 31], [400, 3], list(range(40, 73))]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-llm")


def _engine(path, tokenizer, dtype, cuda_graphs=True, prefix_caching=True, max_graph_tokens=2048):
    metrics = Metrics("llm", process_metrics=False)
    config = LLMConfig(model_dir=path, device_type="cuda", dtype=dtype, max_model_len=256, kv_cache_tokens=2048,
                       max_batch_tokens=24, max_num_seqs=8, cuda_graphs=cuda_graphs, prefix_caching=prefix_caching,
                       max_graph_tokens=max_graph_tokens)
    return LLMEngine(ModelRunner(config, metrics), tokenizer, eos_token_ids=(), metrics=metrics)


def _generate(engine, prompts, n):
    outs = [queue.Queue() for _ in prompts]
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", PreparedPrompt(list(p)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                   outs[i].put)
    results = []
    for q in outs:
        ids = []
        while True:
            d = q.get(timeout=120)
            assert d.error is None, d.error
            ids += d.token_ids
            if d.finish_reason:
                break
        results.append(ids)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_on_cuda_equals_hf_generate(root, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.ensure(family, root)
    engine = _engine(path, AutoTokenizer.from_pretrained(path), torch.float32)
    engine.start()
    try:
        got = _generate(engine, PROMPTS, 16)
    finally:
        engine.stop()
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, ids in zip(PROMPTS, got):
        # Teacher-force the reference on our tokens: each must be its argmax, up to an FP32 near-tie
        # (cuBLAS and CPU sum in different orders, so two logits 1e-6 apart may swap on random weights).
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.all(chosen >= logits.max(-1).values - 1e-4), (family, prompt)
        assert len(set(ids)) > 3


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_on_cuda_are_close_to_the_fp32_reference(root, family, fused):
    from transformers import AutoModelForCausalLM

    path = tiny.ensure(family, root)
    model, cfg, _ = load_llm(path, device=torch.device("cuda"), dtype=torch.bfloat16, fused_kernels=fused)
    pool = build_kv_pool(cfg, "cuda", max_model_len=256, dtype=torch.bfloat16, kv_cache_tokens=512,
                         metrics=Metrics("llm", process_metrics=False))
    prompt = PROMPTS[2]
    assert pool.allocate("s", len(prompt))
    meta = PagedMetadata.build([len(prompt)], [len(prompt)], pool.block_table(["s"]), pool.page_size)
    with torch.inference_mode():
        hidden = model(torch.arange(len(prompt), device="cuda"), meta,
                       [pool.layer(i) for i in range(cfg.num_layers)],
                       input_ids=torch.tensor(prompt, device="cuda"))
        ours = model.compute_logits(hidden).float().cpu()
    ref_model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0].float()
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 0.05 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("family", ["qwen2", "gpt_neox", "qwen2_vl"])
def test_cuda_graph_steps_equal_eager_steps(root, family):
    """Decode steps (batch buckets) and mixed steps (token buckets: decode rows beside prompt chunks, here
    from a 24-token budget) replayed from graphs, against eager steps. float32, where the graphs' per-token
    decode kernel and the eager steps' paged prefill kernel agree to rounding (bf16 eager steps hand new
    prompts to a varlen kernel, which rounds otherwise)."""
    from transformers import AutoTokenizer

    path = tiny.ensure(family, root)
    tokenizer = AutoTokenizer.from_pretrained(path)
    results = {}
    for graphs in (True, False):
        engine = _engine(path, tokenizer, torch.float32, cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs, "triton_paged should make steps graph-safe"
        replays = {"decode": 0, "mixed": 0}
        if graphs:
            for kind, g in (("decode", engine.runner.graphs), ("mixed", engine.runner.mixed_graphs)):
                run = g.run
                g.run = lambda *a, _run=run, _kind=kind: (replays.__setitem__(_kind, replays[_kind] + 1), _run(*a))[1]
        engine.start()
        try:
            results[graphs] = _generate(engine, PROMPTS + [[7] * 3, [9, 8]], 20)  # 5 sequences: a padded bucket
        finally:
            engine.stop()
        assert engine.pool.allocator.used_tokens == 0
        steps = {path: engine.metrics.registry.get_sample_value(
            "modalmesh_engine_steps_total", {"service": "llm", "path": path})
            for path in ("decode_graph", "mixed_graph", "eager")}
        if graphs:
            assert replays["decode"] and replays["mixed"], replays
            # the metric counts each replay on its path (a step's replay is one run call)
            assert (steps["decode_graph"], steps["mixed_graph"]) == (replays["decode"], replays["mixed"])
            assert steps["eager"] == engine.steps - replays["decode"] - replays["mixed"]
        else:
            assert steps["decode_graph"] == steps["mixed_graph"] == 0 and steps["eager"] == engine.steps
    assert results[True] == results[False]


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_graph_replay_over_shared_prefix_pages_equals_eager_and_the_cache_off(root, family):
    """Prompts sharing a 40-token prefix: the later ones start from the first one's cached pages and decode
    in graphs (their block tables name shared pages), against eager steps and against the cache off."""
    from transformers import AutoTokenizer

    path = tiny.ensure(family, root)
    tokenizer = AutoTokenizer.from_pretrained(path)
    system = [(11 * i + 5) % 300 + 20 for i in range(40)]
    later = [system + [7, 8, 9], system + [300, 2], system[:20] + [41, 42, 43, 44], system + [7, 8, 9]]
    results = {}
    for graphs, caching in ((True, True), (False, True), (True, False)):
        engine = _engine(path, tokenizer, torch.float32, cuda_graphs=graphs, prefix_caching=caching)
        replays = []
        if graphs:
            run = engine.runner.graphs.run
            engine.runner.graphs.run = lambda *a: (replays.append(1), run(*a))[1]
        engine.start()
        try:
            got = [_generate_full(engine, [system + [1]], 12, prefix="a")[0]]
            got += _generate_full(engine, later, 12, prefix="b")  # concurrent: decode batches of shared pages
        finally:
            engine.stop()
        assert engine.pool.allocator.used_tokens == 0
        assert not graphs or replays
        cached = [c for _, _, c in got]
        assert (sum(cached[1:]) > 0) == caching, cached
        results[graphs, caching] = got
    want = results[False, True]
    for key in ((True, True), (True, False)):
        for (ids, lps, _), (want_ids, want_lps, _) in zip(results[key], want):
            assert ids == want_ids, key
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)


def _generate_full(engine, prompts, n, prefix="r"):
    """(tokens, logprobs, cached prompt tokens) of each prompt, all added at once."""
    outs = [queue.Queue() for _ in prompts]
    for i, p in enumerate(prompts):
        engine.add(f"{prefix}{i}", PreparedPrompt(list(p)),
                   SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1), outs[i].put)
    results = []
    for q in outs:
        ids, lps = [], []
        while True:
            d = q.get(timeout=120)
            assert d.error is None, d.error
            ids += d.token_ids
            lps += d.logprobs
            if d.finish_reason:
                break
        results.append((ids, lps, d.cached_tokens))
    return results


def test_submitting_a_step_never_waits_for_the_device(root):
    """The engine submits step N+1 while step N runs: nothing on the submit path may synchronise the host
    with the device (CUDA's sync-debug mode raises on any synchronising call), in decode, mixed and eager
    steps alike (the largest step here is past the mixed graphs' token buckets)."""
    from transformers import AutoTokenizer

    path = tiny.ensure("qwen2", root)
    engine = _engine(path, AutoTokenizer.from_pretrained(path), torch.bfloat16, max_graph_tokens=16)
    assert engine.runner.mixed_graphs.sizes == [16]  # longer steps eager
    submit = engine.runner.submit

    def strict(step, previous=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return submit(step, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.submit = strict
    engine.start()
    try:
        got = _generate(engine, PROMPTS + [[7] * 3, [9, 8]], 12)
    finally:
        engine.stop()
    assert all(len(ids) == 12 for ids in got)


def _serve(path, *flags):
    from modalmesh.ops.launcher import ServiceProcess

    proc = ServiceProcess("llm", ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--model", str(path),
                                  "--max-num-seqs", "8", *flags]).start()
    proc.wait_serving(timeout=300)
    return proc


def _tokens(proc, prompts, n=16):
    import grpc

    from modalmesh import pb

    with grpc.insecure_channel(proc.target) as channel:
        stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=10)
        outs = [[t for r in stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
            timeout=120) for t in r.token_ids] for p in prompts]
    return outs, info


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
def test_tensor_parallel_two_gpus_equals_one(root):
    path = tiny.ensure("qwen2", root)
    outs = {}
    for tp in (1, 2):
        proc = _serve(path, "--dtype", "float32", "--tensor-parallel-size", str(tp))
        try:
            outs[tp], info = _tokens(proc, PROMPTS)
            assert sorted(c.rank for c in info.attention) == list(range(tp))
        finally:
            assert proc.terminate(timeout=60) == 0  # SIGTERM: drained, ranks joined, exit 0
    assert outs[1] == outs[2] and all(len(set(o)) > 3 for o in outs[1])


def _tp2_engine_tokens(path, graphs, results):
    """In a fresh process (a rank leaves its NCCL group only by ending): rank 0 here, rank 1 spawned."""
    from transformers import AutoTokenizer

    from modalmesh import distributed

    metrics = Metrics("llm", process_metrics=False)
    config = LLMConfig(model_dir=path, device_type="cuda", dtype=torch.float32, max_model_len=256,
                       kv_cache_tokens=2048, max_batch_tokens=24, max_num_seqs=8, cuda_graphs=graphs,
                       tensor_parallel_size=2)
    runner = ModelRunner.launch(config, metrics)
    engine = LLMEngine(runner, AutoTokenizer.from_pretrained(path), eos_token_ids=(), metrics=metrics)
    engine.start()
    try:
        tokens = _generate(engine, PROMPTS + [[7] * 3, [9, 8]], 20)  # 5 sequences at once: a padded bucket
    finally:
        engine.stop()
        runner.shutdown()
    results.put(([r.cuda_graphs for r in runner.reports], tokens, engine.pool.allocator.used_tokens,
                 [p.exitcode for p in runner.workers.procs]))
    results.close()
    results.join_thread()  # the queue's feeder thread must have written before os._exit
    distributed.exit_rank(0)


@two_gpus
@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_tensor_parallel_graph_replay_equals_eager(root, family):
    # float32 over NCCL: decode and mixed steps replayed from CUDA graphs on both ranks (all-reduces
    # captured) against eager steps, with the same schedule (every request added at once).
    import torch.multiprocessing as mp

    path = tiny.ensure(family, root)
    ctx = mp.get_context("spawn")
    results = {}
    for graphs in (True, False):
        out = ctx.Queue()
        proc = ctx.Process(target=_tp2_engine_tokens, args=(path, graphs, out))
        proc.start()
        try:
            reports, tokens, used, worker_codes = out.get(timeout=150)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        assert proc.exitcode == 0 and worker_codes == [0]
        assert reports == [graphs, graphs] and used == 0
        results[graphs] = tokens
    assert results[True] == results[False] and all(len(set(r)) > 3 for r in results[True])


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_prompt_logprobs_on_cuda_equal_hf_beside_decoding_requests(root, cuda_graphs):
    """Scored prompt chunks ride the steps of running decodes (mixed steps: replayed from a token-bucket
    graph when graphs are on) and equal HF's FP32 log-softmax over the prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny.ensure("qwen2", root)
    engine = _engine(path, AutoTokenizer.from_pretrained(path), torch.float32, cuda_graphs=cuda_graphs)
    assert (engine.runner.mixed_graphs is not None) == cuda_graphs
    scored_replays = []  # mixed steps replayed from a graph while they carried scored prompt rows
    if cuda_graphs:
        mixed = engine.runner.mixed_graphs
        run = mixed.run
        mixed.run = lambda inputs, *a: (scored_replays.append(inputs.scored_rows is not None), run(inputs, *a))[1]
    engine.start()
    prompts = [list(range(40, 93)), [7, 300, 12]]
    try:
        busy = queue.Queue()
        engine.add("busy", PreparedPrompt([5, 6, 7]), SamplingParams(temperature=0.0, max_tokens=60,
                                                                     ignore_eos=True), busy.put)
        busy.get(timeout=120)  # it decodes while the scored prompts are prefilled
        outs = []
        for i, p in enumerate(prompts):
            outs.append(queue.Queue())
            engine.add(f"s{i}", PreparedPrompt(p), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                                  prompt_logprobs=3), outs[-1].put)
        firsts = [o.get(timeout=120) for o in outs]
        busy_tokens = 1 + sum(len(busy.get(timeout=120).token_ids) for _ in range(busy.qsize()))
    finally:
        engine.stop()
    assert busy_tokens < 60, "the busy request had finished before the scored prompts came: nothing was mixed"
    assert not cuda_graphs or any(scored_replays), scored_replays
    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, first in zip(prompts, firsts):
        assert first.error is None and first.prompt_ids == prompt
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        got = torch.tensor([lp for lp, _, _ in first.prompt_logprobs])
        torch.testing.assert_close(got, want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=2e-4, rtol=0)
        top = torch.tensor([[v for _, v in alts] for _, _, alts in first.prompt_logprobs])
        torch.testing.assert_close(top, want.topk(3).values, atol=2e-4, rtol=0)
