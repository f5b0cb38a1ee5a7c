"""Tokenize once: the rows of a jsonl/json/parquet/datasets source encoded by their format, cached.

The cache key hashes everything that decides the arrays: the data files' contents, the tokenizer
(its vocabulary, merges, special tokens and chat template), the format, the field names, the chat
template file, the split and seq_len. An entry is a directory <cache_dir>/<key>/ of .npy arrays and
meta.json, written under a temporary name and renamed into place, so a reader finds a whole entry
or none. `dstrain run` fills it before the ranks start (the dry run too: it is a cache, not run
output); ranks that still find none (another node's disk) encode the same rows and the first
rename wins. A cache directory that cannot be written only costs the encoding again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from dstrain.config.schema import DataConfig
from dstrain.data import records
from dstrain.data.formats import Encoded, Encoder, encode_prompt_response, encode_text, load_encoder
from dstrain.errors import UserError

CACHE_VERSION = 2  # raise when the encoding changes, so old entries are not read
ARRAYS = ("tokens", "ids", "labels", "offsets", "groups", "desirable", "margins")


def cache_root(data: DataConfig) -> Path:
    if data.cache_dir:
        return Path(data.cache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dstrain" / "tokenized"


def cache_key(data: DataConfig, encoder: Encoder) -> str:
    from dstrain.data.templates import named_or_file, uses_template
    template = named_or_file(data.chat_template).encode() if data.chat_template and uses_template(data) else b""
    facts = {"version": CACHE_VERSION, "source": data.source, "format": data.format,
             "fields": data.fields.model_dump(), "split": data.split, "seq_len": data.seq_len,
             "files": records.fingerprint(data), "tokenizer": encoder.fingerprint(),
             "chat_template": hashlib.sha256(template).hexdigest()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def encode_rows(data: DataConfig, encoder: Encoder) -> Encoded:
    """Read every row and encode it by data.format (no cache)."""
    rows = list(records.read_rows(data))
    if not rows:
        raise UserError.single("the data files hold no rows", "data.paths", "check the files")
    if data.format == "text":
        return encode_text(rows, data, encoder)
    if data.format == "prompt_response":
        return encode_prompt_response(rows, data, encoder)
    if data.format == "preference":
        from dstrain.data.preference import encode_preference
        return encode_preference(rows, data, encoder)
    from dstrain.data import layouts
    if data.format == "alpaca":
        return layouts.encode_alpaca(rows, data, encoder)
    if data.format == "sharegpt":
        return layouts.encode_sharegpt(rows, data, encoder)
    from dstrain.data.chat import encode_chat
    return encode_chat(rows, data, encoder)


def load_encoded(data: DataConfig) -> Encoded:
    """The encoded rows: from the cache when an entry for exactly this data exists, else encoded and cached."""
    encoder = load_encoder(data)
    from dstrain.data.templates import uses_template
    if uses_template(data):  # before hashing: a missing template is the user's error, not a cache miss
        from dstrain.data.chat import chat_template
        chat_template(data, encoder, data.format)
    entry = cache_root(data) / cache_key(data, encoder)
    if (entry / "meta.json").is_file():
        return _read(entry)
    encoded = encode_rows(data, encoder)
    _write(entry, encoded)
    return encoded


def _read(entry: Path) -> Encoded:
    meta = json.loads((entry / "meta.json").read_text())
    arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in ARRAYS if name in meta["arrays"]}
    return Encoded(meta["format"], meta["pad_id"], stats=meta["stats"], **arrays)


def _write(entry: Path, encoded: Encoded) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError:
        return
    try:
        present = [name for name in ARRAYS if getattr(encoded, name) is not None]
        for name in present:
            np.save(staging / f"{name}.npy", getattr(encoded, name))
        meta = {"format": encoded.format, "pad_id": encoded.pad_id, "stats": encoded.stats, "arrays": present}
        (staging / "meta.json").write_text(json.dumps(meta))  # last: an entry without it is never read
        os.rename(staging, entry)
    except OSError:  # another process renamed its copy first, or the disk is full: ours is not needed
        shutil.rmtree(staging, ignore_errors=True)
