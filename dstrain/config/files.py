"""Reading config files and `--set` overrides into plain dicts, with errors a user can act on."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

import yaml

from dstrain.errors import UserError

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
MAX_DEPTH = 32  # far deeper than any real config; keeps deepcopy/merge/flatten clear of RecursionError
MAX_VALUES = 100_000  # YAML aliases can expand a small file into billions of values ("billion laughs")
MAX_INT = 2**63  # torch and DeepSpeed count in int64; larger numbers are typos, and Python cannot print >4300 digits


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file whose root is a mapping. `what` names the file's role in messages."""
    where = f"{what} {path}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError.single("file not found", where, "check the path (relative paths start at the current directory)")
    except IsADirectoryError:
        raise UserError.single("is a directory, not a file", where, "name a .yaml or .json file")
    except OSError as err:
        raise UserError.single(f"cannot read: {err.strerror}", where, "check the file's permissions")
    try:
        text = raw.decode("utf-8-sig")  # Windows editors start files with a BOM
    except UnicodeDecodeError as err:
        raise UserError.single(f"not UTF-8 text (byte {err.start} is {raw[err.start]:#04x}); is it a binary file?",
                               where, "name a YAML or JSON text file")
    if "\x00" in text:
        raise UserError.single("contains NUL bytes; is it a binary file?", where, "name a YAML or JSON text file")
    if not text.strip():
        raise UserError.single("file is empty", where, "write the settings to override, e.g. 'train:\\n  max_steps: 100'")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise UserError.single(f"JSON syntax error at line {err.lineno}, column {err.colno}: {err.msg}", where,
                               "fix the JSON syntax (a trailing comma or a missing quote is the usual cause)")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError.single(f"YAML syntax error{at}: {problem}", where,
                               "fix the YAML syntax (indentation with spaces, 'key: value' pairs)")
    except RecursionError:
        raise UserError.single("nested too deeply to read", where, "flatten the file")
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise UserError.single(f"cannot read a value: {str(err).split(';')[0]}", where,
                               "write numbers of at most 19 digits")
    if data is None:
        raise UserError.single("file holds no settings (only comments?)", where, "add settings or drop the file")
    if not isinstance(data, dict):
        raise UserError.single(f"the top level must be a mapping of keys to values, not a {_kind(data)}", where,
                               "write 'key: value' lines at the top level, e.g. 'train:\\n  max_steps: 100'")
    return plain(data, where)


def read_deepspeed_json(path: Path, what: str) -> tuple[dict[str, Any], str | None]:
    """A DeepSpeed config file. DeepSpeed reads config files with hjson, which also takes comments and
    trailing commas; such a file is read the same way, with a note. Returns (data, note or None)."""
    try:
        return read_mapping(path, what), None
    except UserError as err:
        first = err.problems[0].message if err.problems else ""
        if path.suffix.lower() != ".json" or not first.startswith("JSON syntax error"):
            raise
        data = _read_hjson(path)
        if not isinstance(data, dict):
            raise
    note = (f"{what} {path}: not strict JSON ({first}); read as DeepSpeed reads config files (hjson), "
            "but tools that read it with Python's json module would refuse it")
    return plain(data, f"{what} {path}"), note


def _read_hjson(path: Path) -> Any:
    try:
        import hjson  # DeepSpeed's own dependency, so present wherever DeepSpeed is
    except ImportError:
        return None
    try:
        return hjson.loads(path.read_text(encoding="utf-8-sig"))
    except Exception:  # noqa: BLE001 - hjson raises several kinds; the JSON error is reported instead
        return None


def plain(value: Any, where: str, path: str = "", depth: int = 0, count: list[int] | None = None) -> Any:
    """`value` as JSON-compatible data: string keys at every depth, dates as ISO strings, finite-size ints.

    YAML can produce what DeepSpeed's JSON cannot hold (unquoted dates, !!binary, !!set, 1: keys);
    each is reported with its key path instead of failing later while printing or saving the JSON.
    """
    at = f"{where}: {path}" if path else where
    count = [0] if count is None else count
    count[0] += 1
    if count[0] > MAX_VALUES:
        raise UserError.single(f"more than {MAX_VALUES:,} values (YAML aliases expanding?)", where,
                               "write the settings out; a run config holds a few hundred values")
    if depth > MAX_DEPTH:
        raise UserError.single(f"nested more than {MAX_DEPTH} levels deep", at, "flatten the settings")
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            if not isinstance(key, str):
                raise UserError.single(f"keys must be strings, found {key!r}", at or where,
                                       f"quote the key: '\"{key}\": ...'")
            _check_text(key, at or where)
            out[key] = plain(sub, where, f"{path}.{key}" if path else key, depth + 1, count)
        return out
    if isinstance(value, (list, tuple)):  # tuples come from YAML's !!omap / !!pairs
        return [plain(sub, where, f"{path}[{i}]", depth + 1, count) for i, sub in enumerate(value)]
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()  # an unquoted 2024-01-01 was meant as text
    if isinstance(value, str):
        _check_text(value, at)
        return value
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        if abs(value) >= MAX_INT:
            raise UserError.single("number too large (more than 64 bits)", at, "write a smaller number")
        return value
    raise UserError.single(f"unsupported value of type {type(value).__name__} (a YAML !!tag?)", at,
                           "write a plain string, number, boolean, list or mapping")


def _check_text(text: str, at: str) -> None:
    """YAML's "\\ud800" escapes make lone surrogates: text that no UTF-8 or JSON file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError.single(f"text {text[:40]!r} is not valid Unicode (a lone surrogate at character {err.start})",
                               at, "write the character itself, or a \\U escape of a real code point")


def parse_value(text: str) -> Any:
    """Parse a `--set` value: numbers (5e8 too), true/false/null, [lists], {maps}, else a string."""
    stripped = text.strip()
    if _NUMBER.match(stripped):
        if len(stripped) > 100:  # int() refuses > 4300 digits; the schema or plain() reports the text
            return text
        number = float(stripped)
        is_int_text = re.match(r"^[+-]?\d+$", stripped)
        return int(stripped) if is_int_text else (int(number) if number.is_integer() and abs(number) >= 1e3 else number)
    try:
        value = yaml.safe_load(stripped) if stripped else ""
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (bool, list, dict)) or value is None else text


def parse_sets(items: list[str]) -> dict[str, Any]:
    """Turn ["train.lr=3e-4", ...] into a nested dict; later items win."""
    out: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or any(not p for p in parts):
            problems.append((f"--set {item!r}", "expected KEY.PATH=VALUE", "e.g. --set train.max_steps=100"))
            continue
        try:
            parsed = plain(parse_value(value), f"--set {item!r}")
        except UserError as err:
            problems += [(p.where, p.message, p.fix) for p in err.problems]
            continue
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = parsed
    if problems:
        from dstrain.errors import Problem
        raise UserError([Problem(msg, where, fix) for where, msg, fix in problems])
    return out


def _kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), type(value).__name__)
