"""Training and evaluation data: token sources, row sources and the deterministic, resumable sampler.

The batch contract (what forward(batch) receives, moved to the device):
- Token sources ("corpus", "synthetic", "text", "tokens"): a tuple (inputs, targets) of int64
  tensors [micro, seq_len], targets = inputs shifted left by one (the next token).
- Row sources ("jsonl", "json", "parquet", "datasets"): a dict {"input_ids", "labels"} of int64
  tensors [micro, seq_len]. labels are ALIGNED with input_ids (labels[b, t] is the token at t, or
  -100 where no loss is taken: prompts, non-assistant turns, padding); the model shifts, predicting
  labels[:, t + 1] from position t, as Hugging Face causal LMs do with `labels=`. The loss is the
  mean over positions whose label is not -100. There is no attention_mask: "text" windows are full,
  and examples are right-padded, so under causal attention no real token sees a pad.
  With data.packing on (dstrain.models.packing decides "auto"), a row holds several examples and
  the dict also has "position_ids" [micro, seq_len], restarting at 0 where each example starts:
  the model must attend within each example only. Each example's first label is -100, so no
  example is predicted from the one before it; a row's loss is then its examples' losses summed.
- Format "preference" (train.objective dpo, simpo, orpo, kto, reward): {"input_ids", "labels",
  "position_ids", "example_ids", "desirable"} and, for pairs, "margin" (dstrain.data.preference):
  whole pairs packed into rows (or one example a row, chosen rows first), example_ids the segment of
  each token (chosen completion p of the batch's P pairs: p, its rejected one: P + p; KTO example k: k;
  -1 on padding), desirable per segment, margin per pair; KTO batches add kl_input_ids, kl_labels,
  kl_position_ids and kl_example_ids (each prompt with another example's completion, for the KL term).
  A micro batch counts rows when packed, pairs (two rows each) or KTO examples when not.
- An entry-point Dataset: whatever default_collate makes of its items.
The built-in GPT accepts both of the first two.
"""

from __future__ import annotations

from dstrain.config.schema import DataConfig, RunConfig
from dstrain.errors import UserError

SOURCES_HINT = "use corpus, synthetic, text, tokens, jsonl, json, parquet, datasets or an entry point 'module:function'"
TOKEN_SOURCES = ("corpus", "synthetic", "text", "tokens")
HF_PREFIX = "hf:"  # model.name "hf:<directory or hub id>": a Hugging Face causal LM


def data_config(config: RunConfig) -> DataConfig:
    """The data section with data.tokenizer resolved: as set, else the model's own for "hf:" models, else byte."""
    data = config.data
    if data.tokenizer is not None:
        return data
    model = config.model.name
    return data.model_copy(update={"tokenizer": model[len(HF_PREFIX):] if model.startswith(HF_PREFIX) else "byte"})


def check_source(config: RunConfig) -> list[str]:
    """What can be checked before any rank starts, cheaply: the entry point imports, the files
    exist and have whole tokens, the tokenizer's package is installed, both splits hold a window.
    Row sources are read and tokenized in full here (and cached: the ranks then only load), so a bad
    row stops the run before it starts. Returns warnings (examples cut to seq_len, say)."""
    import importlib.util
    from dstrain.data import sources
    from dstrain.data.records import ROW_SOURCES
    from dstrain.entrypoints import is_entry_point, load_entry_point

    data = data_config(config)
    if is_entry_point(data.source):
        load_entry_point(data.source, "data.source")
        return []
    if data.source not in TOKEN_SOURCES + ROW_SOURCES:
        raise UserError.single(f"unknown data source {data.source!r}", "data.source", SOURCES_HINT)
    if data.source in ROW_SOURCES:
        return _check_rows(config, data)
    if data.format != "text":
        raise UserError.single(f"data.format {data.format!r} reads rows of data files, but data.source "
                               f"{data.source!r} is a token stream", "data.format",
                               "use data.source jsonl, json, parquet or datasets for prompt/response or chat rows")
    if data.source == "text" and data.tokenizer != "byte" and importlib.util.find_spec("transformers") is None:
        raise UserError.single(f"tokenizer {data.tokenizer!r} needs the transformers package", "data.tokenizer",
                               "pip install transformers, or use tokenizer: byte")
    if data.source == "text":
        sources.expand_paths(data.paths, "data.paths")
    length = sources.stream_length(data)
    if length is not None:
        sources.split_point(length, data.eval_fraction, data.seq_len)
    return []


def _check_rows(config: RunConfig, data: DataConfig) -> list[str]:
    """Encode (or load from the cache) the rows; both splits must hold a sample; token ids must fit the built-in GPT."""
    from dstrain.data.tokenized import load_encoded
    encoded = load_encoded(data)
    split_encoded(encoded, data)
    _check_preference_rows(config, encoded)
    if config.model.name == "gpt" and encoded.max_id() >= config.model.vocab_size:
        raise UserError.single(f"the tokenized data holds token id {encoded.max_id()}, but model.vocab_size is "
                               f"{config.model.vocab_size}", "model.vocab_size",
                               f"set model.vocab_size to at least {encoded.max_id() + 1} (the tokenizer's vocabulary)")
    stats, warnings = encoded.stats, []
    pairs = encoded.groups is not None
    if stats.get("truncated") and pairs:
        warnings.append(f"{stats['truncated']} completions are cut so that each pair fits one row of data.seq_len="
                        f"{data.seq_len} (the longest pair: {stats['longest']} tokens)")
    elif stats.get("truncated"):
        warnings.append(f"{stats['truncated']} of {stats['rows']} examples are longer than data.seq_len="
                        f"{data.seq_len} (the longest: {stats['longest']} tokens) and are cut to it")
    if stats.get("dropped"):
        what = "rows have a completion" if pairs else "examples have no response or assistant token"
        warnings.append(f"{stats['dropped']} {what} with no token left within data.seq_len and are left out"
                        if pairs else f"{stats['dropped']} {what} left within data.seq_len and are left out")
    from dstrain.data.templates import check_markers, uses_template
    if data.chat_template is not None and not uses_template(data):
        warnings.append(f"data.chat_template is ignored by format {data.format!r} (it renders chat, sharegpt and "
                        "alpaca rows)")
    elif data.chat_template is not None and data.tokenizer != "byte":
        from dstrain.data.sources import load_tokenizer
        warnings += check_markers(data.chat_template, load_tokenizer(data.tokenizer))
    return warnings


def _check_preference_rows(config: RunConfig, encoded) -> None:
    """The paired objectives need pairs: a KTO row (prompt, completion, label) is an error naming the first."""
    from dstrain.config.preference import PAIRED_OBJECTIVES
    if encoded.groups is None or config.train.objective not in PAIRED_OBJECTIVES or not encoded.stats["unpaired"]:
        return
    raise UserError.single(f"train.objective {config.train.objective} trains on pairs, but {encoded.stats['unpaired']} "
                           "rows are unpaired completions (prompt, completion, label), the first here",
                           encoded.stats["first_unpaired"],
                           "give every row chosen and rejected completions, or set train.objective: kto")


def split_encoded(encoded, data: DataConfig):
    """(train, held-out) parts of encoded rows: the last eval_fraction of the packed stream ("text"),
    of the examples (other formats: offsets into ids) or of the groups ("preference": offsets into the
    examples), as for the token sources. Both must hold a sample."""
    from dstrain.data.sources import split
    if encoded.tokens is not None:
        return split(encoded.tokens, data.eval_fraction, data.seq_len)
    bounds = encoded.offsets if encoded.groups is None else encoded.groups  # a pair is never split
    examples = len(bounds) - 1
    what = "examples" if encoded.groups is None else "preference rows"
    cut = int(examples * (1.0 - data.eval_fraction))
    if cut < 1 or cut >= examples:
        raise UserError.single(f"{examples} {what} are too few to hold out {data.eval_fraction:.0%} and train on "
                               "the rest", "data.eval_fraction", "use more rows, or another data.eval_fraction")
    return bounds[:cut + 1], bounds[cut:]


def load_dataset(config: RunConfig):
    """A user's map-style Dataset from the data.source entry point, called with data.kwargs."""
    from dstrain.entrypoints import call_entry_point, load_entry_point

    data = config.data
    factory = load_entry_point(data.source, "data.source")
    dataset = call_entry_point(factory, data.source, "data.source", "data.kwargs", data.kwargs)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise UserError.single(f"{data.source} returned {type(dataset).__name__}, not a map-style Dataset "
                               "(with __len__ and __getitem__)", "data.source",
                               "return e.g. a torch.utils.data.TensorDataset")
    return dataset


def build_samplers(config: RunConfig):
    """(train, eval) samplers for the configured data source; see `sampler.py` for the order."""
    from dstrain.data import sampler as S
    from dstrain.data.records import ROW_SOURCES
    from dstrain.data.sources import load_tokens, split
    from dstrain.entrypoints import is_entry_point

    data, seed = config.data, config.train.seed
    if data.source == "synthetic":
        return (S.SyntheticSampler(config.model.vocab_size, data.seq_len, seed),
                S.SyntheticSampler(config.model.vocab_size, data.seq_len, seed + 1))
    if is_entry_point(data.source):
        import torch.utils.data as tud
        dataset = load_dataset(config)
        cut = int(len(dataset) * (1.0 - data.eval_fraction))
        if cut < 1 or cut >= len(dataset):
            raise UserError.single(f"the dataset has {len(dataset)} items: too few to hold out "
                                   f"{data.eval_fraction:.0%}", "data.eval_fraction", "use a larger dataset")
        return (S.DatasetSampler(tud.Subset(dataset, range(cut)), seed),
                S.DatasetSampler(tud.Subset(dataset, range(cut, len(dataset))), seed + 1))
    if data.source in ROW_SOURCES:
        # dstrain run resolves "auto" to true or false before the ranks start (dstrain.models.packing);
        # "auto" still here (a config frozen before packing existed) pads, as such runs did.
        return _row_samplers(data_config(config), seed, data.packing is True, config.train.objective)
    train, held_out = split(load_tokens(data_config(config)), data.eval_fraction, data.seq_len)
    # Only the built-in GPT reads model.vocab_size; a user model sizes its own embedding.
    vocab = config.model.vocab_size if config.model.name == "gpt" else None
    return (S.WindowSampler(train, data.seq_len, seed, vocab),
            S.WindowSampler(held_out, data.seq_len, seed + 1, vocab))


def _row_samplers(data: DataConfig, seed: int, packed: bool, objective: str = "lm"):
    from dstrain.data import sampler as S
    from dstrain.data.tokenized import load_encoded
    encoded = load_encoded(data)
    train, held_out = split_encoded(encoded, data)
    if encoded.groups is not None:  # format "preference": whole pairs (or KTO's examples) per row
        from dstrain.config.preference import PAIRED_OBJECTIVES
        paired = objective in PAIRED_OBJECTIVES
        return tuple(S.PreferenceSampler(encoded, groups, data.seq_len, seed + i, paired, packed)
                     for i, groups in enumerate((train, held_out)))
    if encoded.tokens is not None:
        return S.PackedSampler(train, data.seq_len, seed), S.PackedSampler(held_out, data.seq_len, seed + 1)
    rows = S.PackedExampleSampler if packed else S.ExampleSampler
    return tuple(rows(encoded.ids, encoded.labels, offsets, data.seq_len, encoded.pad_id, seed + i)
                 for i, offsets in enumerate((train, held_out)))
