"""Training and evaluation data: token sources and the deterministic, resumable sampler."""

from __future__ import annotations

from dstrain.config.schema import RunConfig
from dstrain.errors import UserError

SOURCES_HINT = "use corpus, synthetic, text, tokens or an entry point 'module:function'"


def check_source(config: RunConfig) -> None:
    """What can be checked before any rank starts, cheaply: the entry point imports, the files
    exist and have whole tokens, the tokenizer's package is installed, both splits hold a window."""
    import importlib.util
    from dstrain.data import sources
    from dstrain.entrypoints import is_entry_point, load_entry_point

    data = config.data
    if is_entry_point(data.source):
        load_entry_point(data.source, "data.source")
        return
    if data.source not in ("corpus", "synthetic", "text", "tokens"):
        raise UserError.single(f"unknown data source {data.source!r}", "data.source", SOURCES_HINT)
    if data.source == "text" and data.tokenizer != "byte" and importlib.util.find_spec("transformers") is None:
        raise UserError.single(f"tokenizer {data.tokenizer!r} needs the transformers package", "data.tokenizer",
                               "pip install transformers, or use tokenizer: byte")
    if data.source == "text":
        sources._expand(data.paths, "data.paths")
    length = sources.stream_length(data)
    if length is not None:
        sources.split_point(length, data.eval_fraction, data.seq_len)


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
    train, held_out = split(load_tokens(data), data.eval_fraction, data.seq_len)
    # Only the built-in GPT reads model.vocab_size; a user model sizes its own embedding.
    vocab = config.model.vocab_size if config.model.name == "gpt" else None
    return (S.WindowSampler(train, data.seq_len, seed, vocab),
            S.WindowSampler(held_out, data.seq_len, seed + 1, vocab))
