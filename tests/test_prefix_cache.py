"""Prefix caching: pages shared by content (allocator), their keys, the scheduler starting from them, and
the engine's answers with the cache on equal to the cache off and to HF on a tiny model (FP32, CPU)."""

import queue
import random

import pytest
import torch

from modalmesh.errors import InvalidArgument
from modalmesh.kv.allocator import PageAllocator
from modalmesh.kv.page_keys import ROOT, ItemRows, chain, extend_keys
from modalmesh.metrics import Metrics
from modalmesh.testing import tiny
from services.llm.scheduler import PENDING, Scheduler, Sequence, SeqStatus


def _keys(tokens, page_size, items=()):
    return extend_keys([], lambda a, b: tokens[a:b], page_size, len(tokens), items)


# ---- keys ------------------------------------------------------------------------------------------
def test_a_page_key_names_its_tokens_its_parent_and_the_items_behind_its_placeholders():
    a = _keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == _keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)  # the partial page has no key
    assert a[1] == chain(a[0], [5, 6, 7, 8], (), 4) and a[0] == chain(ROOT, [1, 2, 3, 4])
    b = _keys([1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]  # same second page, other parent
    # The same placeholder ids, two different images: no page in common from the image's first row on.
    img = [1, 9, 9, 9, 9, 9, 9, 2]
    one, other = ItemRows(1, 7, b"image-one"), ItemRows(1, 7, b"image-two")
    k1, k2 = _keys(img, 4, [one]), _keys(img, 4, [other])
    assert k1[0] != k2[0] and k1[1] != k2[1]
    assert _keys(img, 4, [one]) == k1
    assert _keys(img, 4, [ItemRows(2, 8, b"image-one")]) != k1  # the same image one token later
    # A page of text after an image still depends on the image (its parent).
    tail = [1, 9, 9, 3, 4, 5, 6, 7]
    assert _keys(tail, 4, [ItemRows(1, 3, b"x")])[1] != _keys(tail, 4, [ItemRows(1, 3, b"y")])[1]
    # A token not sampled yet stops the keys.
    assert len(extend_keys([], lambda s, e: [1, 2, 3, 4, 5, PENDING, 7, 8][s:e], 4, 8, unknown=PENDING)) == 1


# ---- allocator -------------------------------------------------------------------------------------
def test_cached_pages_are_shared_by_count_and_evicted_oldest_first_only_when_nobody_holds_them():
    alloc = PageAllocator(num_pages=6, page_size=4)
    ka, kb = _keys(list(range(12)), 4), _keys([50] * 8, 4)
    assert alloc.allocate("a", 12)
    alloc.cache("a", ka)
    alloc.check()
    assert alloc.match(ka) == alloc.pages("a") and alloc.num_cached_pages == 3
    # b shares a's first two pages and adds one of its own.
    assert alloc.allocate("b", 10, cached=alloc.match(ka[:2]))
    assert alloc.pages("b")[:2] == alloc.pages("a")[:2]
    assert alloc.used_tokens == 12 + 2 and alloc.num_free_pages == 2
    alloc.check()
    with pytest.raises(InvalidArgument):
        alloc.allocate("c", 4, cached=alloc.match(ka[:2]))  # more cached tokens than asked for
    alloc.free("a")  # a's third page: cached, nobody holds it; the first two stay b's
    alloc.check()
    assert alloc.used_tokens == 10 and alloc.num_free_pages == 3 and len(alloc.match(ka)) == 3
    alloc.free("b")
    alloc.check()
    assert alloc.used_tokens == 0 and alloc.num_free_pages == 6 and len(alloc.match(ka)) == 3
    # New pages come from the free list first, then from the cached pages freed longest ago. a freed its
    # pages tail first (the third before the first two), so its prefix outlives its tail.
    assert alloc.allocate("d", 8)
    alloc.cache("d", kb)
    assert alloc.allocate("e", 4)  # the last plain free page (b's own)
    assert len(alloc.match(ka)) == 3
    assert alloc.allocate("f", 4)  # a cached page goes: a's third
    assert len(alloc.match(ka)) == 2
    alloc.check()
    # A held cached page is never evicted: d holds kb's pages; only a's first two are idle.
    assert not alloc.allocate("g", 12)
    assert alloc.match(kb) == alloc.pages("d") and len(alloc.match(ka)) == 2
    alloc.check()


def test_a_failed_step_takes_only_its_own_pages_out_of_the_cache():
    alloc = PageAllocator(num_pages=8, page_size=4)
    keys = _keys(list(range(16)), 4)
    assert alloc.allocate("first", 8)
    alloc.cache("first", keys[:2])
    assert alloc.allocate("second", 16, cached=alloc.match(keys))
    alloc.cache("second", keys)
    alloc.forget("second")  # its step failed: its own two pages leave the cache, the shared ones stay
    alloc.free("second")
    alloc.check()
    assert len(alloc.match(keys)) == 2


# ---- scheduler -------------------------------------------------------------------------------------
def _step(sched, token=lambda seq: 7):
    """Schedule, advance, fill every pending token at once (no step in flight)."""
    step = sched.schedule()
    seqs = {c.seq.seq_id: c.seq for c in step.chunks}
    for seq_id, index in sched.advance(step).items():
        sched.fill(seqs[seq_id], index, token(seqs[seq_id]))
    for seq in list(sched.running):
        if len(seq.output_ids) >= seq.max_tokens:
            sched.finish(seq, "length")
    return step


def test_a_newcomer_starts_from_the_cached_prefix_and_always_computes_its_last_token():
    alloc = PageAllocator(num_pages=64, page_size=4)
    sched = Scheduler(alloc, max_batch_tokens=64, prefix_caching=True)
    system = list(range(100, 114))  # 14 tokens: 3 full pages
    first = Sequence("first", system + [1, 2], 3)
    sched.add(first)
    while first.status is not SeqStatus.FINISHED:
        _step(sched)
    assert first.num_cached == 0
    second = Sequence("second", system + [5, 6, 7], 2)
    sched.add(second)
    step = _step(sched)
    (chunk,) = step.chunks
    assert (chunk.start, chunk.length) == (12, 5) and second.num_cached == 12
    assert (step.cache_queries, step.cache_hits) == (17, 12)
    while second.status is not SeqStatus.FINISHED:
        _step(sched)
    # The whole prompt cached (16 tokens = 4 full pages): its last page is recomputed for the logits.
    again = Sequence("again", system + [1, 2], 1)
    sched.add(again)
    (chunk,) = _step(sched).chunks
    assert (chunk.start, chunk.length, chunk.sample) == (12, 4, True)
    # Off: the same prompt is computed whole.
    off = Scheduler(PageAllocator(num_pages=64, page_size=4), prefix_caching=False)
    off.add(Sequence("x", system + [1, 2], 1))
    assert off.schedule().chunks[0].start == 0
    alloc.check()


def test_generated_pages_enter_the_cache_once_their_tokens_are_read_back():
    alloc = PageAllocator(num_pages=64, page_size=4)
    sched = Scheduler(alloc, max_batch_tokens=64, prefix_caching=True)
    seq = Sequence("s", [1, 2, 3, 4, 5, 6], 10)
    sched.add(seq)
    sched.advance(sched.schedule())  # prompt computed, one token pending
    assert seq.cached_pages == 1
    # The engine schedules the next step before the pending token is read back: positions 6 and 7 are
    # computed but 7's... token 6 is still PENDING, so page 1 (tokens 4..7) cannot be keyed yet.
    sched.advance(sched.schedule())
    assert seq.output_ids == [PENDING, PENDING] and seq.cached_pages == 1
    sched.fill(seq, 0, 40)
    sched.advance(sched.schedule())  # tokens 0..7 computed and known, 8 is pending
    assert seq.cached_pages == 1  # token 7 (output 1) still pending
    sched.fill(seq, 1, 41)
    sched.advance(sched.schedule())
    assert seq.cached_pages == 2
    assert alloc.match(_keys([1, 2, 3, 4, 5, 6, 40, 41], 4)) == alloc.pages("s")[:2]
    alloc.check()


def test_siblings_scheduled_together_wait_one_step_and_share_the_prompt_pages():
    alloc = PageAllocator(num_pages=64, page_size=4)
    sched = Scheduler(alloc, max_batch_tokens=64, prefix_caching=True)
    prompt = list(range(30, 50))  # 20 tokens
    seqs = [Sequence(f"c{i}", list(prompt), 5) for i in range(3)]
    other = Sequence("other", [1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    for s in seqs + [other]:
        sched.add(s)
    step = _step(sched)
    assert [(c.seq.seq_id, c.start) for c in step.chunks] == [("c0", 0), ("other", 0)]  # FCFS otherwise
    step = _step(sched)
    assert [(c.seq.seq_id, c.start, c.length) for c in step.chunks if c.seq.seq_id in ("c1", "c2")] == [
        ("c1", 16, 4), ("c2", 16, 4)]
    assert alloc.pages("c1")[:4] == alloc.pages("c2")[:4] == alloc.pages("c0")[:4]
    alloc.check()


def test_a_preempted_sequence_starts_again_from_its_own_cached_pages():
    alloc = PageAllocator(num_pages=6, page_size=4)  # 24 tokens for 16 + 17: one must make room
    sched = Scheduler(alloc, max_batch_tokens=64, prefix_caching=True)
    old, young = Sequence("old", [1] * 8, 8), Sequence("young", [2] * 9, 8)
    sched.add(old)
    sched.add(young)
    again = None
    while sched.has_work():
        step = _step(sched)
        alloc.check()
        for chunk in step.chunks:
            if chunk.seq is young and young.num_preemptions and again is None:
                again = chunk
    assert again is not None and again.start > 0  # its first pages were still cached
    assert young.num_cached == 0  # usage counts its first admission only
    assert old.status is young.status is SeqStatus.FINISHED and len(young.output_ids) == 8


def test_random_traffic_with_shared_prefixes_keeps_every_invariant():
    rng = random.Random(1)
    alloc = PageAllocator(num_pages=24, page_size=4)
    sched = Scheduler(alloc, max_num_seqs=6, max_batch_tokens=40, prefix_caching=True)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live = []
    for i in range(160):
        if rng.random() < 0.3 and len(live) < 10:
            seq = Sequence(i, rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 8))],
                           rng.randrange(1, 12))
            sched.add(seq)
            live.append(seq)
        if sched.has_work():
            _step(sched, token=lambda s: rng.randrange(1000))
        if live and rng.random() < 0.05:
            sched.finish(live.pop(rng.randrange(len(live))), "abort")
        alloc.check()
    while sched.has_work():
        _step(sched)
        alloc.check()
    assert alloc.used_tokens == 0 and alloc.num_free_pages == alloc.num_pages


# ---- the engine on a tiny model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return tiny.ensure("qwen2", tmp_path_factory.mktemp("prefix"))


def _engine(path, *, prefix_caching, kv_cache_tokens=1024, page_size=4):
    from transformers import AutoTokenizer

    from services.llm.config import LLMConfig
    from services.llm.engine import LLMEngine
    from services.llm.runner import ModelRunner

    metrics = Metrics("llm", process_metrics=False)
    config = LLMConfig(model_dir=path, device_type="cpu", max_model_len=128, kv_cache_tokens=kv_cache_tokens,
                       page_size=page_size, max_batch_tokens=32, max_num_seqs=4, dtype=torch.float32,
                       prefix_caching=prefix_caching)
    engine = LLMEngine(ModelRunner(config, metrics), AutoTokenizer.from_pretrained(path), eos_token_ids=(),
                       metrics=metrics)
    engine.start()
    return engine


def _add(engine, rid, prompt, n):
    from services.llm.inputs import PreparedPrompt
    from services.llm.sampling import SamplingParams

    out = queue.Queue()
    engine.add(rid, PreparedPrompt(list(prompt)),
               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1), out.put)
    return out


def _collect(out):
    ids, lps, last = [], [], None
    while True:
        d = out.get(timeout=120)
        assert d.error is None, d.error
        ids += d.token_ids
        lps += d.logprobs
        if d.finish_reason:
            return ids, lps, d


def _hf_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_shared_prefixes_give_the_tokens_and_logprobs_of_the_cache_off_and_of_hf(qwen2):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(qwen2).eval()
    system = [(7 * i + 3) % 400 + 10 for i in range(23)]
    prompts = [system + [5, 77, 301], system + [12, 9], system + [5, 77, 301], system[:10] + [44, 45, 46]]
    results = {}
    for caching in (True, False):
        engine = _engine(qwen2, prefix_caching=caching)
        try:
            # One after another: each finds what the ones before left in the cache.
            results[caching] = [_collect(_add(engine, f"r{i}", p, 8)) for i, p in enumerate(prompts)]
            value = engine.metrics.registry.get_sample_value
            hits = value("modalmesh_prefix_cache_hits_total", {"service": "llm", "model_name": ""}) or 0
            queries = value("modalmesh_prefix_cache_queries_total", {"service": "llm", "model_name": ""}) or 0
        finally:
            engine.stop()
        if caching:
            assert [last.cached_tokens for _, _, last in results[True]] == [0, 20, 24, 8]
            assert hits == 52 and queries == sum(len(p) for p in prompts)
        else:
            assert [last.cached_tokens for _, _, last in results[False]] == [0, 0, 0, 0] and hits == 0
    for prompt, (ids, lps, _), (ids_off, lps_off, _) in zip(prompts, results[True], results[False]):
        assert ids == ids_off and len(set(ids)) > 2
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_off), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(lps), _hf_logprobs(ref, prompt, ids), atol=1e-4, rtol=0)
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):]
        assert ids == want.tolist()


def test_eviction_under_a_small_pool_never_corrupts_an_answer(qwen2):
    rng = random.Random(3)
    prefixes = [[rng.randrange(10, 400) for _ in range(rng.randrange(6, 30))] for _ in range(4)]
    prompts = [rng.choice(prefixes)[:rng.randrange(4, 31)] + [rng.randrange(10, 400)
                                                                for _ in range(rng.randrange(1, 6))]
               for _ in range(14)]
    lengths = [rng.randrange(3, 10) for _ in prompts]
    results = {}
    for caching in (True, False):
        # 160 token slots (40 pages of 4) for four running sequences of up to 44 tokens each, and the cache:
        # pages are evicted and sequences preempted all along.
        engine = _engine(qwen2, prefix_caching=caching, kv_cache_tokens=160)
        try:
            got = []
            for start in range(0, len(prompts), 5):  # bursts: concurrent requests, some sharing a step
                outs = [_add(engine, f"r{i}", prompts[i], lengths[i]) for i in range(start, min(start + 5,
                                                                                                len(prompts)))]
                got += [_collect(o) for o in outs]
            engine.pool.allocator.check()
            assert engine.pool.allocator.used_tokens == 0
            if caching:
                assert engine.pool.allocator.num_cached_pages > 0
                assert sum(last.cached_tokens for _, _, last in got) > 0
        finally:
            engine.stop()
        results[caching] = got
    for (ids, lps, _), (ids_off, lps_off, _) in zip(results[True], results[False]):
        assert ids == ids_off
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps_off), atol=1e-5, rtol=0)
