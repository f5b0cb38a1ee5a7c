"""A tiny preference JSONL from real text, for tests: each line of the Zen of Python (the standard library's
`this`, on every machine with Python) split in two; the prompt is its first half, the chosen completion its
own second half, the rejected one the second half of another line."""

from __future__ import annotations

import codecs
import contextlib
import io
import json
from pathlib import Path


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[1:] if line.strip()]


def write_zen_pairs(path: Path, repeat: int = 1) -> Path:
    """19 pairs (times `repeat`) as {"prompt", "chosen", "rejected"} rows."""
    lines = zen_lines()
    rows = []
    for i, line in enumerate(lines):
        words, other = line.split(), lines[(i + 7) % len(lines)].split()
        cut = max(1, len(words) // 2)
        rows.append({"prompt": " ".join(words[:cut]) + " ", "chosen": " ".join(words[cut:]),
                     "rejected": " ".join(other[max(1, len(other) // 2):])})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * repeat))
    return path
