"""The LLM link's frame reader against asyncio's StreamReader, on the engine process's side of the link.

    python bench/link.py                  # 1.8 MB frames (an image embedding's request), idle and beside a busy thread
    python bench/link.py --frame-mb 0.6 --frames 400 --quick

A sender process writes framed GenerateCalls as fast as the socket takes them; the reader receives and decodes
them on an event loop, alone in its process ("idle"), then beside a thread that runs Python without pause
("busy": the engine thread launching steps). Each row is frames per second and the reader's loop CPU per frame;
the limit is one memcpy of each frame's bytes.

Why the busy row matters: every read releases the GIL, and taking it back from a thread that runs Python waits up
to the switch interval (5 ms by default). StreamReader's 256 KB reads cost a 1.8 MB frame about eight such waits;
reading into the frame's own buffer costs one or two. The peer is the reader this repo had before (asyncio's
StreamReader with readexactly), run on the same frames in the same run. No timed assertion lives in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from services.llm import link  # noqa: E402


class StreamFrameReader:
    """The peer: frames through asyncio's StreamReader (the link's reader up to 438797b)."""

    def __init__(self, reader, writer):
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, sock):
        sock.setblocking(False)
        return cls(*await asyncio.open_unix_connection(sock=sock, limit=link._BUFFER_BYTES))

    async def recv(self):
        try:
            (size,) = link._HEADER.unpack(await self._reader.readexactly(link._HEADER.size))
            return link.decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None


def send_frames(sock, frames: int, nbytes: int) -> None:
    call = link.GenerateCall(0, bytes(nbytes), None, (("x-request-id", "bench"),), 0.0)
    sender = link.FrameSender(sock)
    for _ in range(frames):
        sender.send(call)
    sender.close()


async def receive(reader_cls, frames: int, nbytes: int, busy: bool) -> tuple[float, float]:
    """Frames per second and the loop's CPU ms per frame."""
    ours, theirs = link.socket_pair()
    sender = multiprocessing.get_context("spawn").Process(target=send_frames, args=(theirs, frames, nbytes))
    sender.start()
    theirs.close()
    reader = await reader_cls.open(ours)
    stop = threading.Event()

    def spin():  # pure Python, never blocking: it gives the GIL up only when the interpreter makes it
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    first = await reader.recv()  # the sender has started
    assert first is not None
    if spinner is not None:
        spinner.start()
    start, cpu, count = time.perf_counter(), time.thread_time(), 0
    while await reader.recv() is not None:
        count += 1
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    stop.set()
    if spinner is not None:
        spinner.join()
    sender.join()
    return count / wall, cpu / count * 1e3


def copy_limit(nbytes: int, repeats: int = 64) -> float:
    """Frames per second if receiving a frame cost nothing but landing its bytes once: one single-threaded
    memcpy of a frame into memory already mapped (the kernel's copy into the reader's buffer), rotating over
    buffers of 128 MB in all so that the caches do not hold them (a frame arrives cold)."""
    count = max(2, (64 << 20) // max(nbytes, 1))
    src = [np.ones(nbytes, dtype=np.uint8) for _ in range(count)]
    dst = [np.ones(nbytes, dtype=np.uint8) for _ in range(count)]
    start = time.perf_counter()
    for i in range(repeats):
        np.copyto(dst[i % count], src[(i * 7 + 3) % count])
    return repeats / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frame-mb", type=float, default=1.835, help="payload per frame (default: a 448^2 image's "
                        "Qwen2-VL embedding request, 256 x 3584 bf16)")
    parser.add_argument("--frames", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 frames a row")
    args = parser.parse_args()
    frames = 20 if args.quick else args.frames
    nbytes = int(args.frame_mb * 1e6)
    limit = copy_limit(nbytes)
    print(f"{frames} frames of {nbytes / 1e6:.2f} MB, switch interval {sys.getswitchinterval() * 1e3:.1f} ms; limit "
          f"{limit:.0f} frames/s ({limit * nbytes / 1e9:.1f} GB/s: one memcpy of each frame, nothing else)")
    print(f"{'reader':>14} | {'beside':>12} | {'frames/s':>9} | {'loop CPU ms/frame':>17} | {'MB/s':>7}")
    for cls in (link.FrameReader, StreamFrameReader):  # unmeasured: the allocator's first faults are nobody's
        asyncio.run(receive(cls, max(4, frames // 10), nbytes, False))
    for busy in (False, True):
        for name, cls in (("ours", link.FrameReader), ("StreamReader", StreamFrameReader)):
            rate, cpu = asyncio.run(receive(cls, frames, nbytes, busy))
            print(f"{name:>14} | {'a busy thread' if busy else 'nothing':>12} | {rate:9.1f} | {cpu:17.3f} | "
                  f"{rate * nbytes / 1e6:7.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
