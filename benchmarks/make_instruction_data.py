"""An instruction set with Alpaca-GPT4's length distribution, cut from real text, in two layouts:

    python3 benchmarks/make_instruction_data.py OUT_DIR [--examples 4000] [--seed 0] [--chars-per-token 4.0]

writes OUT_DIR/alpaca.jsonl (instruction / input / output) and OUT_DIR/sharegpt.jsonl (the same examples as
conversations: [{"from": "human", ...}, {"from": "gpt", ...}]), plus OUT_DIR/lengths.json (the sampled lengths).

Whose distribution: Alpaca-GPT4 (Peng et al. 2023, arXiv 2304.03277; the 52K Alpaca instructions answered by
GPT-4), the set the fine-tuning tutorials of TRL, axolotl and LLaMA-Factory start from. Published figures:
- Wang et al. 2023, "How Far Can Camels Go?" (arXiv 2306.04751), Table 1, LLaMA tokens: GPT4-Alpaca 52,002
  examples, 1.0 rounds, prompt 28.0 and completion 161.8 tokens on average (ShareGPT, for contrast: 3.2 rounds,
  71.0 / 357.8).
- The dataset card of vicgalle/alpaca-gpt4: 52,002 rows, 88,566,301 bytes over instruction, input, output and
  `text` (the same three with Alpaca's ~180-byte prompt header): ~1,700 bytes a row, ~760 bytes of
  instruction+input+output, ~190 LLaMA tokens at ~4 bytes a token, consistent with 28.0 + 161.8.
Shape: log-normal lengths (a long right tail, as instruction sets have). Output median 122 tokens, sigma 0.75
(mean 162); instruction median 15, sigma 0.5; an input on 40% of the rows (Alpaca's instructions that take
one), median 20, sigma 0.8: prompt mean 17 + 0.4 x 27 = 28. Capped at 3,000 tokens an output.

The text is real: Python's standard-library sources (dstrain's "corpus" source), each field a slice taken at
a seeded offset and cut to its sampled length in characters (tokens x --chars-per-token, snapped to a space).
Token lengths therefore follow the published ones as far as the tokenizer's characters per token on this text
match --chars-per-token: benchmarks/sft.py measures its tokenizer's ratio and passes it. Same seed, same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# (median tokens, log-normal sigma) of each field; see the docstring for the published figures behind them
INSTRUCTION = (15, 0.5)
INPUT = (20, 0.8)
INPUT_SHARE = 0.4
OUTPUT = (122, 0.75)
MAX_OUTPUT = 3000


def corpus_text() -> str:
    """The standard library's top-level sources, joined as dstrain's corpus source joins them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dstrain.data.sources import corpus_files
    return "\n".join(path.read_text(errors="replace") for path in corpus_files())


def sample_lengths(examples: int, seed: int) -> dict[str, np.ndarray]:
    """Token lengths of each field (input 0 where a row has none)."""
    rng = np.random.default_rng(seed)

    def lognormal(median_sigma, cap):
        median, sigma = median_sigma
        return np.clip(np.rint(rng.lognormal(np.log(median), sigma, examples)), 1, cap).astype(int)
    has_input = rng.random(examples) < INPUT_SHARE
    return {"instruction": lognormal(INSTRUCTION, 200), "input": lognormal(INPUT, 1000) * has_input,
            "output": lognormal(OUTPUT, MAX_OUTPUT)}


def cut(text: str, rng: np.random.Generator, chars: int) -> str:
    """`chars` characters of `text` from a random place, starting and ending at a space where one is near."""
    if chars <= 0:
        return ""
    start = int(rng.integers(0, len(text) - chars - 64))
    space = text.find(" ", start, start + 32)
    start = space + 1 if space >= 0 else start
    piece = text[start:start + chars]
    end = piece.rfind(" ", max(len(piece) - 32, 1))
    return (piece[:end] if end > 0 else piece).strip() or piece


def build(examples: int, seed: int, chars_per_token: float, text: str | None = None) -> list[dict]:
    """The examples in Alpaca layout."""
    text = text if text is not None else corpus_text()
    lengths = sample_lengths(examples, seed)
    rng = np.random.default_rng(seed + 1)
    rows = []
    for i in range(examples):
        rows.append({key: cut(text, rng, int(round(lengths[key][i] * chars_per_token)))
                     for key in ("instruction", "input", "output")})
    return rows


def to_sharegpt(row: dict) -> dict:
    human = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": row["output"]}]}


def write(out: Path, examples: int, seed: int, chars_per_token: float) -> dict:
    """Write both layouts and the sampled lengths; returns the summary written to lengths.json."""
    out.mkdir(parents=True, exist_ok=True)
    rows = build(examples, seed, chars_per_token)
    with open(out / "alpaca.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(out / "sharegpt.jsonl", "w") as f:
        f.writelines(json.dumps(to_sharegpt(row)) + "\n" for row in rows)
    lengths = sample_lengths(examples, seed)
    summary = {"examples": examples, "seed": seed, "chars_per_token": chars_per_token,
               "follows": "Alpaca-GPT4 (prompt 28.0 / completion 161.8 LLaMA tokens on average)",
               "mean_tokens": {k: float(v.mean()) for k, v in lengths.items()},
               "mean_prompt_tokens": float((lengths["instruction"] + lengths["input"]).mean()),
               "p50_p90_p99_example_tokens": [float(np.percentile(sum(lengths.values()), q)) for q in (50, 90, 99)]}
    (out / "lengths.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chars-per-token", type=float, default=4.0,
                        help="characters a token of the target tokenizer covers on this text (LLaMA on English: ~4)")
    args = parser.parse_args()
    print(json.dumps(write(args.out, args.examples, args.seed, args.chars_per_token), indent=2))


if __name__ == "__main__":
    main()
