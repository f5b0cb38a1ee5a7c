"""`dstrain data preview`: what a run would train on, without starting anything.

The rows are read and tokenized exactly as `dstrain run` does (and cached for it), then: the counts
(rows, examples kept, cut to seq_len, left out and why, held out), the example lengths, how the
training examples fill rows with and without packing (data.packing), and the first examples
rendered with the tokens the loss is taken on marked ⟦like this⟧ (and in colour on a terminal).
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
                               "chat, alpaca or sharegpt")
    for warning in warnings + check_source(config):
        console.print(f"[yellow]warning:[/] {outside(warning)}", soft_wrap=True)
    encoded = load_encoded(data)
    train, held_out = split_encoded(encoded, data)
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
