"""Where the host's time goes in a dstrain profile taken with Python stacks (profile.with_stack=true): the
Python functions with the most time of their own and the most time in all (children included), per
thread, from the Chrome trace's python_function events.

    python3 benchmarks/trace_host.py RUN_DIR/profile/rank0.trace.json.gz [--top 30] [--match deepspeed]

--match keeps the inclusive table to functions whose file or name holds the text (say, deepspeed/ or
dstrain/). Times are summed over the profiled steps; the tracer's own cost inflates short functions.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def host_tables(events: list[dict]) -> dict:
    """{tid: (busy_us, {name: self_us}, {name: total_us}, {name: calls})} for each thread's Python events."""
    python = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"]
    for e in python:  # "<built-in method relu of Tensor object at 0x7f..>": one name for every object
        e["name"] = re.sub(r" at 0x[0-9a-f]+", "", e["name"])
    by_id = {e["args"]["Python id"]: e for e in python}
    child_time: dict[int, float] = defaultdict(float)
    for e in python:
        parent = e["args"].get("Python parent id")
        if parent in by_id:
            child_time[parent] += e["dur"]
    tables: dict = {}
    for e in python:
        tid = e["tid"]
        table = tables.setdefault(tid, [0.0, defaultdict(float), defaultdict(float), defaultdict(int)])
        own, calls = table[1], table[3]
        ident = e["args"]["Python id"]
        own[e["name"]] += max(0.0, e["dur"] - child_time[ident])
        calls[e["name"]] += 1
        if e["args"].get("Python parent id") not in by_id:
            tables[tid][0] += e["dur"]  # a root: the thread's traced time
    # inclusive time counted once per call chain: a recursive function's nested calls are not added again
    for tid in tables:
        tables[tid][2] = _inclusive([e for e in python if e["tid"] == tid], by_id)
    return tables


def _inclusive(thread_events: list[dict], by_id: dict) -> dict:
    total: dict[str, float] = defaultdict(float)
    for e in thread_events:
        name, parent = e["name"], e["args"].get("Python parent id")
        while parent in by_id:  # skip a call nested in a call of the same function
            if by_id[parent]["name"] == name:
                break
            parent = by_id[parent]["args"].get("Python parent id")
        else:
            total[name] += e["dur"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--match", default="", help="only functions whose name holds this, in the inclusive table")
    args = parser.parse_args()
    tables = host_tables(load(args.trace))
    if not tables:
        raise SystemExit(f"{args.trace}: no python_function events (profile with profile.with_stack=true)")
    for tid, (busy, own, total, calls) in sorted(tables.items(), key=lambda item: -item[1][0]):
        if busy < 1000:
            continue
        print(f"\n== thread {tid}: {busy / 1000:,.1f} ms of traced Python")
        print(f"{'self ms':>9} {'calls':>7}  function (most time of its own)")
        for name, us in sorted(own.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{us / 1000:9.1f} {calls[name]:7d}  {name}")
        print(f"{'total ms':>9} {'calls':>7}  function (most time in all{', ' + args.match if args.match else ''})")
        shown = [(n, us) for n, us in total.items() if args.match in n]
        for name, us in sorted(shown, key=lambda kv: -kv[1])[:args.top]:
            print(f"{us / 1000:9.1f} {calls[name]:7d}  {name}")


if __name__ == "__main__":
    main()
