"""A C++ compiler front for the test session's op builds (tests/scripts/build_ops.py puts it first on PATH as
`c++`, the compiler torch's JIT builds call). For each torch extension source it

- uses a precompiled torch/extension.h, one per set of compiler flags, built by the first source that needs it;
- leaves out `-g`: no test reads the ops' debug information, and for torch's templates it costs as much as
  the code itself;
- adds no header to a source that includes no torch header, itself or through its own headers (three of
  async_io's sources, one of pin_memory's): with the header, GCC emits torch's inline code into it, 12 s of
  CPU at -O0 for a source that compiles in 1 s alone;
- compiles a source once for every op that lists it with the same flags: DeepSpeed's fused Adam and CPU Adam
  both compile csrc/adam/cpu_adam_impl.cpp, with flags that differ only in the module's name, which that
  source never reads (a source that names TORCH_EXTENSION_NAME is compiled for each op).

On this 2-core machine one of DeepSpeed's Adam sources took 76 s of CPU as DeepSpeed builds it (with -g), 39 s
without -g, 18 s without -g and with the header precompiled (the header itself, once per flag set, about
60 s). The session builds about 20 such sources, async_io 12 of them. The command line ninja records stays
exactly the one torch wrote (the front changes only what it runs), so the ranks' own loads find the builds
up to date. The ops' code is the same: same sources, same optimisation and target flags. A header GCC finds
invalid for a source is parsed as usual.

Usage: c++ ARGS...   (as `c++`; DSTRAIN_PCH_REAL_CXX names the real compiler, DSTRAIN_PCH_DIR the folder of
the precompiled headers)"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Flags that name this source's files, its module or its own include folders, not how the header compiles.
_WITH_VALUE = ("-MF", "-o", "-c", "-I")
_OWN_PREFIX = ("-DTORCH_EXTENSION_NAME=", "-I")
_LEFT_OUT = ("-MMD", "-g")


def header_flags(args: list[str]) -> list[str] | None:
    """The flags the header would be compiled with, or None for anything but a torch extension's source."""
    if "-c" not in args or not any("torch/include" in arg for arg in args):
        return None
    flags, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _WITH_VALUE:
            skip = True
        elif arg not in _LEFT_OUT and not arg.startswith(_OWN_PREFIX):
            flags.append(arg)
    return flags


_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)
_TORCH_HEADERS = ("torch/", "ATen/", "c10/", "pybind11/")


def includes_torch(args: list[str]) -> bool:
    """Whether the source being compiled includes a torch header, itself or through a header of its own
    (found next to the including file or in a -I folder). True when the source cannot be read."""
    source = Path(args[args.index("-c") + 1])
    folders = [Path(arg[2:] or value) for arg, value in zip(args, [*args[1:], ""]) if arg.startswith("-I")]
    seen: set[Path] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            text = path.read_bytes()
        except OSError:
            if path == source:
                return True
            continue
        for name in (match.decode() for match in _INCLUDE.findall(text)):
            if name.startswith(_TORCH_HEADERS):
                return True
            found = next((folder / name for folder in (path.parent, *folders) if (folder / name).is_file()), None)
            if found is not None:
                todo.append(found)
    return False


def precompiled(real: str, root: Path, flags: list[str]) -> Path | None:
    """The header for `flags`, precompiled once (under a lock: ninja compiles two sources at a time)."""
    folder = root / hashlib.sha1("\0".join(flags).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    header = folder / "torch_extension.h"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "failed").exists() and not Path(f"{header}.gch").exists():
            header.write_text("#include <torch/extension.h>\n")
            partial = Path(f"{header}.gch.partial")
            done = subprocess.run([real, *flags, "-x", "c++-header", str(header), "-o", str(partial)])
            if done.returncode == 0:
                partial.replace(f"{header}.gch")
            else:
                (folder / "failed").write_text("")
    return header if Path(f"{header}.gch").exists() else None


_MODULE_NAME = "-DTORCH_EXTENSION_NAME="


def object_key(args: list[str]) -> str | None:
    """The key of this compile's object among the session's ops: its command without the module's name, and the
    source's bytes. None where the object may differ between ops: a source that reads the module's name."""
    source = Path(args[args.index("-c") + 1])
    try:
        text = source.read_bytes()
    except OSError:
        return None
    if b"TORCH_EXTENSION_NAME" in text:
        return None
    digest = hashlib.sha1("\0".join(arg for arg in args if not arg.startswith(_MODULE_NAME)).encode())
    digest.update(text)
    return digest.hexdigest()[:20]


def compile_once(command: list[str], args: list[str], objects: Path) -> int:
    """Run `command` unless an op compiled the same source with the same flags already: then copy that object
    (and its dependency file, which names the same object file) to where this build expects them."""
    key = object_key(args)
    output = Path(args[args.index("-o") + 1])
    depfile = Path(args[args.index("-MF") + 1]) if "-MF" in args else None
    if key is None:
        return subprocess.run(command).returncode
    cached = objects / f"{key}.o"
    if cached.exists() and (depfile is None or cached.with_suffix(".d").exists()):
        shutil.copyfile(cached, output)
        if depfile is not None:
            shutil.copyfile(cached.with_suffix(".d"), depfile)
        return 0
    code = subprocess.run(command).returncode
    if code == 0:
        objects.mkdir(parents=True, exist_ok=True)
        if depfile is not None:
            shutil.copyfile(depfile, objects / f"{key}.d.partial")
            os.replace(objects / f"{key}.d.partial", cached.with_suffix(".d"))
        shutil.copyfile(output, objects / f"{key}.o.partial")
        os.replace(objects / f"{key}.o.partial", cached)  # last: an object present means both files are
    return code


def main() -> None:
    real = os.environ["DSTRAIN_PCH_REAL_CXX"]
    args = sys.argv[1:]
    flags = header_flags(args)
    header = precompiled(real, Path(os.environ["DSTRAIN_PCH_DIR"]), flags) if flags and includes_torch(args) else None
    if flags is not None:
        args = [arg for arg in args if arg != "-g"]
    command = [real, "-include", str(header), *args] if header else [real, *args]
    if flags is not None and "-o" in args:
        sys.exit(compile_once(command, args, Path(os.environ["DSTRAIN_PCH_DIR"]) / "objects"))
    os.execv(real, command)


if __name__ == "__main__":
    main()
