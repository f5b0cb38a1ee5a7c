"""`dstrain data preview`: what a run would train on, without starting anything.

The rows are read and tokenized exactly as `dstrain run` does (and cached for it), then: the counts
(rows, examples kept, cut to seq_len, left out and why, held out), the example lengths, how the
training examples fill rows with and without packing (data.packing), and the first examples
rendered with the tokens the loss is taken on marked ⟦like this⟧ (and in colour on a terminal).
Format "preference" shows rows of pairs instead: each prompt, then its chosen and rejected completions
marked the same way, and how well whole pairs pack into rows.
Token streams (format "text", the token sources) have no examples: their windows are always full.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.text import Text

from dstrain.config.schema import RunConfig
from dstrain.console_text import outside
from dstrain.errors import UserError

OPEN, CLOSE = "⟦", "⟧"  # around trained tokens: visible without colour (logs, pipes)
PERCENTILES = (50, 90, 99)


def preview(config: RunConfig, count: int, warnings: list[str], console: Console | None = None) -> None:
    """Print the preview of config's data; `count` examples rendered."""
    from dstrain.data import check_source, data_config, split_encoded
    from dstrain.data.formats import load_encoder
    from dstrain.data.binpack import efficiency, pack_rows
    from dstrain.data.records import ROW_SOURCES
    from dstrain.data.tokenized import load_encoded
    from dstrain.models.packing import decide_packing

    console = console or Console(highlight=False)
    data = data_config(config)
    if data.source not in ROW_SOURCES or data.format == "text":
        raise UserError.single(f"data.source {data.source!r} with format {data.format!r} is a token stream, cut into "
                               "full seq_len windows: it has no examples to preview", "data.format",
                               "preview rows of jsonl, json, parquet or datasets files in format prompt_response, "
                               "chat, alpaca, sharegpt or preference")
    for warning in warnings + check_source(config):
        console.print(f"[yellow]warning:[/] {outside(warning)}", soft_wrap=True)
    encoded = load_encoded(data)
    train, held_out = split_encoded(encoded, data)
    if encoded.groups is not None:
        return _preview_pairs(config, encoded, train, count, console)
    lengths = np.diff(np.asarray(encoded.offsets, dtype=np.int64))
    train_lengths = np.diff(np.asarray(train, dtype=np.int64))
    stats, seq = encoded.stats, data.seq_len

    console.print(outside(f"data: {data.source} {', '.join(data.paths)}; format {data.format}, tokenizer "
                          f"{data.tokenizer}, seq_len {seq}"), soft_wrap=True)
    console.print(f"  rows read        {stats['rows']:,}")
    console.print(f"  examples kept    {len(lengths):,}: {len(train_lengths):,} to train on, {len(lengths) - len(train_lengths):,} "
                  f"held out (data.eval_fraction {data.eval_fraction:g})")
    console.print(f"  cut to seq_len   {stats['truncated']:,}" +
                  (f" (the longest had {stats['longest']:,} tokens)" if stats["truncated"] else ""))
    console.print(f"  left out         {stats['dropped']:,}" +
                  (" (no response or assistant token left within seq_len)" if stats["dropped"] else ""))
    marks = "  ".join(f"p{p} {np.percentile(lengths, p):,.0f}" for p in PERCENTILES)
    console.print(f"  tokens/example   min {lengths.min():,}  {marks}  max {lengths.max():,}  mean {lengths.mean():,.1f}")

    packed, note = decide_packing(config)
    items, row_offsets = pack_rows(train_lengths, seq, config.train.seed)
    rows = len(row_offsets) - 1
    padded = f"{len(train_lengths):,} rows one example each: {efficiency(train_lengths, len(train_lengths), seq):.1%}"
    together = f"{rows:,} rows packed: {efficiency(train_lengths, rows, seq):.1%}"
    console.print(f"  packing          {'on' if packed else 'off'} (data.packing {data.packing}); efficiency (real "
                  f"tokens / row tokens) of the {len(train_lengths):,} training examples: "
                  f"{together if packed else padded}; {padded if packed else together} otherwise", soft_wrap=True)
    if note:
        console.print(f"  [dim]{outside(note)}[/]", soft_wrap=True)

    shown = min(count, len(train_lengths))
    if shown:
        console.print(f"\nthe first {shown} training examples; the loss is taken on the tokens {OPEN}marked{CLOSE}:")
    decode = _decoder(load_encoder(data))
    for number in range(shown):
        start, stop = int(train[number]), int(train[number + 1])
        ids, labels = encoded.ids[start:stop].tolist(), encoded.labels[start:stop].tolist()
        trained = sum(label != -100 for label in labels[1:])  # position 0 is never predicted
        console.print(f"[bold]--- example {number + 1}[/]: {len(ids)} tokens, {trained} trained", soft_wrap=True)
        console.print(render(ids, labels, decode), soft_wrap=True)


def _preview_pairs(config: RunConfig, encoded, train, count: int, console: Console) -> None:
    """Format "preference": counts, tokens per pair, the packing of whole pairs (or KTO's examples), and
    the first pairs: the prompt, then each completion with its scored tokens marked."""
    from dstrain.config.preference import PAIRED_OBJECTIVES
    from dstrain.data import data_config
    from dstrain.data.formats import load_encoder
    from dstrain.data.preference import PreferenceRows, unit_lengths, unit_offsets
    from dstrain.models.packing import decide_packing

    data, stats = data_config(config), encoded.stats
    objective = config.train.objective
    paired = objective in PAIRED_OBJECTIVES
    groups = len(encoded.groups) - 1
    group_lengths = unit_lengths(encoded.offsets, encoded.groups)
    console.print(outside(f"data: {data.source} {', '.join(data.paths)}; format preference, objective {objective}, "
                          f"tokenizer {data.tokenizer}, seq_len {data.seq_len}"), soft_wrap=True)
    console.print(f"  rows read        {stats['rows']:,}")
    console.print(f"  kept             {groups:,}: {stats['pairs']:,} pairs, {stats['unpaired']:,} unpaired (KTO); "
                  f"{len(train) - 1:,} to train on, {groups - (len(train) - 1):,} held out "
                  f"(data.eval_fraction {data.eval_fraction:g})", soft_wrap=True)
    console.print(f"  cut to fit       {stats['truncated']:,} completions" +
                  (f" (the longest row had {stats['longest']:,} tokens; a pair's two examples share one row)"
                   if stats["truncated"] else ""), soft_wrap=True)
    console.print(f"  left out         {stats['dropped']:,}" +
                  (" (a completion with no token left within seq_len)" if stats["dropped"] else ""))
    marks = "  ".join(f"p{p} {np.percentile(group_lengths, p):,.0f}" for p in PERCENTILES)
    console.print(f"  tokens/row       min {group_lengths.min():,}  {marks}  max {group_lengths.max():,}")
    packed, note = decide_packing(config)
    seed = config.train.seed
    units = unit_offsets(encoded, train, paired)
    together = PreferenceRows(encoded, units, data.seq_len, seed, paired, packed=True)
    apart = PreferenceRows(encoded, units, data.seq_len, seed, paired, packed=False)
    what = "pairs" if paired else "examples"
    console.print(f"  packing          {'on' if packed else 'off'} (data.packing {data.packing}); efficiency (real "
                  f"tokens / row tokens) of the {together.count:,} training {what}: {together.rows():,} rows of whole "
                  f"{what} packed: {together.efficiency():.1%}; {apart.rows():,} rows one example each: "
                  f"{apart.efficiency():.1%}", soft_wrap=True)
    if note:
        console.print(f"  [dim]{outside(note)}[/]", soft_wrap=True)
    decode = _decoder(load_encoder(data))
    shown = min(count, len(train) - 1)
    if shown:
        console.print(f"\nthe first {shown} training rows; the loss is taken on the tokens {OPEN}marked{CLOSE}:")
    offsets = encoded.offsets
    for number in range(shown):
        examples = range(int(encoded.groups[number]), int(encoded.groups[number + 1]))
        parts = []
        for example in examples:
            ids = encoded.ids[offsets[example]:offsets[example + 1]].tolist()
            labels = encoded.labels[offsets[example]:offsets[example + 1]].tolist()
            start = next((i for i, label in enumerate(labels) if label != -100), len(labels))
            parts.append((ids, labels, start))
        prompt_ids = parts[0][0][:parts[0][2]]
        console.print(f"[bold]--- row {number + 1}[/]: {'pair' if len(parts) == 2 else 'unpaired'}, prompt "
                      f"{len(prompt_ids)} tokens", soft_wrap=True)
        console.print(Text("prompt: ", style="bold") + Text(decode(prompt_ids), style="dim"), soft_wrap=True)
        for example, (ids, labels, start) in zip(examples, parts):
            side = ("chosen" if encoded.desirable[example] else "rejected") if len(parts) == 2 else \
                ("desirable" if encoded.desirable[example] else "undesirable")
            trained = sum(label != -100 for label in labels[1:])
            console.print(Text(f"{side} ({trained} scored): ", style="bold") +
                          render(ids[start:], labels[start:], decode), soft_wrap=True)


def render(ids: list[int], labels: list[int], decode) -> Text:
    """The example's text, its runs of trained tokens between OPEN and CLOSE (and green)."""
    text = Text()
    run: list[int] = []
    learning = False
    for token, label in [*zip(ids, labels), (None, None)]:
        now = label is not None and label != -100
        if token is None or now != learning:
            if run:
                piece = decode(run)
                text.append(f"{OPEN}{piece}{CLOSE}" if learning else piece, style="bold green" if learning else "dim")
            run, learning = [], now
        if token is not None:
            run.append(token)
    return text


def _decoder(encoder):
    if encoder.hf is None:
        return lambda ids: bytes(ids).decode("utf-8", errors="replace").replace("\0", "<eos>")
    return lambda ids: encoder.hf.decode(ids, skip_special_tokens=False)
