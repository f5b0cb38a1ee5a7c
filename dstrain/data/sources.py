"""Token sources: where the bytes or token ids come from.

A source is a 1-D integer array (numpy, possibly a memmap) of the whole token stream, split into
a train part and a held-out eval part at the end. The embedded corpus is Python's own standard
library source: real text that is on every machine with Python, no download needed.
"""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import numpy as np

from dstrain.config.schema import DataConfig
from dstrain.errors import UserError


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


def _expand(paths: list[str], key: str) -> list[Path]:
    files: list[Path] = []
    for pattern in paths:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise UserError.single(f"no file matches {pattern!r}", key, "check the path or glob pattern")
        files += [Path(m) for m in matches if Path(m).is_file()]
    if not files:
        raise UserError.single("no data files given", key, "set data.paths to files or glob patterns")
    return files


def text_tokens(config: DataConfig) -> np.ndarray:
    """Text files, byte-level or through a Hugging Face tokenizer named in data.tokenizer."""
    files = _expand(config.paths, "data.paths")
    if config.tokenizer == "byte":
        return np.frombuffer(b"\n".join(f.read_bytes() for f in files), dtype=np.uint8)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError.single(f"tokenizer {config.tokenizer!r} needs the transformers package", "data.tokenizer",
                               "pip install transformers, or use tokenizer: byte")
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    ids = tokenizer("\n".join(f.read_text(errors="replace") for f in files))["input_ids"]
    return np.asarray(ids, dtype=np.uint32 if max(ids, default=0) >= 2**16 else np.uint16)


def token_file_tokens(config: DataConfig) -> np.ndarray:
    """nanoGPT-style token files (raw uint16/uint32 arrays), memory-mapped and concatenated."""
    files = _expand(config.paths, "data.paths")
    dtype = np.dtype(config.token_dtype)
    arrays = []
    for f in files:
        if f.stat().st_size % dtype.itemsize:
            raise UserError.single(f"size {f.stat().st_size} is not a multiple of {dtype.itemsize} bytes",
                                   f"data.paths: {f}", f"check data.token_dtype (is {config.token_dtype})")
        arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def load_tokens(config: DataConfig) -> np.ndarray:
    if config.source == "corpus":
        return corpus_tokens()
    if config.source == "text":
        return text_tokens(config)
    if config.source == "tokens":
        return token_file_tokens(config)
    raise UserError.single(f"unknown data source {config.source!r}", "data.source",
                           "use corpus, synthetic, text, tokens or an entry point 'module:function'")


def split(tokens: np.ndarray, eval_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and held-out parts: the last `eval_fraction` of the stream is held out."""
    cut = int(len(tokens) * (1.0 - eval_fraction))
    train, held_out = tokens[:cut], tokens[cut:]
    for name, part in (("train", train), ("held-out", held_out)):
        if len(part) < seq_len + 1:
            raise UserError.single(f"the {name} split has {len(part)} tokens, fewer than one sequence of "
                                   f"{seq_len + 1}", "data.seq_len / data.eval_fraction",
                                   "use more data, a shorter data.seq_len or another data.eval_fraction")
    return train, held_out
