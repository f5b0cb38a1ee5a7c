"""Tables from py-spy's raw (collapsed) samples, per thread: the frames with the most samples of their own
and in all. Made for `py-spy record --threads --format raw` (benchmarks/calls/offload_final.sh).

    python3 benchmarks/pyspy_tables.py pyspy-raw.txt [--top 60]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    own, total, by_thread = collections.Counter(), collections.Counter(), collections.Counter()
    with open(args.raw) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            thread, *frames = stack.split(";")
            n = int(count)
            by_thread[thread] += n
            if frames:
                own[(thread, frames[-1])] += n
            for frame in set(frames):
                total[(thread, frame)] += n
    print("samples per thread:")
    for thread, n in by_thread.most_common():
        print(f"{n:7d}  {thread}")
    for thread, _ in by_thread.most_common(4):
        for title, table in (("own", own), ("in all", total)):
            rows = [(frame, n) for (t, frame), n in table.items() if t == thread]
            print(f"\n== {thread}: most samples ({title})")
            for frame, n in sorted(rows, key=lambda row: -row[1])[:args.top]:
                print(f"{n:7d}  {frame[:160]}")


if __name__ == "__main__":
    main()
