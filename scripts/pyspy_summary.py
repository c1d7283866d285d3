"""Where each thread's time goes in a py-spy raw profile (`py-spy record --format raw --threads [--idle|--gil]`).

    python scripts/pyspy_summary.py idle.txt [--top 12] [--min-share 0.02]

For every thread with at least `--min-share` of the samples: its share of all samples, then
its `--top` functions by self time (the leaf frame) and by inclusive time (anywhere on the
stack), each as a share of that thread's samples. A raw line is the stack, outermost first,
frames split by ';', then a space and its sample count; with --threads the first frame names
the thread. Read on this machine after a device call, so the profile need not come back whole.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_LOCATION = re.compile(r"\s*\((?P<file>[^():]+):(?P<line>\d+)\)$")


def short(frame: str) -> str:
    """`function (path/to/file.py:12)` -> `function (file.py:12)`."""
    m = _LOCATION.search(frame)
    if not m:
        return frame.strip()
    return f"{frame[:m.start()].strip()} ({m['file'].rsplit('/', 1)[-1]}:{m['line']})"


def read(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """thread (with its process, when the profile names one) -> [(stack, count)]."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread = next((fr for fr in frames if fr.startswith("thread ")), "thread ?")
            processes = [fr for fr in frames if fr.startswith("process ")]
            if processes:  # --subprocesses: outermost first, so the last is the thread's own process; the same
                # thread name in several processes stays apart
                thread = f"{processes[-1].strip()[:90]} {thread}"
            frames = [fr for fr in frames if not fr.startswith(("thread ", "process "))]
            threads[thread].append(([short(fr) for fr in frames], int(count)))
    return threads


def summary(path: str, top: int, min_share: float) -> str:
    threads = read(path)
    total = sum(c for stacks in threads.values() for _, c in stacks) or 1
    out = [f"{path}: {total} samples over {len(threads)} threads"]
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        n = sum(c for _, c in stacks)
        if n / total < min_share:
            continue
        own: collections.Counter = collections.Counter()
        inclusive: collections.Counter = collections.Counter()
        for frames, c in stacks:
            own[frames[-1] if frames else "(no Python frame)"] += c
            for fr in set(frames):
                inclusive[fr] += c
        out.append(f"\n{thread}: {100 * n / total:.1f}% of all samples")
        out.append("  self:")
        out += [f"    {100 * c / n:5.1f}%  {fr}" for fr, c in own.most_common(top)]
        out.append("  inclusive:")
        out += [f"    {100 * c / n:5.1f}%  {fr}" for fr, c in inclusive.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--min-share", type=float, default=0.02)
    args = parser.parse_args(argv)
    for path in args.profiles:
        print(summary(path, args.top, args.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
