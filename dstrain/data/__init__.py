"""Training and evaluation data: token sources and the deterministic, resumable sampler."""

from __future__ import annotations

from dstrain.config.schema import RunConfig


def build_samplers(config: RunConfig):
    """(train, eval) samplers for the configured data source; see `sampler.py` for the order."""
    from dstrain.data import sampler as S
    from dstrain.data.sources import load_tokens, split
    from dstrain.entrypoints import is_entry_point, load_entry_point

    data, seed = config.data, config.train.seed
    if data.source == "synthetic":
        return (S.SyntheticSampler(config.model.vocab_size, data.seq_len, seed),
                S.SyntheticSampler(config.model.vocab_size, data.seq_len, seed + 1))
    if is_entry_point(data.source):
        import torch.utils.data as tud
        from dstrain.errors import UserError
        dataset = load_entry_point(data.source, "data.source")(**data.kwargs)
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise UserError.single("the entry point must return a map-style torch Dataset (with __len__ and __getitem__)",
                                   "data.source", "return e.g. a torch.utils.data.TensorDataset")
        cut = int(len(dataset) * (1.0 - data.eval_fraction))
        if cut < 1 or cut >= len(dataset):
            raise UserError.single(f"the dataset has {len(dataset)} items: too few to hold out "
                                   f"{data.eval_fraction:.0%}", "data.eval_fraction", "use a larger dataset")
        return (S.DatasetSampler(tud.Subset(dataset, range(cut)), seed),
                S.DatasetSampler(tud.Subset(dataset, range(cut, len(dataset))), seed + 1))
    train, held_out = split(load_tokens(data), data.eval_fraction, data.seq_len)
    return S.WindowSampler(train, data.seq_len, seed), S.WindowSampler(held_out, data.seq_len, seed + 1)
