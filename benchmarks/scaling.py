"""How each runner and preset scales from one GPU to several: reads suite.py results files (one machine,
rows at several GPU counts, e.g. `suite.py --gpus 1,2,4`) and prints, per runner and preset, tokens/s at
each GPU count, the scaling efficiency (tokens/s on N GPUs over N times the one-GPU row's) and the ratio
to torch's row at the same count (eager on one GPU, DDP on several).

    python3 benchmarks/scaling.py benchmarks/results/<dir>/*.json [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def scaling_rows(rows: list[dict]) -> list[dict]:
    """One entry per (runner, preset, variant): {"runner", "preset", "by_gpus": {N: {"tokens_per_s",
    "efficiency", "vs_torch"}}}; rows without a throughput (failed, out of memory) keep their status."""
    torch_at = {r["gpus"]: r["tokens_per_s"] for r in rows if r["runner"] == "torch" and r.get("tokens_per_s")}
    grouped: dict[tuple, dict] = {}
    for r in rows:
        key = (r["runner"], r["preset"], r.get("variant") or "")
        entry = grouped.setdefault(key, {"runner": key[0], "preset": key[1], "variant": key[2], "by_gpus": {}})
        tps = r.get("tokens_per_s")
        entry["by_gpus"][r["gpus"]] = {"tokens_per_s": tps, "status": r.get("status")}
    for entry in grouped.values():
        one = (entry["by_gpus"].get(1) or {}).get("tokens_per_s")
        for gpus, cell in entry["by_gpus"].items():
            tps = cell["tokens_per_s"]
            cell["efficiency"] = round(tps / (gpus * one), 3) if tps and one else None
            cell["vs_torch"] = round(tps / torch_at[gpus], 3) if tps and torch_at.get(gpus) else None
    return list(grouped.values())


def render(entries: list[dict], markdown: bool = False) -> str:
    counts = sorted({g for e in entries for g in e["by_gpus"]})
    head = ["runner", "preset"] + [f"{g} GPU{'s' if g > 1 else ''}: tok/s (eff, vs torch)" for g in counts]
    lines = [head]
    for e in entries:
        cells = []
        for g in counts:
            cell = e["by_gpus"].get(g)
            if cell is None:
                cells.append("-")
            elif not cell["tokens_per_s"]:
                cells.append((cell.get("status") or "failed")[:30])
            else:
                eff = "-" if cell["efficiency"] is None else f"{cell['efficiency']:.2f}"
                vs = "-" if cell["vs_torch"] is None else f"{cell['vs_torch']:.2f}"
                cells.append(f"{cell['tokens_per_s']:,.0f} ({eff}, {vs})")
        name = e["preset"] + (f" [{e['variant']}]" if e["variant"] else "")
        lines.append([e["runner"], name] + cells)
    if markdown:
        out = ["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(lines[0])]
        return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines[1:]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--markdown", action="store_true", help="a table for docs/benchmarks.md")
    a = p.parse_args()
    rows = [row for f in a.files for row in json.loads(f.read_text())["rows"]]
    print(render(scaling_rows(rows), a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
