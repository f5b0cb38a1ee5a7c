"""The test session's op build helpers (tests/scripts/pch_cxx.py, tests/op_gate.py), in-process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from scripts.pch_cxx import compile_once, header_flags, includes_torch
import op_gate

TORCH = "/venv/lib/python3.11/site-packages/torch/include"


def test_the_header_is_keyed_by_how_it_compiles_not_by_the_source_its_module_or_its_folders():
    one = ["-MMD", "-MF", "a.o.d", "-DTORCH_EXTENSION_NAME=fused_adam", "-DTORCH_API_INCLUDE_EXTENSION_H",
           "-I/ds/csrc/includes", "-isystem", TORCH, "-fPIC", "-std=c++20", "-O3", "-g", "-march=native",
           "-c", "/ds/csrc/adam/fused_adam.cpp", "-o", "fused_adam.o"]
    other = ["-MMD", "-MF", "b.o.d", "-DTORCH_EXTENSION_NAME=dstrain_cpu_adam_nogil", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-I/ds/csrc/includes", "-I", "/ds/csrc/adam", "-isystem", TORCH, "-fPIC", "-std=c++20", "-O3", "-g",
             "-march=native", "-c", "/x/cpu_adam_nogil.cpp", "-o", "nogil.o"]
    assert header_flags(one) == header_flags(other) == [
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem", TORCH, "-fPIC", "-std=c++20", "-O3", "-march=native"]
    # another optimisation level is another header
    assert header_flags([*one[:-6], "-O0", *one[-6:]]) != header_flags(one)


def test_links_version_checks_and_sources_without_torch_pass_through():
    assert header_flags(["a.o", "b.o", "-shared", "-o", "op.so"]) is None
    assert header_flags(["-dumpfullversion", "-dumpversion"]) is None
    assert header_flags(["-O3", "-c", "test.c", "-o", "test.o"]) is None


def test_the_header_goes_only_to_sources_that_include_torch_themselves_or_through_their_own_headers(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "plain.h").write_text("#include <vector>\n#include \"deeper.h\"\n")
    (tmp_path / "inc" / "deeper.h").write_text("#pragma once\n")
    (tmp_path / "inc" / "binding.h").write_text("#pragma once\n  #  include <torch/extension.h>\n")
    (tmp_path / "plain.cpp").write_text('#include "plain.h"\nint f() { return 1; }\n')
    (tmp_path / "binding.cpp").write_text('#include "plain.h"\n#include "binding.h"\n')
    args = lambda source: ["-I", str(tmp_path / "inc"), "-c", str(tmp_path / source), "-o", "x.o"]
    assert not includes_torch(args("plain.cpp"))
    assert includes_torch(args("binding.cpp"))  # through its own header, found in an -I folder
    assert includes_torch(args("missing.cpp"))  # unreadable: as torch would compile it
    # DeepSpeed's own async_io sources, as its build names them: the type definitions include no torch header.
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder
    builder = AsyncIOBuilder()
    folders = [arg for folder in builder.include_paths() for arg in ("-I", builder.deepspeed_src_path(folder))]
    sources = {Path(source).name: builder.deepspeed_src_path(source) for source in builder.sources()}
    assert not includes_torch([*folders, "-c", sources["deepspeed_aio_types.cpp"]])
    assert includes_torch([*folders, "-c", sources["py_ds_aio.cpp"]])


def test_a_test_waits_at_the_gate_until_the_build_opens_it(tmp_path, monkeypatch):
    prefix = str(tmp_path / "ops")
    monkeypatch.setenv(op_gate.GATE_ENV, prefix)
    opener = threading.Timer(0.3, op_gate.open_gate, (prefix, op_gate.BASE, "FusedAdamBuilder: ready in 1 s"))
    opener.start()
    started = time.monotonic()
    op_gate.wait_for_ops()
    assert time.monotonic() - started >= 0.25 and os.path.exists(prefix + op_gate.BASE)
    monkeypatch.delenv(op_gate.GATE_ENV)
    op_gate.wait_for_ops(nvme=True)  # no build in this session: nothing to wait for


def _compile(tmp_path: Path, source: Path, module: str, compiler: str = "c++") -> tuple[int, Path]:
    """As ninja runs a compile of torch's JIT build: in the op's own build folder, with the object's name (the
    same in each op's folder) relative to it."""
    build = tmp_path / module
    build.mkdir(exist_ok=True)
    args = ["-MMD", "-MF", "impl.o.d", f"-DTORCH_EXTENSION_NAME={module}", "-O2", "-c", str(source), "-o", "impl.o"]
    here = os.getcwd()
    os.chdir(build)
    try:
        return compile_once([compiler, *args], args, tmp_path / "objects"), build
    finally:
        os.chdir(here)


def test_a_source_two_ops_compile_alike_is_compiled_once_and_one_that_reads_the_module_name_for_each(tmp_path):
    shared = tmp_path / "impl.cpp"
    shared.write_text('#include "impl.h"\nint twice(int x) { return 2 * x; }\n')
    (tmp_path / "impl.h").write_text("int twice(int x);\n")
    code, first = _compile(tmp_path, shared, "fused_adam")
    assert code == 0 and (first / "impl.o").stat().st_size > 0
    # the second op's compile is the first's object (`false` as the compiler: it would fail had it run)
    code, second = _compile(tmp_path, shared, "cpu_adam", compiler="false")
    assert code == 0
    assert (second / "impl.o").read_bytes() == (first / "impl.o").read_bytes()
    assert "impl.h" in (second / "impl.o.d").read_text()  # ninja reads the headers it depends on from there
    # other flags are another object
    args = ["-O0", "-c", str(shared), "-o", str(tmp_path / "o0.o")]
    assert compile_once(["false", *args], args, tmp_path / "objects") != 0

    binding = tmp_path / "binding.cpp"
    binding.write_text('#define STR(x) #x\n#define NAME(x) STR(x)\nconst char* name = NAME(TORCH_EXTENSION_NAME);\n')
    assert _compile(tmp_path, binding, "fused_adam")[0] == 0
    assert _compile(tmp_path, binding, "cpu_adam", compiler="false")[0] != 0

