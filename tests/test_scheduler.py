"""The continuous-batching scheduler over the real page allocator (no model: tokens are fake)."""

import random

from modalmesh.kv.allocator import PageAllocator
from services.llm.scheduler import Scheduler, Sequence, SeqStatus


def _run_step(sched, next_token=lambda seq: 7):
    step = sched.schedule()
    sampled = {c.seq.seq_id: next_token(c.seq) for c in step.chunks if c.sample}
    seqs = {c.seq.seq_id: c.seq for c in step.chunks}
    for seq_id, index in sched.advance(step).items():
        sched.fill(seqs[seq_id], index, sampled[seq_id])
    for seq in list(sched.running):
        if len(seq.output_ids) >= seq.max_tokens:
            sched.finish(seq, "length")
    return step


def test_budget_splits_prefill_into_chunks_and_decodes_join_between_steps():
    sched = Scheduler(PageAllocator(num_pages=64, page_size=4), max_batch_tokens=32)
    a, b, c = Sequence("a", [1] * 10, 3), Sequence("b", [1] * 20, 3), Sequence("c", [1] * 50, 3)
    for s in (a, b, c):
        sched.add(s)
    step = _run_step(sched)
    assert [(ch.seq.seq_id, ch.start, ch.length, ch.sample) for ch in step.chunks] == [
        ("a", 0, 10, True), ("b", 0, 20, True), ("c", 0, 2, False)]
    step = _run_step(sched)
    # a and b decode one token each; c continues its prompt with the rest of the budget.
    assert [(ch.seq.seq_id, ch.start, ch.length) for ch in step.chunks] == [("a", 10, 1), ("b", 20, 1), ("c", 2, 30)]
    step = _run_step(sched)
    assert [(ch.seq.seq_id, ch.start, ch.length, ch.sample) for ch in step.chunks] == [
        ("a", 11, 1, True), ("b", 21, 1, True), ("c", 32, 18, True)]
    assert a.status is SeqStatus.FINISHED and len(a.output_ids) == 3
    assert c.output_ids == [7]


def test_max_prefill_chunk_caps_one_sequence():
    sched = Scheduler(PageAllocator(num_pages=64, page_size=4), max_batch_tokens=64, max_prefill_chunk=16)
    sched.add(Sequence("long", [1] * 40, 1))
    sched.add(Sequence("short", [1] * 5, 1))
    step = sched.schedule()
    assert [(c.seq.seq_id, c.length) for c in step.chunks] == [("long", 16), ("short", 5)]


def test_full_pool_makes_new_work_wait_then_admits_it_when_pages_free():
    alloc = PageAllocator(num_pages=4, page_size=4)  # 16 tokens
    sched = Scheduler(alloc, max_batch_tokens=64)
    first, second = Sequence("first", [1] * 12, 2), Sequence("second", [1] * 8, 2)
    sched.add(first)
    sched.add(second)
    step = _run_step(sched)
    assert [c.seq.seq_id for c in step.chunks] == ["first"]
    assert second.status is SeqStatus.WAITING
    while first.status is not SeqStatus.FINISHED:
        _run_step(sched)
    assert alloc.num_free_pages == 4
    _run_step(sched)
    assert second.status is SeqStatus.RUNNING


def test_youngest_is_preempted_when_decode_needs_a_page_and_recomputed_later():
    alloc = PageAllocator(num_pages=4, page_size=4)
    sched = Scheduler(alloc, max_batch_tokens=64)
    old, young = Sequence("old", [1] * 7, 6), Sequence("young", [2] * 7, 6)
    sched.add(old)
    sched.add(young)
    preempted = []
    for _ in range(40):
        if not sched.has_work():
            break
        step = _run_step(sched, next_token=lambda s: len(s.output_ids) + 100)
        preempted += [s.seq_id for s in step.preempted]
        assert alloc.num_used_pages <= alloc.num_pages
    assert preempted and set(preempted) == {"young"}
    assert young.num_preemptions >= 1
    # Recomputation does not change the tokens a sequence gets.
    assert old.output_ids == young.output_ids == [100, 101, 102, 103, 104, 105]
    assert alloc.num_free_pages == 4 and alloc.used_tokens == 0


def test_finish_and_abort_free_every_page():
    alloc = PageAllocator(num_pages=8, page_size=4)
    sched = Scheduler(alloc, max_batch_tokens=16)
    seqs = [Sequence(i, [1] * 9, 10) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _run_step(sched)  # 0 prefilled, 1 partially, 2 waiting
    assert seqs[1].status is SeqStatus.RUNNING and seqs[2].status is SeqStatus.WAITING
    for s in seqs:
        sched.finish(s, "abort")
    assert alloc.num_free_pages == 8 and alloc.used_tokens == 0 and not sched.has_work()
    sched.finish(seqs[0], "abort")  # idempotent


def test_random_traffic_keeps_invariants_and_finishes_everything():
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=24, page_size=4)  # 96 tokens
    sched = Scheduler(alloc, max_num_seqs=5, max_batch_tokens=24, max_prefill_chunk=10)
    seqs = [Sequence(i, [rng.randrange(50)] * rng.randrange(1, 40), rng.randrange(1, 30)) for i in range(30)]
    pending = list(seqs)
    for step_no in range(2000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop(0))
        if not sched.has_work() and not pending:
            break
        step = _run_step(sched, next_token=lambda s: len(s.output_ids))
        assert step.num_tokens <= 24
        assert len(sched.running) <= 5
        held = sum(alloc.pages_for(alloc.num_tokens(s.seq_id)) for s in sched.running if s.seq_id in alloc)
        assert held == alloc.num_used_pages  # no page leaks
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    assert all(s.output_ids == list(range(s.max_tokens)) for s in seqs)
    assert alloc.num_free_pages == 24
