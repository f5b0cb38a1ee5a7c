"""Rows of data files: jsonl, json (an array of objects), parquet, and directories written by the
`datasets` package's save_to_disk. Each row comes with where it was read (file and line or row
number), so a bad row is reported where the user can find it.

Files are read in the order `data.paths` names them (each glob's matches sorted), rows in file
order: the same sequence on every rank and every run. pyarrow and datasets are optional (the
`data` extra); a missing one is a clear error naming the package.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path
from typing import Iterator

from dstrain.config.schema import DataConfig
from dstrain.data.sources import expand_paths
from dstrain.errors import Problem, UserError, require_package

ROW_SOURCES = ("jsonl", "json", "parquet", "datasets")


def data_files(config: DataConfig) -> list[Path]:
    """The files (directories, for "datasets") that `data.paths` names, in a fixed order."""
    if config.source != "datasets":
        return expand_paths(config.paths, "data.paths")
    dirs, problems = [], []
    for pattern in config.paths:
        matches = [Path(m) for m in sorted(glob.glob(pattern, recursive=True)) if Path(m).is_dir()]
        if not matches:
            problems.append(Problem(f"no directory matches {pattern!r}", "data.paths",
                                    "name a directory written by datasets' save_to_disk"))
        dirs += matches
    if problems:
        raise UserError(problems)
    if not dirs:
        raise UserError.single("no data directories given", "data.paths", "set data.paths to save_to_disk directories")
    return dirs


def read_rows(config: DataConfig) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of every file, in order; `where` is "FILE line N" or "FILE row N"."""
    reader = {"jsonl": _jsonl_rows, "json": _json_rows, "parquet": _parquet_rows, "datasets": _dataset_rows}
    for path in data_files(config):
        try:
            yield from reader[config.source](path, config)
        except UnicodeDecodeError as err:
            raise UserError.single(f"not UTF-8 text (byte {err.start}: {err.reason})", str(path),
                                   "save the file as UTF-8") from None


def fingerprint(config: DataConfig) -> list[tuple[str, str]]:
    """(path, sha256 of the contents) of every file read: the cache key's part for the data."""
    result = []
    for path in data_files(config):
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0")
            with f.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        result.append((str(path), digest.hexdigest()))
    return result


def _not_an_object(where: str, value) -> UserError:
    return UserError.single(f"a row must be a JSON object, got {type(value).__name__}", where,
                            'write one object per row, e.g. {"prompt": "...", "response": "..."}')


def _jsonl_rows(path: Path, _config: DataConfig) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8-sig") as handle:  # -sig: a byte-order mark is not part of the first row
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) hold no row
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError.single(f"not valid JSON: {err.msg} at column {err.colno}", where,
                                       "fix that line: one JSON object per line") from None
            if not isinstance(row, dict):
                raise _not_an_object(where, row)
            yield where, row


def _json_rows(path: Path, _config: DataConfig) -> Iterator[tuple[str, dict]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise UserError.single(f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}", str(path),
                               "fix the file, or use data.source=jsonl for one JSON object per line") from None
    if not isinstance(rows, list):
        raise UserError.single(f"the file holds a JSON {type(rows).__name__}, not an array of rows", str(path),
                               "write [{...}, {...}], or use data.source=jsonl for one object per line")
    for number, row in enumerate(rows, start=1):
        where = f"{path} row {number}"
        if not isinstance(row, dict):
            raise _not_an_object(where, row)
        yield where, row


def _parquet_rows(path: Path, _config: DataConfig) -> Iterator[tuple[str, dict]]:
    pq = require_package("pyarrow.parquet", "data.source: parquet", "data")
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - a file pyarrow cannot read is the user's input
        raise UserError.single(f"not a readable parquet file: {err}", str(path), "check the file") from None
    number = 0
    for batch in table.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield f"{path} row {number}", row


def _dataset_rows(path: Path, config: DataConfig) -> Iterator[tuple[str, dict]]:
    datasets = require_package("datasets", "data.source: datasets", "data")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - a directory datasets cannot read is the user's input
        raise UserError.single(f"not a datasets directory: {type(err).__name__}: {err}", str(path),
                               "name a directory written by Dataset.save_to_disk or DatasetDict.save_to_disk")
    if isinstance(loaded, datasets.DatasetDict):
        if config.split not in loaded:
            raise UserError.single(f"no split {config.split!r} (it has: {', '.join(loaded)})", f"{path}: data.split",
                                   f"set data.split to one of {', '.join(loaded)}")
        loaded = loaded[config.split]
    for number, row in enumerate(loaded, start=1):
        yield f"{path} row {number}", row
