"""Summarises a `py-spy record --threads -f raw` profile (collapsed stacks, one `frames count`
line each): samples per thread, then for each of the busiest threads the functions by inclusive
and by self samples. Used by bench/h200_session.sh to bring a worker's profile back as text.

    python -m bench.pyspy_summary worker-pyspy.txt [--threads 3] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def parse(lines) -> dict[str, list[tuple[list[str], int]]]:
    """thread -> [(frames root first, samples)]."""
    out: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        out[frames[0]].append((frames[1:], int(count)))
    return out


def short(frame: str, line: bool = True) -> str:
    # "fn (path/to/file.py:123)" -> "fn (file.py:123)", or "fn (file.py)" without the line
    frame = re.sub(r"\(([^()]*/)?([^/()]+)\)$", r"(\2)", frame)
    return frame if line else re.sub(r":\d+\)$", ")", frame)


def summary(threads: dict[str, list[tuple[list[str], int]]], n_threads: int, top: int, match: str = "") -> str:
    """Every thread's samples; broken down: the threads whose name matches `match` (regex), then
    the busiest others up to n_threads in all."""
    totals = {t: sum(c for _, c in stacks) for t, stacks in threads.items()}
    ranked = sorted(totals, key=lambda t: -totals[t])
    lines = ["samples per thread:"] + [f"  {totals[t]:8d}  {t}" for t in ranked]
    chosen = [t for t in ranked if match and re.search(match, t)]
    chosen += [t for t in ranked if t not in chosen][: max(0, n_threads - len(chosen))]
    for t in chosen:
        total = totals[t]
        incl: collections.Counter = collections.Counter()
        leaf: collections.Counter = collections.Counter()
        for frames, c in threads[t]:
            for f in {short(f, line=False) for f in frames}:
                incl[f] += c
            if frames:
                leaf[short(frames[-1])] += c
        lines.append(f"\n{t}: {total} samples\n  inclusive (by function):")
        lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(top)]
        lines.append("  self (by line):")
        lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in leaf.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--threads", type=int, default=3, help="Busiest threads to break down.")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--match", default="valora-engine", help="Threads always broken down (regex on the name).")
    args = p.parse_args(argv)
    with open(args.path) as f:
        print(summary(parse(f), args.threads, args.top, args.match))


if __name__ == "__main__":
    main(sys.argv[1:])
