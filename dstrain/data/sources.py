"""Token sources: where the bytes or token ids come from.

A source is a 1-D integer array (numpy, a memmap, or `ConcatTokens` over several memmaps) of
the whole token stream, split into a train part and a held-out eval part at the end. The embedded
corpus is Python's own standard library source: real text that is on every machine with Python,
no download needed.
"""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import numpy as np

from dstrain.config.schema import DataConfig
from dstrain.errors import Problem, UserError


def corpus_files() -> list[Path]:
    """The embedded corpus: the standard library's top-level .py files, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def corpus_tokens() -> np.ndarray:
    """The embedded corpus as bytes (vocab 256), files joined in sorted order."""
    chunks = [path.read_bytes() for path in corpus_files()]
    if not chunks:
        raise UserError.single("the embedded corpus is empty: no standard-library sources found",
                               "data.source", "use data.source=text with data.paths, or data.source=synthetic")
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def expand_paths(paths: list[str], key: str) -> list[Path]:
    """Files named by `paths` (files or glob patterns, `**` recursive), in the order given,
    each pattern's matches sorted: the same list on every rank and every run."""
    files: list[Path] = []
    problems = []
    for pattern in paths:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            problems.append(Problem(f"no file matches {pattern!r}", key, "check the path or glob pattern"))
        elif not any(Path(m).is_file() for m in matches):
            problems.append(Problem(f"{pattern!r} matches only directories", key,
                                    f"name the files, e.g. '{pattern.rstrip('/')}/*.txt'"))
        files += [Path(m) for m in matches if Path(m).is_file()]
    if problems:
        raise UserError(problems)
    if not files:
        raise UserError.single("no data files given", key, "set data.paths to files or glob patterns")
    return files


def text_tokens(config: DataConfig) -> np.ndarray:
    """Text files, byte-level or through a Hugging Face tokenizer named in data.tokenizer (unset: byte;
    `dstrain.data.data_config` resolves an hf: model's own). Files are joined in `expand_paths` order:
    byte-level with a newline between them, tokenized with the tokenizer's end-of-text token after
    each (as nanoGPT's prepare scripts do)."""
    files = expand_paths(config.paths, "data.paths")
    if config.tokenizer in (None, "byte"):
        return np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)
    tokenizer = load_tokenizer(config.tokenizer)
    ids: list[int] = []
    for f in files:
        ids += tokenizer(f.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=np.uint32 if max(ids, default=0) >= 2**16 else np.uint16)


def load_tokenizer(name: str):
    """A Hugging Face tokenizer by name or local path; transformers is optional, so a clear error without it."""
    try:
        import transformers
    except ImportError:
        raise UserError.single(f"tokenizer {name!r} needs the transformers package", "data.tokenizer",
                               "pip install transformers, or use tokenizer: byte") from None
    transformers.logging.set_verbosity_error()  # whole files exceed the model's context: expected here
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except Exception as err:  # noqa: BLE001 - a name that does not load is the user's input
        path = Path(name)
        if path.is_dir() and not any(path.glob("tokenizer*")) and not any(path.glob("vocab*")):
            raise UserError.single(f"{path} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                                   "vocab...)", "data.tokenizer", "save the tokenizer next to the model "
                                   "(tokenizer.save_pretrained), or set data.tokenizer to one (or byte)") from None
        raise UserError.single(f"cannot load tokenizer {name!r}: {type(err).__name__}: {err}", "data.tokenizer",
                               "give a Hugging Face tokenizer name or a local directory holding one") from None


class ConcatTokens:
    """Several token arrays read as one stream without copying them into memory.

    Slicing returns another lazy stream; `np.asarray` materialises only what was sliced
    (one window at a time in the sampler), so a 20 GB nanoGPT train.bin plus its val.bin
    stay memory-mapped.
    """

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.dtype = self.parts[0].dtype if self.parts else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> "ConcatTokens":
        if not isinstance(key, slice):
            raise TypeError("ConcatTokens supports slices only")
        start, stop, step = key.indices(len(self))
        assert step == 1, "token streams are sliced contiguously"
        pieces = []
        for part, first in zip(self.parts, self.starts[:-1]):
            lo, hi = max(start - first, 0), min(stop - first, len(part))
            if lo < hi:
                pieces.append(part[lo:hi])
        return ConcatTokens(pieces)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
        return joined.astype(dtype) if dtype is not None else joined


def _token_file_lengths(config: DataConfig) -> list[tuple[Path, int]]:
    """(file, token count) of each "tokens" file; every size must be a whole number of tokens."""
    dtype = np.dtype(config.token_dtype)
    lengths, problems = [], []
    for f in expand_paths(config.paths, "data.paths"):
        size = f.stat().st_size
        if size % dtype.itemsize:
            problems.append(Problem(f"size {size} bytes is not a whole number of {config.token_dtype} tokens",
                                    f"data.paths: {f}", "check data.token_dtype (uint16 or uint32)"))
        lengths.append((f, size // dtype.itemsize))
    if problems:
        raise UserError(problems)
    return lengths


def token_file_tokens(config: DataConfig) -> np.ndarray | ConcatTokens:
    """nanoGPT-style token files (raw uint16/uint32 arrays), memory-mapped and read as one stream."""
    dtype = np.dtype(config.token_dtype)
    arrays = [np.memmap(f, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
              for f, n in _token_file_lengths(config)]
    return arrays[0] if len(arrays) == 1 else ConcatTokens(arrays)


def load_tokens(config: DataConfig) -> np.ndarray | ConcatTokens:
    if config.source == "corpus":
        return corpus_tokens()
    if config.source == "text":
        return text_tokens(config)
    if config.source == "tokens":
        return token_file_tokens(config)
    raise UserError.single(f"unknown data source {config.source!r}", "data.source",
                           "use corpus, synthetic, text, tokens or an entry point 'module:function'")


def stream_length(config: DataConfig) -> int | None:
    """Tokens in the stream, from file sizes alone (no reading); None when only tokenizing would tell."""
    if config.source == "corpus":
        files = corpus_files()
        return sum(f.stat().st_size for f in files) + max(len(files) - 1, 0)
    if config.source == "text" and config.tokenizer in (None, "byte"):
        files = expand_paths(config.paths, "data.paths")
        return sum(f.stat().st_size for f in files) + len(files) - 1
    if config.source == "tokens":
        return sum(n for _, n in _token_file_lengths(config))
    return None


def split_point(length: int, eval_fraction: float, seq_len: int) -> int:
    """Where the held-out part starts; both parts must hold at least one (input, target) window."""
    cut = int(length * (1.0 - eval_fraction))
    for name, size in (("train", cut), ("held-out", length - cut)):
        if size < seq_len + 1:
            raise UserError.single(f"the {name} split has {size} tokens, fewer than one sequence of "
                                   f"{seq_len + 1}", "data.seq_len / data.eval_fraction",
                                   "use more data, a shorter data.seq_len or another data.eval_fraction")
    return cut


def split(tokens, eval_fraction: float, seq_len: int):
    """Train and held-out parts: the last `eval_fraction` of the stream is held out. Slices, so a
    memory-mapped stream stays on disk."""
    cut = split_point(len(tokens), eval_fraction, seq_len)
    return tokens[:cut], tokens[cut:]
