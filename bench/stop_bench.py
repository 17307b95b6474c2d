"""Host time of stop-sequence checks per streamed token (issue 20: 629 µs a token a row with 8 stop
sequences of 256 characters): the detokenizer's KMP matchers against the suffix search they
replaced, run here side by side on the same text.

    python -m bench.stop_bench            # bench/results/stop-sequences-<name>.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.common import save
from services.worker.detokenizer import IncrementalDetokenizer


class SuffixSearch(IncrementalDetokenizer):
    """The previous checks: a find over the new text and, for the hold-back, every prefix length
    of every stop tried with endswith (O(stop length^2) a token)."""

    def _append(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for stop in self._stop:
            idx = self.text.find(stop, max(0, start - len(stop) + 1))
            if idx >= 0:
                self.text, self.stopped = self.text[:idx], True
                return

    def _holdback(self) -> int:
        if self.stopped or not self._stop:
            return 0
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best


def per_token_us(cls, stops: list[str], pieces: list[str], reps: int) -> float:
    times = []
    for _ in range(reps):
        d = cls(None, stop=stops)
        t0 = time.perf_counter()
        for p in pieces:
            d._append(p)
            d._take(final=False)
        times.append((time.perf_counter() - t0) / len(pieces) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stops", type=int, default=8)
    ap.add_argument("--stop-chars", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="stop-sequences")
    args = ap.parse_args()
    rnd = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "image", "shows", "blue", "red", "and", "of"]
    # stops that share the text's words, so partial matches (the hold-back) really occur
    stops = [
        " ".join(rnd.choice(words) for _ in range(args.stop_chars))[: args.stop_chars] + "#" for _ in range(args.stops)
    ]
    pieces = [" " + rnd.choice(words) for _ in range(args.tokens)]
    rows = [
        {"method": name, "us_per_token": round(per_token_us(cls, stops, pieces, args.reps), 2)}
        for name, cls in (("kmp_matchers", IncrementalDetokenizer), ("suffix_search", SuffixSearch))
    ]
    for r in rows:
        print(f"{r['method']:14s} {r['us_per_token']:9.2f} µs a token")
    save(args.name, {"stops": args.stops, "stop_chars": args.stop_chars, "tokens": args.tokens, "rows": rows})


if __name__ == "__main__":
    main()
