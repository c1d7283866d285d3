"""Tensor parallelism in the LLM service on the CPU (gloo): one ModelRunner per rank, one config handed whole.

TP=2 against TP=1 and HF (tokens and logprobs), the attention override reaching
every rank, the step message between ranks, SIGTERM mid-stream, and ranks that
never outlive rank 0.
"""

import argparse
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from modalmesh import distributed, pb
from modalmesh.errors import ConfigError
from modalmesh.testing import tiny
from services.llm.config import LLMConfig
from services.llm.flags import add_arguments
from services.llm.step_inputs import StepChannel, StepInputs
from tests.test_llm_service import LLM, PROMPTS, greedy


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-tp-ckpts")


def _hf_logprobs(model_dir, prompt_ids, ids):
    """HF's log-probabilities of `ids` after `prompt_ids`, teacher-forced (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()


def _generate_all(llm, n):
    out = {}
    threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, _with_logprobs(llm, p, n))) for p in PROMPTS[:3]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [out[p] for p in PROMPTS[:3]]


def _with_logprobs(llm, text, n):
    ids, lps = [], []
    for r in llm.stub.Generate(pb.GenerateRequest(text=text, sampling=greedy(n, logprobs=1)), timeout=120):
        ids += r.token_ids
        lps += r.logprobs
    return ids, lps


def _prompt_scores(llm, text):
    """(prompt ids, each later token's logprob, its top-2 logprobs) from the first message of a scored call."""
    first = list(llm.stub.Generate(pb.GenerateRequest(text=text, sampling=greedy(2, prompt_logprobs=2)),
                                   timeout=120))[0]
    p = first.prompt_logprobs
    return list(p.token_ids), list(p.logprobs), [list(t.logprobs) for t in p.top]


def test_tp2_equals_tp1_and_hf_in_tokens_and_logprobs_and_every_rank_runs_the_named_backend(ckpts):
    from transformers import AutoTokenizer

    model_dir = tiny.ensure("qwen2", ckpts)
    tok = AutoTokenizer.from_pretrained(model_dir)
    runs, choices, scored = {}, {}, {}
    for tp in (1, 2):
        llm = LLM(model_dir, "--tensor-parallel-size", str(tp), "--max-batch-tokens", "16", "--max-num-seqs", "16",
                  "--attention-backend", "llm=sdpa_math")
        try:
            runs[tp] = _generate_all(llm, 10)
            scored[tp] = _prompt_scores(llm, PROMPTS[0] * 5)  # prompt chunks of 16 tokens, scored on every rank
            info = llm.stub.Info(pb.InfoRequest(), timeout=10)
            choices[tp] = sorted((c.rank, c.component, c.backend) for c in info.attention)
            assert info.extra["tensor_parallel_size"] == str(tp)
            assert info.pools[0].used_tokens == 0
        finally:
            llm.close()
    # Each rank builds its own selector from the config and reports what it chose.
    assert choices[1] == [(0, "llm", "sdpa_math")]
    assert choices[2] == [(0, "llm", "sdpa_math"), (1, "llm", "sdpa_math")]
    for prompt, (ids1, lps1), (ids2, lps2) in zip(PROMPTS, runs[1], runs[2]):
        prompt_ids = tok(prompt)["input_ids"]
        assert ids2 == ids1 and len(set(ids1)) > 3
        assert len(lps2) == len(ids2)
        want = _hf_logprobs(model_dir, prompt_ids, ids1)
        assert max(abs(a - b) for a, b in zip(lps1, want)) < 1e-4
        assert max(abs(a - b) for a, b in zip(lps2, want)) < 1e-4
    # Prompt logprobs through the service: the prompt's tokens scored as HF scores them, alike at TP 1 and 2.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(PROMPTS[0] * 5)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    for tp in (1, 2):
        got_ids, values, tops = scored[tp]
        assert got_ids == ids and len(ids) > 32
        torch.testing.assert_close(torch.tensor(values), ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(tops), ref.topk(2).values, atol=1e-4, rtol=0)


def spawned(proc):
    """The service's multiprocessing spawn processes (not resource trackers): its engine process, then its ranks."""
    return [pid for pid in proc.pids()[1:] if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _gone(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited, not yet reaped by its (dead) parent's reaper
            return True
        time.sleep(0.1)
    return False


def test_tp2_sigterm_mid_stream_drains_the_stream_and_exits_0_with_its_ranks(ckpts):
    model_dir = tiny.ensure("qwen2", ckpts)
    llm = LLM(model_dir, "--tensor-parallel-size", "2")
    pids = spawned(llm.proc)
    assert len(pids) == 2  # the engine process (rank 0) and rank 1
    got, first = [], threading.Event()

    def stream():
        for r in llm.stub.Generate(pb.GenerateRequest(text="Hello", sampling=greedy(
                150, ignore_eos=True)), timeout=120):
            got.append(r)
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    llm.proc.send_sigterm()
    t.join(120)
    assert sum(len(r.token_ids) for r in got) == 150 and got[-1].finish_reason == pb.LENGTH
    llm.channel.close()
    assert llm.proc.proc.wait(timeout=60) == 0
    assert all(_gone(pid, 10) for pid in pids)


def test_ranks_never_outlive_rank_0(ckpts):
    model_dir = tiny.ensure("qwen2", ckpts)
    llm = LLM(model_dir, "--tensor-parallel-size", "2")
    try:
        pids = spawned(llm.proc)
        assert len(pids) == 2  # the engine process (rank 0) and rank 1
        os.kill(llm.proc.proc.pid, signal.SIGKILL)
        llm.proc.proc.wait(timeout=30)
        assert all(_gone(pid, 10) for pid in pids), "the engine process or rank 1 outlived the service"
    finally:
        llm.channel.close()


# ---- the step message -------------------------------------------------------------------------------
def _steps():
    g = torch.Generator().manual_seed(0)
    long = 9000  # past one broadcast's capacity: the rest goes in a second
    return [
        StepInputs(input_ids=torch.randint(0, 500, (5,), generator=g), positions=torch.arange(5),
                   query_lens=(2, 3), context_lens=(2, 40), block_table=torch.tensor([[4, 0, 0], [1, 2, 3]]),
                   sample_rows=torch.tensor([1, 4])),
        StepInputs(input_ids=torch.randint(0, 500, (long,), generator=g),
                   positions=torch.arange(long).expand(3, -1) + torch.tensor([[0], [1], [2]]),
                   query_lens=(long,), context_lens=(long,), block_table=torch.arange(600)[None],
                   sample_rows=torch.tensor([], dtype=torch.int64), has_embeds=True),
        StepInputs(input_ids=torch.tensor([7, 8, 0, 0]), positions=torch.tensor([3, 9, 0, 0]),
                   query_lens=(1, 1, 1, 1), context_lens=(4, 10, 0, 0),
                   block_table=torch.tensor([[5], [6], [0], [0]]), sample_rows=torch.arange(2),
                   slot_mapping=torch.tensor([83, 105, 16, 16]), graph_batch=4),
        # a mixed step padded to a token bucket of 8: a decode row, a 4-token prompt, padding
        StepInputs(input_ids=torch.tensor([3, 4, 5, 6, 7, 0, 0, 0]), positions=torch.tensor([9, 0, 1, 2, 3, 0, 0, 0]),
                   query_lens=(1, 4), context_lens=(10, 4), block_table=torch.tensor([[2], [3]]),
                   sample_rows=torch.tensor([0, 4]), slot_mapping=torch.tensor([41, 48, 49, 50, 51, 16, 16, 16]),
                   graph_tokens=8, token_seq=torch.tensor([0, 1, 1, 1, 1, 0, 0, 0]),
                   token_ctx=torch.tensor([10, 1, 2, 3, 4, 0, 0, 0])),
        # prompt logprobs: rows 0-4 of a 6-token prompt score tokens 1-5, with 3 alternatives each
        StepInputs(input_ids=torch.tensor([11, 12, 13, 14, 15, 16]), positions=torch.arange(6), query_lens=(6,),
                   context_lens=(6,), block_table=torch.tensor([[1, 2]]), sample_rows=torch.tensor([5]),
                   scored_rows=torch.arange(5), scored_targets=torch.tensor([12, 13, 14, 15, 16]), scored_top=3),
        # ids not known on the host yet: rows 0 and 2 of the previous step's 3 sampled tokens
        StepInputs(input_ids=torch.tensor([-1, 8, -1]), positions=torch.tensor([3, 9, 4]),
                   query_lens=(1, 1, 1), context_lens=(4, 10, 5), block_table=torch.tensor([[5], [6], [7]]),
                   sample_rows=torch.arange(3), carry=torch.tensor([0, -1, 2]), previous_samples=3),
    ]


def _fields(s: StepInputs):
    return {f.name: (getattr(s, f.name).tolist() if isinstance(getattr(s, f.name), torch.Tensor)
                     else getattr(s, f.name))
            for f in dataclasses.fields(s) if f.name not in ("splices", "context_lens_t")}


def _exchange(rank, world_size):
    channel = StepChannel(torch.device("cpu"), world_size)
    for want in _steps():
        got = channel.publish(want) if rank == 0 else channel.receive()
        assert _fields(got) == _fields(want)
        assert got.context_lens_t.tolist() == list(want.context_lens)
    if rank == 0:
        channel.publish_stop()
    else:
        assert channel.receive() is None


def test_step_inputs_reach_every_rank_whole_in_one_message_or_two():
    distributed.launch(2, _exchange, backend="gloo")


def _carry(rank, world_size):
    """Step N's sampled tokens reach every rank from rank 0's device tensor, in place of the placeholders."""
    channel = StepChannel(torch.device("cpu"), world_size)
    step = _steps()[-1]
    got = channel.publish(step) if rank == 0 else channel.receive()
    previous = channel.share_tokens(torch.tensor([71, 72, 73]) if rank == 0 else None, got.previous_samples)
    assert got.with_carried_ids(previous).input_ids.tolist() == [71, 8, 73]
    if rank == 0:
        channel.publish_stop()
    else:
        assert channel.receive() is None


def test_tokens_not_yet_on_the_host_are_carried_into_the_next_step_on_every_rank():
    distributed.launch(2, _carry, backend="gloo")


def test_step_inputs_round_trip_at_tp1():
    channel = StepChannel(torch.device("cpu"), 1)
    for want in _steps():
        assert _fields(channel.publish(want)) == _fields(want)


# ---- the config ----------------------------------------------------------------------------------------
def _args(**kw):
    base = dict(tensor_parallel_size=1, max_model_len=None, kv_cache_tokens=None, dummy_weights=False,
                attention_backend=None, page_size=16, mem_fraction=0.9, max_num_seqs=8, max_batch_tokens=64,
                max_prefill_chunk=None, max_queue=4, enforce_eager=False, max_graph_tokens=2048, no_fused_kernels=False,
                vision_encoder=None, audio_encoder=None,
                encoder_timeout=5.0, allow_foreign_encoders=False, encoder_shared_memory="off", max_message_mb=8,
                max_stop_strings=64, max_stop_string_chars=1024, max_stop_token_ids=256, max_items_per_request=64,
                log_level="INFO", switch_interval_ms=None)
    return argparse.Namespace(**{**base, **kw})


def test_config_is_built_once_from_the_flags_and_replaced_per_rank(ckpts):
    model_dir = tiny.ensure("qwen2", ckpts)
    config = LLMConfig.from_args(_args(attention_backend="llm=sdpa_math", tensor_parallel_size=2), model_dir,
                                 device=torch.device("cpu"), dtype=torch.float32)
    assert config.max_model_len == 512  # the tiny checkpoint's max_position_embeddings
    assert config.kv_cache_tokens >= config.max_model_len  # a CPU pool gets a fixed size, not free RAM
    assert config.attention_backend == "llm=sdpa_math" and not config.encoders.shared_memory
    rank1 = dataclasses.replace(config, rank=1)
    assert rank1.rank == 1 and rank1.attention_backend == config.attention_backend
    assert dataclasses.replace(config, device_type="cuda", rank=1).device == torch.device("cuda", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 1
    with pytest.raises(ConfigError, match="rank 2 outside a group of 2"):
        dataclasses.replace(config, rank=2)
    with pytest.raises(ConfigError, match="--max-num-seqs 0"):
        LLMConfig.from_args(_args(max_num_seqs=0), model_dir, device=torch.device("cpu"), dtype=torch.float32)
    assert LLMConfig.from_args(_args(max_graph_tokens=512), model_dir, device=torch.device("cpu"),
                               dtype=torch.float32).max_graph_tokens == 512
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    for name in ("max_graph_tokens", "max_batch_tokens", "max_num_seqs", "page_size"):  # one default each
        assert getattr(defaults, name) == getattr(LLMConfig, name), name
    # The budget is 1,024 by default: sequence slots past it could never all decode in one step.
    with pytest.raises(ConfigError, match="--max-batch-tokens 1024 is below --max-num-seqs 2048"):
        LLMConfig.from_args(_args(max_num_seqs=2048, max_batch_tokens=1024), model_dir, device=torch.device("cpu"),
                            dtype=torch.float32)
    assert LLMConfig.from_args(_args(max_num_seqs=64, max_batch_tokens=64), model_dir, device=torch.device("cpu"),
                               dtype=torch.float32).max_num_seqs == 64
    with pytest.raises(ConfigError, match="--max-graph-tokens -1"):
        LLMConfig.from_args(_args(max_graph_tokens=-1), model_dir, device=torch.device("cpu"), dtype=torch.float32)


def test_mixed_graph_buckets_end_at_the_graph_token_limit():
    from services.llm.graphs import token_buckets

    assert token_buckets(24) == [16, 24]
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    assert token_buckets(2048)[-4:] == [768, 1024, 1536, 2048]
    assert token_buckets(1800)[-3:] == [1024, 1536, 1800]


def test_the_engine_process_takes_its_gil_switch_interval_from_the_flag(ckpts):
    import sys

    from modalmesh.interpreter import set_switch_interval

    model_dir = tiny.ensure("qwen2", ckpts)
    build = lambda **kw: LLMConfig.from_args(_args(**kw), model_dir, device=torch.device("cpu"),  # noqa: E731
                                             dtype=torch.float32)
    assert build().switch_interval_s is None
    config = build(switch_interval_ms=0.25)
    assert config.switch_interval_s == pytest.approx(0.25e-3)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--switch-interval-ms"):
            build(switch_interval_ms=bad)
    before = sys.getswitchinterval()
    try:
        set_switch_interval(build().switch_interval_s)
        assert sys.getswitchinterval() == before  # None leaves Python's own
        set_switch_interval(config.switch_interval_s)
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    finally:
        sys.setswitchinterval(before)


def test_a_bad_tensor_parallel_size_fails_start_up(ckpts):
    from modalmesh.ops.launcher import ServiceProcess

    model_dir = tiny.ensure("qwen2", ckpts)
    proc = ServiceProcess("llm", ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--device", "cpu",
                                  "--model", str(model_dir), "--tensor-parallel-size", "0"]).start()
    assert proc.proc.wait(timeout=60) == 2
