"""The LLM's two processes: the link between its gRPC edge and its engine process, and what crosses it.

- frames cross whole, in order, from the engine thread and the event loop at once; a closed end reads None;
- errors keep their gRPC status across the process boundary;
- the engine hands one step's deltas for every call to the sink in one `deliver` (one frame a step), and
  the edge's message of a choice equals what the engine emitted, rows merged when they pile up;
- the service: the engine process is a child of the edge, and if it dies while serving the edge exits 1.
"""

import asyncio
import os
import signal
import struct
import threading
import time

import grpc
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from modalmesh import pb
from modalmesh.errors import InvalidArgument, ResourceExhausted
from modalmesh.metrics import Metrics
from modalmesh.testing import tiny
from services.llm.core import LinkSink
from services.llm.engine import LLMEngine, SinkEmitter
from services.llm.inputs import PreparedPrompt
from services.llm.link import (MESSAGES, CallFailed, FrameReader, FrameSender, GenerateCall, StepDeltas, _FrameProtocol,
                               decode, encode, error_info, raise_error, socket_pair)
from services.llm.request import Delta
from services.llm.sampling import SamplingParams
from services.llm.server import _response
from tests.test_llm_engine import ScriptedRunner
from tests.test_llm_tp import spawned


def test_frames_cross_whole_and_in_order_from_two_threads_and_a_closed_end_reads_none():
    edge, engine = socket_pair()
    sender = FrameSender(engine)
    big = bytes(range(256)) * 40_000  # 10 MB: past the socket buffers, so the sender blocks on the reader
    big_call = GenerateCall(9, big, 1.5, (("x-request-id", "r1"),), 12.5)

    def engine_thread():
        for i in range(200):
            sender.send(StepDeltas([(i, 0, [i], str(i), [], None, None)]))

    async def main():
        reader = await FrameReader.open(edge)
        threads = [threading.Thread(target=engine_thread),  # and a large one meanwhile: frames interleave, never mix
                   threading.Thread(target=sender.send, args=(big_call,))]
        for t in threads:
            t.start()
        got = [await reader.recv() for _ in range(201)]
        for t in threads:
            t.join()
        sender.close()
        return got, await reader.recv()

    got, after_close = asyncio.run(main())
    steps = [m.rows[0][0] for m in got if isinstance(m, StepDeltas)]
    assert steps == list(range(200))
    assert [m for m in got if not isinstance(m, StepDeltas)] == [big_call]
    assert got[0].rows[0][3] == "0" and isinstance(got[0].rows[0][2][0], int)  # fields come back as they went
    assert after_close is None
    assert sender.send(StepDeltas([])) is False  # a send after the close is dropped, not raised


class _Transport:
    """What `_FrameProtocol` calls of its transport: pause and resume, recorded."""

    def __init__(self):
        self.paused = False
        self.pauses = 0

    def pause_reading(self):
        assert not self.paused
        self.paused, self.pauses = True, self.pauses + 1

    def resume_reading(self):
        assert self.paused
        self.paused = False


def _feed(protocol, data: bytes, cuts) -> None:
    """`data` into `protocol` as a transport's recv_into would: at most what each read (from `cuts`) and the
    buffer `get_buffer` lent allow."""
    at, cuts = 0, iter(cuts)
    while at < len(data):
        buf = protocol.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), len(data) - at, next(cuts, len(data)))
        buf[:n] = data[at:at + n]
        protocol.buffer_updated(n)
        at += n


_SHARED = _FrameProtocol._SHARED_BYTES
_SIZES = st.one_of(st.integers(0, 40), st.integers(_SHARED - 16, _SHARED + 16), st.integers(0, 3 * _SHARED))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(_SIZES, min_size=1, max_size=8), cuts=st.lists(st.integers(1, 600_000), max_size=40),
       seed=st.integers(0, 255))
# The edges, every run: a header split across the shared buffer's end, a large frame's header the last thing read
# (none of its body yet), a frame that just fits the shared buffer and one a byte past it, an empty last frame.
@example(sizes=[_SHARED - 13, 40], cuts=[_SHARED - 5, 3], seed=0)
@example(sizes=[10, 2 * _SHARED], cuts=[26], seed=1)
@example(sizes=[_SHARED - 8, _SHARED - 7, 0], cuts=[], seed=2)
def test_frames_come_out_whole_however_the_reads_cut_them(sizes, cuts, seed):
    """The reader's own buffer handling against the frames sent: small frames many to a read, a frame cut
    anywhere (its header too), frames larger than the shared buffer read into their own, an empty one."""
    payloads = [bytes((seed + i + j) % 251 for j in range(size)) for i, size in enumerate(sizes)]
    data = b"".join(struct.pack("<Q", len(p)) + p for p in payloads)
    protocol = _FrameProtocol()
    protocol.connection_made(_Transport())
    _feed(protocol, data, cuts)
    protocol.eof_received()

    async def drain():
        return [bytes(p) async for p in _payloads(protocol)]

    assert asyncio.run(drain()) == payloads


async def _payloads(protocol):
    while (payload := await protocol.next_payload()) is not None:
        yield payload


@pytest.mark.parametrize("end", ["reset", "eof"])
@pytest.mark.parametrize("partial", [40, 2 * _FrameProtocol._SHARED_BYTES])
def test_the_other_end_gone_mid_frame_wakes_the_waiting_reader_with_none(end, partial):
    """A reset (no EOF) or an EOF while `recv` waits, part of a small or a large frame read: the waiter ends with
    None, not a hang, and the part is never handed out as a frame."""
    protocol = _FrameProtocol()
    protocol.connection_made(_Transport())

    async def main():
        waiting = asyncio.ensure_future(protocol.next_payload())
        _feed(protocol, struct.pack("<Q", 2 * partial) + bytes(partial), [])
        await asyncio.sleep(0)
        assert not waiting.done()
        if end == "reset":
            protocol.connection_lost(ConnectionResetError())
        else:
            protocol.eof_received()
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(main()) is None


def test_reading_pauses_while_unread_frames_pile_up_and_resumes_once_taken():
    transport = _Transport()
    protocol = _FrameProtocol()
    protocol.connection_made(transport)
    frame = struct.pack("<Q", 1 << 20) + bytes(1 << 20)
    count = _FrameProtocol._PAUSE_BYTES // (1 << 20) + 1  # one past the bound
    _feed(protocol, frame * count, [])
    assert transport.paused and transport.pauses == 1

    async def take(n):
        return [await protocol.next_payload() for _ in range(n)]

    resume_at = count - _FrameProtocol._PAUSE_BYTES // 2 // (1 << 20)  # frames taken when half the bound is left
    asyncio.run(take(resume_at - 1))
    assert transport.paused
    asyncio.run(take(1))
    assert not transport.paused  # the sender may go on
    protocol.connection_lost(None)
    assert len(asyncio.run(take(count - resume_at))) == count - resume_at  # what arrived before the close
    assert asyncio.run(protocol.next_payload()) is None


def test_every_message_crosses_as_plain_values_and_comes_back_equal():
    """msgpack, not pickle: a frame holds data only; each kind of message decodes to what was sent."""
    from services.llm.link import (Answer, EndCall, ErrorInfo, LoadFailed, Query, Ready, Shutdown, Stopped)

    error = ErrorInfo("INVALID_ARGUMENT", "bad", "InvalidArgument")
    messages = [GenerateCall(1, b"\x00\x01", None, (), 0.25), EndCall(1, True), Query(2, "info"), Shutdown(), Ready(),
                LoadFailed(error), CallFailed(3, error), StepDeltas([(4, 0, [1, 2], "ab", [-0.5], ("stop", 3, 2, 0),
                                                                      {"error": error})]),
                Answer(2, b"info"), Stopped()]
    assert {type(m) for m in messages} == set(MESSAGES)
    for message in messages:
        data = encode(message)
        assert b"pickle" not in data and data[8:9] != b"\x80"  # no pickle protocol header
        back = decode(data[8:])
        assert type(back) is type(message)
        if isinstance(back, StepDeltas):
            (row,) = back.rows
            assert list(row[2]) == [1, 2] and row[3] == "ab" and row[5] == ("stop", 3, 2, 0)
            with pytest.raises(InvalidArgument, match="bad"):
                raise_error(row[6]["error"])
        else:
            assert back == message


def test_errors_keep_their_status_across_the_link():
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        raise_error(error_info(InvalidArgument("prompt is empty")))
    with pytest.raises(ResourceExhausted):
        raise_error(error_info(ResourceExhausted("queue full")))
    with pytest.raises(RuntimeError, match="generation failed: KeyError") as raised:
        raise_error(error_info(KeyError("x")))
    assert not isinstance(raised.value, InvalidArgument)


class _Sink:
    """A DeltaSink that records each deliver call (one frame of the link each) and sends it on as LinkSink does."""

    def __init__(self, tokenizer):
        self.delivered: list[list] = []
        self.frames: list = []

        class Sender:
            def send(inner, message):
                self.frames.append(message)
                return True

        self.link = LinkSink(Sender(), lambda t: tokenizer.decode([t]))

    def deliver(self, pairs):
        self.delivered.append(list(pairs))
        self.link.deliver(pairs)


def test_one_step_of_many_calls_is_one_deliver_and_the_edge_rebuilds_each_choice():
    tokenizer = tiny.build_tokenizer(["<|endoftext|>"], eos="<|endoftext|>")
    script = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    names = ["a", "b", "c", "d"]
    runner = ScriptedRunner({n: script for n in names}, [])
    engine = LLMEngine(runner, tokenizer, eos_token_ids=(), metrics=Metrics("llm", process_metrics=False))
    sink = _Sink(tokenizer)
    for i, name in enumerate(names):  # "b" asks for logprobs
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1 if name == "b" else 0)
        engine.add(name, PreparedPrompt([5, 6, 7]), params, SinkEmitter(sink, (i, 0, name == "b")))
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while sum(1 for f in sink.frames for row in f.rows if row[5] is not None) < 4:
            assert time.monotonic() < deadline, sink.delivered
            time.sleep(0.01)
    finally:
        engine.stop()
    # Every step handed its tokens for the four calls over in one call, hence one frame a step.
    assert len(sink.delivered) == len(sink.frames) == 6
    assert all(sorted(call for (call, _, _), _ in pairs) == [0, 1, 2, 3] for pairs in sink.delivered)
    for i, name in enumerate(names):
        emitted = [d for pairs in sink.delivered for (call, _, _), d in pairs if call == i]
        rows = [row for f in sink.frames for row in f.rows if row[0] == i]
        # A message per step, or one for all of them had they piled up: each equals the engine's deltas.
        assert [list(_response(0, [row])[0].token_ids) for row in rows] == [d.token_ids for d in emitted]
        merged, finished = _response(0, rows)
        assert finished and merged.finish_reason == pb.LENGTH and merged.usage.completion_tokens == 6
        assert list(merged.token_ids) == script[:6]
        assert merged.text == "".join(d.text for d in emitted)
        if name == "b":  # logprobs asked: each token's text comes along (the gateway has no tokenizer)
            assert list(merged.tokens) == [tokenizer.decode([t]) for t in script[:6]]
            assert len(merged.logprobs) == 6
        else:
            assert not merged.tokens and not merged.logprobs
    first = [row for f in sink.frames for row in f.rows][0]
    assert first[6]["arrival"] <= first[6]["scheduled_at"]  # the trace's queue and prefill marks


def test_an_error_row_raises_with_its_status_and_a_refused_call_is_one_message():
    row = (7, 0, [], "", [], ("abort", 0, 0, 0), {"error": error_info(ResourceExhausted("no KV pages"))})
    with pytest.raises(ResourceExhausted, match="no KV pages"):
        _response(0, [(7, 0, [3], "x", [], None, None), row])
    assert isinstance(CallFailed(7, error_info(InvalidArgument("bad"))).error.status, str)


def _llm(model_dir, *extra):
    from modalmesh.ops.launcher import ServiceProcess

    proc = ServiceProcess("llm", ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--model",
                                  str(model_dir), "--kv-cache-tokens", "2048", *extra]).start()
    proc.wait_serving(timeout=120)
    return proc


def test_if_the_engine_process_dies_while_serving_the_service_exits_1(tmp_path):
    model_dir = tiny.ensure("qwen2", tmp_path)
    proc = _llm(model_dir)
    try:
        edge, engine = proc.pids()[0], spawned(proc)
        assert len(engine) == 1, proc.pids()
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
            replies = list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
                temperature=0, max_tokens=3)), timeout=60))
            assert sum(len(r.token_ids) for r in replies) == 3
        os.kill(engine[0], signal.SIGKILL)
        assert proc.proc.wait(timeout=30) == 1
        assert any("engine process exited" in line for line in proc.lines), list(proc.lines)[-10:]
        assert edge == proc.proc.pid
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


def test_a_clean_stop_ends_both_processes_with_0_and_leaves_nothing_behind(tmp_path):
    model_dir = tiny.ensure("qwen2", tmp_path)
    proc = _llm(model_dir)
    try:
        pids = proc.pids()
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb.llm_pb2_grpc.LLMServiceStub(channel)
            assert sum(len(r.token_ids) for r in stub.Generate(pb.GenerateRequest(
                text="hi", sampling=pb.SamplingParams(temperature=0, max_tokens=3)), timeout=60)) == 3
        proc.send_sigterm()
        assert proc.terminate(timeout=60) == 0
        # All reaped by the time the edge's exit code is back: the engine process joined, the resource tracker
        # the edge started for it reaped (process.end_multiprocessing; it used to run on, orphaned, for a while).
        left = {pid: open(f"/proc/{pid}/cmdline").read().replace("\0", " ") for pid in pids
                if os.path.exists(f"/proc/{pid}")}
        assert not left, left
        # The engine process leaves with os._exit (distributed.exit_rank): multiprocessing's exit work still
        # ran, or the resource tracker would warn of tqdm's semaphore on stderr after it.
        assert not [line for line in proc.lines if "leaked" in line or "Warning" in line], list(proc.lines)[-5:]
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()


def _edge_call(items, n=1):
    """The edge's Generate over a fake engine client whose call queue already holds `items`; (error, ended)."""
    import types

    from services.llm.engine_client import EdgeCall
    from services.llm.server import LLMService

    ended = []

    async def main():
        call = EdgeCall(1)
        for item in items:
            call.queue.put_nowait(item)
        client = types.SimpleNamespace(ready=True, open_call=lambda *a: call,
                                       end_call=lambda c, complete: ended.append(complete))
        edge = types.SimpleNamespace(client=client)
        got = []
        try:
            async for response in LLMService.generate(edge, pb.GenerateRequest(sampling=pb.SamplingParams(n=n))):
                got.append(response)
        except Exception as exc:  # noqa: BLE001 - what the interceptor would turn into a status
            return got, exc, ended
        return got, None, ended

    return asyncio.run(main())


def test_a_refusal_behind_a_running_choices_rows_is_still_the_calls_error():
    """n = 2: choice 0 was added and sent a row before choice 1 was refused (queue full): the refusal, whatever
    its place among what piled up, ends the call with its status (it was a ValueError on the row's unpacking)."""
    row = (1, 0, [5], "a", [], None, None)
    refused = CallFailed(1, error_info(ResourceExhausted("the LLM queue is full")))
    got, error, ended = _edge_call([row, refused], n=2)
    assert isinstance(error, ResourceExhausted) and ended == [False]


def test_a_negative_n_waits_for_the_engines_refusal():
    """n = -2 is refused by the engine (SamplingParams); the edge must not take it for "no choices" and end OK."""
    got, error, ended = _edge_call([CallFailed(1, error_info(InvalidArgument("n must be in [1, 16], got -2")))], n=-2)
    assert isinstance(error, InvalidArgument) and not got and ended == [False]


def test_a_delta_that_cannot_be_sent_fails_its_call_not_the_engine_thread():
    frames = []

    class Sender:
        def send(self, message):
            frames.append(message)
            return True

    def token_text(token):
        if token == 13:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer's bad day")
        return "t"

    sink = LinkSink(Sender(), token_text)
    sink.deliver([((1, 0, True), Delta([13], "x", [-0.5])), ((2, 0, True), Delta([7], "y", [-0.1]))])
    (frame,) = frames
    bad, good = frame.rows
    assert bad[5][0] == "abort" and bad[6]["error"].type_name == "UnicodeDecodeError"
    assert good[2] == [7] and good[6]["tokens"] == ["t"]
    with pytest.raises(RuntimeError, match="UnicodeDecodeError"):
        _response(0, [bad])
