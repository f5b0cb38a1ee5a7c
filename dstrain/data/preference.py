"""Format "preference": rows of chosen and rejected completions (or KTO's unpaired ones) encoded, and
whole pairs laid out in rows for the preference losses (dstrain/models/preference_loss.py).

Encoding. Each row (read by dstrain/data/layouts.py) becomes one group of examples: a pair is two,
prompt + chosen then prompt + rejected; a KTO row is one, prompt + completion. Text rows are encoded as
format "prompt_response" ([prefix] prompt completion [eos]); message rows are rendered by the chat
template as format "chat", the prompt's turns being context. Only completion tokens are labels (-100 on
the prompt). A group is kept whole: when a pair's two examples together exceed seq_len, the longer
completion is cut (from its end) until they fit, since a pair is never split across rows; a group with
an example left without a label is dropped whole. Stored flat as the SFT formats are (ids, labels,
offsets per example), with `groups` (offsets into the examples), `desirable` per example (chosen: 1,
rejected: 0; KTO's label) and `margins` per group (nan where the row has none).

Rows. A unit is what is sampled: a pair for the paired objectives, one example for KTO (a pair is then
two examples, one desirable and one not, as TRL's unpair_preference_dataset makes them). Packed, units
are placed whole into rows of seq_len (binpack.pack_rows on their token counts), each example's position
ids restarting at 0; padded, each example has its row, the chosen completions' rows first. Either way
`example_ids` gives each token its segment: for pairs, chosen completion p of the micro batch's P pairs
is segment p and its rejected one P + p (TRL's concatenated order), for KTO example k is segment k; -1 on
padding. preference_loss.shift_segment_ids(example_ids, labels) then aligns them with the shifted labels
and segment_logps sums each completion. A KTO batch also carries its KL term's rows (kl_*: example k's
prompt with the completion of example kto_mismatched_order(N)[k]). numpy only: `dstrain data preview`
packs without torch.
"""

from __future__ import annotations

import numpy as np

from dstrain.config.preference import kto_mismatched_order
from dstrain.config.schema import DataConfig
from dstrain.data.binpack import pack_rows
from dstrain.data.formats import IGNORE, Encoded, Encoder

FORMAT = "preference"


def encode_preference(rows: list[tuple[str, dict]], data: DataConfig, encoder: Encoder) -> Encoded:
    """Read every row by its layout, encode its examples, store them grouped."""
    from dstrain.data.layouts import preference_rows
    read = preference_rows(rows, data)
    examples: list[list[tuple[list[int], list[int]]]] = [[] for _ in read]
    text = [i for i, row in enumerate(read) if row.is_text]
    if text:
        eos = encoder.require_eos(FORMAT)
        prompts = encoder.encode([read[i].prompt for i in text])
        completions = encoder.encode([c for i in text for c in read[i].completions])
        at = 0
        for i, prompt in zip(text, prompts):
            context = encoder.prefix + prompt
            for completion in completions[at:at + len(read[i].completions)]:
                examples[i].append((context + completion + [eos], [IGNORE] * len(context) + completion + [eos]))
            at += len(read[i].completions)
    chat = [i for i, row in enumerate(read) if not row.is_text]
    if chat:
        from dstrain.data.chat import conversation_examples
        wheres, conversations, score_from, owner = [], [], [], []
        for i in chat:
            rendered, prompt_turns = read[i].conversations()
            for conversation in rendered:
                wheres.append(read[i].where)
                conversations.append(conversation)
                score_from.append(prompt_turns)
                owner.append(i)
        for i, example in zip(owner, conversation_examples(FORMAT, wheres, conversations, data, encoder,
                                                            "data.format preference", score_from)):
            examples[i].append(example)
    return store_groups(examples, [row.desirable for row in read], [row.margin for row in read],
                        [row.where for row in read], data.seq_len, encoder.pad_id)


def fit_group(lengths: list[int], seq_len: int) -> list[int]:
    """Lengths to cut a group's examples to, so that together they fit one row of seq_len: one example to
    seq_len; a pair's longer example shortened first, each keeping at least half the row."""
    if len(lengths) == 1:
        return [min(lengths[0], seq_len)]
    first, second = lengths
    if first + second <= seq_len:
        return [first, second]
    half = seq_len // 2
    if first <= half:
        return [first, seq_len - first]
    if second <= seq_len - half:
        return [seq_len - second, second]
    return [half, seq_len - half]


def store_groups(groups: list[list[tuple[list[int], list[int]]]], desirable: list[list[bool]],
                 margins: list[float | None], wheres: list[str], seq_len: int, pad_id: int) -> Encoded:
    """Groups cut to fit a row (fit_group), those with an example left without labels dropped whole,
    stored flat: examples by `offsets`, groups by `groups` (offsets into the examples)."""
    ids, labels, offsets, group_offsets = [], [], [0], [0]
    kept_desirable, kept_margins = [], []
    truncated = dropped = longest = pairs = unpaired = 0
    first_unpaired = None
    for examples, wanted, margin, where in zip(groups, desirable, margins, wheres):
        lengths = [len(example_ids) for example_ids, _ in examples]
        longest = max(longest, sum(lengths))
        cut = fit_group(lengths, seq_len)
        truncated += sum(c < n for c, n in zip(cut, lengths))
        cut_examples = [(i[:c], lb[:c]) for (i, lb), c in zip(examples, cut)]
        if any(all(label == IGNORE for label in lb[1:]) for _, lb in cut_examples):
            dropped += 1
            continue
        for example_ids, example_labels in cut_examples:
            ids += example_ids
            labels += example_labels
            offsets.append(len(ids))
        kept_desirable += wanted
        kept_margins.append(np.nan if margin is None else margin)
        group_offsets.append(len(offsets) - 1)
        if len(examples) == 2:
            pairs += 1
        else:
            unpaired += 1
            first_unpaired = first_unpaired or where
    stats = {"rows": len(groups), "truncated": truncated, "dropped": dropped, "longest": longest, "pairs": pairs,
             "unpaired": unpaired, "first_unpaired": first_unpaired}
    return Encoded(FORMAT, pad_id, ids=np.asarray(ids, dtype=np.int32), labels=np.asarray(labels, dtype=np.int32),
                   offsets=np.asarray(offsets, dtype=np.int64), groups=np.asarray(group_offsets, dtype=np.int64),
                   desirable=np.asarray(kept_desirable, dtype=np.int8),
                   margins=np.asarray(kept_margins, dtype=np.float32), stats=stats)


def unit_offsets(encoded: Encoded, groups: np.ndarray, paired: bool) -> np.ndarray:
    """Offsets into the examples of the units sampled from `groups` (a slice of encoded.groups): the groups
    themselves for the paired objectives, each example alone for KTO."""
    groups = np.asarray(groups, dtype=np.int64)
    return groups if paired else np.arange(groups[0], groups[-1] + 1, dtype=np.int64)


def unit_lengths(offsets: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Tokens of each unit: units[u]:units[u + 1] are offsets' example indices (examples by `offsets`)."""
    offsets, units = np.asarray(offsets, dtype=np.int64), np.asarray(units, dtype=np.int64)
    return offsets[units[1:]] - offsets[units[:-1]]


class PreferenceRows:
    """Units laid out in rows, as numpy arrays (the sampler in dstrain/data/sampler.py wraps them in
    tensors). `packed`: rows of seq_len holding whole units (pack_rows, seeded); else one example a row.
    Row r of a packed layout holds units items[row_offsets[r]:row_offsets[r + 1]]."""

    def __init__(self, encoded: Encoded, units: np.ndarray, seq_len: int, seed: int, paired: bool, packed: bool):
        self.encoded, self.units = encoded, np.asarray(units, dtype=np.int64)
        self.seq_len, self.paired, self.packed = seq_len, paired, packed
        offsets = np.asarray(encoded.offsets, dtype=np.int64)
        self.unit_lengths = unit_lengths(offsets, self.units)
        if packed:
            self.items, self.row_offsets = pack_rows(self.unit_lengths, seq_len, seed)
        self.count = len(self.units) - 1  # units in this split
        self.reference: np.ndarray | None = None
        """preference.reference precomputed: [groups, 2] fp32, each pair's reference log-prob sums of its chosen
        and rejected completions (indexed like encoded.groups; set by dstrain.rank.precomputed)."""

    def groups_of(self, unit_groups: list[list[int]]) -> np.ndarray:
        """The pair (index into encoded.groups) of each unit occurrence of a micro batch, in segment order."""
        chosen = [int(self.units[u]) for group in unit_groups for u in group]
        return np.searchsorted(np.asarray(self.encoded.groups), chosen)

    def rows(self) -> int:
        """Rows of one pass: packed rows, or one per example."""
        return len(self.row_offsets) - 1 if self.packed else int(self.units[-1] - self.units[0])

    def row_units(self, row: int) -> np.ndarray:
        return self.items[self.row_offsets[row]:self.row_offsets[row + 1]]

    def efficiency(self) -> float:
        """Real tokens / row tokens over one pass."""
        rows = self.rows()
        return float(self.unit_lengths.sum()) / (rows * self.seq_len) if rows else 0.0

    def layout(self, unit_groups: list[list[int]]) -> dict[str, np.ndarray]:
        """The arrays of one micro batch: `unit_groups`, one list of units per packed row (or, padded, the
        units of the micro batch as one list): input_ids, labels (Hugging Face's, unshifted; -100 on the
        prompt, on each example's first token and on padding), position_ids, example_ids (the segment of each
        token, -1 on padding), desirable (per segment); for pairs margin (per pair; 0 where none) and, with a
        precomputed reference, ref_chosen and ref_rejected (per pair), for KTO the
        mismatched rows of its KL term (kl_input_ids, kl_labels, kl_position_ids, kl_example_ids)."""
        enc, offsets = self.encoded, self.encoded.offsets
        # occurrence j of the batch (a unit may come twice, in another epoch's order): its examples and the
        # segment of each; pairs: chosen j -> j, rejected j -> P + j
        occurrences = [u for group in unit_groups for u in group]
        count = len(occurrences)
        placed = []  # (segment, example) per example of the batch, in row order when packed
        for j, unit in enumerate(occurrences):
            for k, example in enumerate(range(int(self.units[unit]), int(self.units[unit + 1]))):
                placed.append((k * count + j if self.paired else j, example))
        by_segment = sorted(placed)
        if self.packed:
            rows, at = [], 0
            for group in unit_groups:
                size = sum(int(self.units[u + 1] - self.units[u]) for u in group)
                rows.append(placed[at:at + size])
                at += size
        else:  # one example a row, in segment order (chosen rows first)
            rows = [[item] for item in by_segment]
        pieces = [[(segment, enc.ids[offsets[e]:offsets[e + 1]], enc.labels[offsets[e]:offsets[e + 1]])
                   for segment, e in items] for items in rows]
        input_ids, labels, positions, example_ids = fill_rows(pieces, self.seq_len, enc.pad_id)
        arrays = {"input_ids": input_ids, "labels": labels, "position_ids": positions, "example_ids": example_ids,
                  "desirable": np.asarray([bool(enc.desirable[example]) for _, example in by_segment])}
        if self.paired:
            group_of = self.groups_of(unit_groups)
            arrays["margin"] = np.nan_to_num(np.asarray(enc.margins, dtype=np.float32)[group_of], nan=0.0)
            if self.reference is not None:  # the reference's log-prob sums, computed before training
                arrays["ref_chosen"] = np.ascontiguousarray(self.reference[group_of, 0])
                arrays["ref_rejected"] = np.ascontiguousarray(self.reference[group_of, 1])
        else:
            arrays.update(self._kl_rows([example for _, example in by_segment]))
        return arrays

    def _kl_rows(self, examples: list[int]) -> dict[str, np.ndarray]:
        """KTO's KL term: segment j is example j's prompt followed by the completion of example
        kto_mismatched_order(N)[j] (cut to seq_len), laid out as the batch is (packed or a row each),
        under the keys kl_input_ids, kl_labels, kl_position_ids, kl_example_ids."""
        enc, offsets = self.encoded, self.encoded.offsets
        parts = []  # (prompt ids, completion ids, completion labels) per example
        for example in examples:
            ids = enc.ids[offsets[example]:offsets[example + 1]]
            labels = enc.labels[offsets[example]:offsets[example + 1]]
            first = int(np.argmax(labels != IGNORE))  # every stored example has a label
            parts.append((ids[:first], ids[first:], labels[first:]))
        pieces = []
        for j, other in enumerate(kto_mismatched_order(len(examples))):
            prompt, (_, completion, completion_labels) = parts[j][0], parts[other]
            ids = np.concatenate([prompt, completion])[:self.seq_len]
            labels = np.concatenate([np.full(len(prompt), IGNORE), completion_labels])[:self.seq_len]
            pieces.append((j, ids, labels))
        if self.packed:
            items, row_offsets = pack_rows(np.asarray([len(ids) for _, ids, _ in pieces]), self.seq_len, 0)
            rows = [[pieces[i] for i in items[a:b]] for a, b in zip(row_offsets[:-1], row_offsets[1:])]
        else:
            rows = [[piece] for piece in pieces]
        names = ("kl_input_ids", "kl_labels", "kl_position_ids", "kl_example_ids")
        return dict(zip(names, fill_rows(rows, self.seq_len, enc.pad_id)))


def fill_rows(rows: list[list[tuple[int, np.ndarray, np.ndarray]]], seq_len: int,
              pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, labels, position_ids, example_ids) of rows, each a list of (segment, ids, labels) placed
    one after another: positions restart at 0 per example (padding continues the last one), the label of
    each example's first token is -100 (never predicted from the example before), example_ids -1 on padding."""
    shape = (len(rows), seq_len)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    labels = np.full(shape, IGNORE, dtype=np.int64)
    positions = np.empty(shape, dtype=np.int64)
    example_ids = np.full(shape, -1, dtype=np.int64)
    for row, items in enumerate(rows):
        at = 0
        for segment, ids, example_labels in items:
            end = at + len(ids)
            input_ids[row, at:end] = ids
            labels[row, at + 1:end] = example_labels[1:]
            positions[row, at:] = np.arange(seq_len - at)
            example_ids[row, at:end] = segment
            at = end
    return input_ids, labels, positions, example_ids
