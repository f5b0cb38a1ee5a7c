"""Repairs for environment problems that break DeepSpeed before training starts.

The launcher calls these before any rank starts, so this module must stay cheap to import:
no torch or deepspeed at module level.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from dstrain.switches import switched_off

ARCH_LIST_VAR = "TORCH_CUDA_ARCH_LIST"

# "9.0a", "10.0f+PTX": a numeric arch with a feature-set suffix. DeepSpeed 0.19 parses each
# entry with int() on both sides of the dot, so the suffix letters crash its JIT op build.
_SUFFIXED_ARCH = re.compile(r"^(\d+\.\d+)[A-Za-z]+(\+PTX)?$")
_ARCH_SEPARATORS = re.compile(r"[;,\s]+")


def sanitize_cuda_arch_list(env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """Return a copy of `env` whose TORCH_CUDA_ARCH_LIST DeepSpeed's JIT build can parse.

    Suffix letters are stripped ("9.0a" -> "9.0", "10.0a+PTX" -> "10.0+PTX"), duplicates
    are dropped keeping the first occurrence, and entries are joined with ";" (torch does
    not accept commas). The second element is a one-line note saying what changed, or None
    when the variable is unset or already fine.
    """
    fixed = dict(env)
    raw = env.get(ARCH_LIST_VAR)
    if raw is None or not raw.strip():
        return fixed, None

    entries = [entry for entry in _ARCH_SEPARATORS.split(raw.strip()) if entry]
    cleaned: list[str] = []
    changes: list[str] = []
    for entry in entries:
        match = _SUFFIXED_ARCH.match(entry)
        if match:
            stripped = match.group(1) + (match.group(2) or "")
            changes.append(f"{entry} -> {stripped}")
            entry = stripped
        if entry in cleaned:
            changes.append(f"dropped duplicate {entry}")
        else:
            cleaned.append(entry)
    if "," in raw:
        changes.append("',' -> ';'")

    if not changes:
        return fixed, None
    fixed[ARCH_LIST_VAR] = ";".join(cleaned)
    note = (
        f"{ARCH_LIST_VAR}={raw!r} rewritten to {fixed[ARCH_LIST_VAR]!r} ({'; '.join(changes)}): "
        "DeepSpeed's JIT op build crashes on arch suffixes such as 'a'"
    )
    return fixed, note


def torch_extensions_dir(env: Mapping[str, str] | None = None) -> Path:
    """Root folder of torch's JIT extension builds, as torch.utils.cpp_extension picks it.

    Without TORCH_EXTENSIONS_DIR, torch builds under a per-python/per-CUDA subfolder
    (e.g. "py311_cu128") of this root; callers that need the exact folder add it themselves.
    """
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "torch_extensions"


def stale_extension_locks(ext_dir: Path | None = None, older_than_s: float = 600) -> list[Path]:
    """`lock` files under the torch extensions dir that no running build holds.

    torch's JIT build takes a lock file per extension and every later load of that
    extension waits for it to disappear, so a lock left by a killed build makes every
    later run hang forever. A lock counts as stale when neither it nor anything beside it
    (object files, ninja logs) changed in `older_than_s` seconds and no local process has it
    open. Deleting a stale lock is safe.
    """
    root = Path(ext_dir) if ext_dir is not None else torch_extensions_dir()
    if not root.is_dir():
        return []

    now = time.time()
    old: list[Path] = []
    for folder, _dirs, files in os.walk(root):
        if "lock" not in files:
            continue
        lock = Path(folder) / "lock"
        if now - _last_activity(Path(folder)) > older_than_s:
            old.append(lock)
    if not old:
        return []

    held = _files_open_by_local_processes()
    return sorted(lock for lock in old if os.path.realpath(lock) not in held)


def _last_activity(folder: Path) -> float:
    """Newest mtime among the files directly in `folder` (a build writes there as it goes)."""
    newest = 0.0
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:  # removed while we looked
                continue
    return newest


def _files_open_by_local_processes() -> set[str]:
    """Paths that processes on this host hold open (those we are allowed to inspect)."""
    held: set[str] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return held
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # another user's process, or it exited
            continue
        for fd in fds:
            try:
                held.add(os.readlink(fd))
            except OSError:
                continue
    return held


BYTECODE_OPT_OUT = "DSTRAIN_BYTECODE_CACHE"  # "off": leave Python's bytecode handling alone


def torch_package() -> Path | None:
    """torch's package folder, found without importing torch; None when torch is not installed."""
    import importlib.util
    spec = importlib.util.find_spec("torch")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def bytecode_cache_dir(package: Path | None, env: Mapping[str, str], dont_write: bool,
                       writable: bool | None = None) -> Path | None:
    """Where dstrain's processes keep compiled bytecode, when Python cannot keep torch's next to its
    sources; None when it can, or has it already.

    A torch installed without bytecode (`pip --no-compile`, images built with PYTHONDONTWRITEBYTECODE)
    in a read-only place, or run with PYTHONDONTWRITEBYTECODE, is compiled again by every process that
    imports it: seconds for each of the three in `dstrain run` (the CLI, DeepSpeed's launcher, each
    rank). A cache prefix outside the installation (PYTHONPYCACHEPREFIX) keeps the sources untouched
    and compiles once. `package`: torch's package folder; `writable` overrides the access check.
    """
    if package is None or env.get("PYTHONPYCACHEPREFIX") or switched_off(env, BYTECODE_OPT_OUT):
        return None
    if (package / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").exists():
        return None  # installed with its bytecode
    if writable is None:
        folder = package / "__pycache__"
        writable = os.access(folder if folder.exists() else package, os.W_OK)
    if writable and not dont_write:
        return None  # Python writes it beside the sources on the first import
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dstrain" / "pycache"


def use_bytecode_cache() -> Path | None:
    """Turn the bytecode cache on for this process and the ones it starts, where bytecode_cache_dir
    says it is needed; returns the folder, or None (nothing changed)."""
    folder = bytecode_cache_dir(torch_package(), os.environ, bool(sys.flags.dont_write_bytecode))
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # no cache then: slower, not broken
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
