"""Each Python environment builds DeepSpeed's JIT ops in its own folder (issue 38): two venvs on one
machine get different op caches, keyed by the environment, and a second start in the same environment
finds its build instead of building again.

The two venvs are real (`python -m venv`), sharing this environment's installed packages through a .pth
file, as a second checkout's venv would hold the same torch. The build is a real torch JIT extension
built the way DeepSpeed builds its ops (torch.utils.cpp_extension, cached by name in
TORCH_EXTENSIONS_DIR), the smallest there is: DeepSpeed's own CPU ops take ~100 s each on 2 cores, so
the probe builds once, in one venv, and the other venv's folder is shown apart without a second build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

RANK_ENV = """
import json
from dstrain.launcher.runner import rank_env
print(json.dumps(rank_env("cpu", 1)["TORCH_EXTENSIONS_DIR"]))
"""

# What a rank does when it loads an op: torch's JIT load, by name, into TORCH_EXTENSIONS_DIR. The probe is a
# plain CPython extension (no torch header: under 1 s to compile, where torch/extension.h alone costs ~35 s of
# CPU); torch builds, caches and imports it as it does DeepSpeed's ops.
PROBE_SOURCE = """
#include <Python.h>
static PyObject* add_one(PyObject*, PyObject* arg) { return PyLong_FromLongLong(PyLong_AsLongLong(arg) + 1); }
static PyMethodDef methods[] = {{"add_one", add_one, METH_O, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "dstrain_op_cache_probe", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_dstrain_op_cache_probe() { return PyModule_Create(&module); }
"""
LOAD_OP = """
import os, time
import torch.utils.cpp_extension as cpp
started = time.perf_counter()
op = cpp.load(name="dstrain_op_cache_probe", sources=[os.environ["PROBE_SOURCE"]], extra_cflags=["-O0"])
assert op.add_one(41) == 42
print(time.perf_counter() - started)
"""


def make_venv(where: Path) -> Path:
    """A real venv whose site-packages reach this environment's packages and this checkout."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "shared.pth").write_text(f"{REPO}\n{sysconfig.get_paths()['purelib']}\n")
    return python


def in_venv(python: Path, code: str, env: dict) -> str:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # two venvs and three interpreters; no rank, no DeepSpeed op
def test_two_venvs_build_apart_and_a_second_start_finds_its_build(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # not the machine's real cache
    first, second = make_venv(tmp_path / "venv_a"), make_venv(tmp_path / "venv_b")
    folder_a = Path(json.loads(in_venv(first, RANK_ENV, env)))
    folder_b = Path(json.loads(in_venv(second, RANK_ENV, env)))
    assert folder_a != folder_b and folder_a.parent == folder_b.parent == tmp_path / "cache/dstrain/torch_extensions"
    for venv, folder in ((tmp_path / "venv_a", folder_a), (tmp_path / "venv_b", folder_b)):
        assert json.loads((folder / "environment.json").read_text())["environment"] == str(venv.resolve())

    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    ranks_a = {**env, "TORCH_EXTENSIONS_DIR": str(folder_a), "PROBE_SOURCE": str(source)}
    built_s = float(in_venv(first, LOAD_OP, ranks_a))
    library = folder_a / "dstrain_op_cache_probe" / "dstrain_op_cache_probe.so"
    built_at = library.stat().st_mtime_ns
    again_s = float(in_venv(first, LOAD_OP, ranks_a))  # a second start in the same environment
    assert library.stat().st_mtime_ns == built_at  # found, not built again (its time is printed, not asserted)
    assert not (folder_b / "dstrain_op_cache_probe").exists()  # the other venv would build its own, apart
    print(f"op cache probe: built in {built_s:.1f} s, found by the second start in {again_s:.2f} s")


def test_a_rank_on_a_node_started_without_the_op_cache_takes_this_environments_own(tmp_path, monkeypatch):
    """pdsh, mpirun and srun pass another node only some variables: the rank itself points DeepSpeed at
    this environment's op cache (and its accelerator at the run's), and keeps a cache the node sets."""
    from dstrain.op_cache import private_op_cache
    from dstrain.rank.worker import take_node_settings
    env = {"HOME": str(tmp_path), "DS_ACCELERATOR": "cuda"}  # a node's own profile may say cuda
    monkeypatch.setenv("HOME", str(tmp_path))
    take_node_settings(env, "cpu")
    assert env["DS_ACCELERATOR"] == "cpu"
    assert env["TORCH_EXTENSIONS_DIR"] == str(private_op_cache(env, "cpu"))
    assert (Path(env["TORCH_EXTENSIONS_DIR"]) / "environment.json").is_file()  # doctor reads what it is keyed by
    own = {"HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}
    take_node_settings(own, "cpu")
    assert own["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")
