"""`dstrain doctor` and the environment fixes it recommends, checked on this real machine."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from dstrain.tools import doctor
from dstrain.launcher.env_fixes import bytecode_cache_dir, sanitize_cuda_arch_list, stale_extension_locks
from dstrain.op_cache import op_cache_key, private_op_cache, use_private_op_cache

ARCH = "TORCH_CUDA_ARCH_LIST"


# --------------------------------------------------------------------------- sanitize


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("9.0a", "9.0"),
        ("9.0a;10.0a+PTX", "9.0;10.0+PTX"),
        ("8.0,9.0a", "8.0;9.0"),
        ("8.0 9.0a 9.0", "8.0;9.0"),  # the stripped entry duplicates a later one
        ("12.0f;12.0a;8.6", "12.0;8.6"),  # order of first appearance is kept
        ("9.0a+PTX;9.0+PTX", "9.0+PTX"),
    ],
)
def test_sanitize_strips_arch_suffixes(given, expected):
    fixed, note = sanitize_cuda_arch_list({ARCH: given, "OTHER": "kept"})
    assert fixed == {ARCH: expected, "OTHER": "kept"}
    assert note is not None and given in note and expected in note and "\n" not in note


@pytest.mark.parametrize("given", ["9.0", "8.0;9.0+PTX", "7.5 8.6", "  "])
def test_sanitize_leaves_parseable_list_alone(given):
    fixed, note = sanitize_cuda_arch_list({ARCH: given})
    assert (fixed, note) == ({ARCH: given}, None)


def test_sanitize_without_the_variable_returns_an_equal_copy():
    env = {"PATH": "/usr/bin"}
    fixed, note = sanitize_cuda_arch_list(env)
    assert (fixed, note) == (env, None)
    assert fixed is not env


def test_the_op_cache_is_keyed_by_environment_versions_and_accelerator(tmp_path, monkeypatch):
    # torch keys a JIT build by the op's name alone: two venvs, or CPU and CUDA builds of fused_adam,
    # shared one folder and clobbered each other's builds (issue 38; CPU ranks on a GPU host, session 12).
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    cpu = use_private_op_cache(env, "cpu")
    assert env["TORCH_EXTENSIONS_DIR"] == str(cpu) and cpu.parent == tmp_path / "dstrain" / "torch_extensions"
    assert json.loads((cpu / "environment.json").read_text()) == op_cache_key("cpu")
    assert private_op_cache(env, "cuda") != cpu and private_op_cache(env, "cpu") == cpu
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another_venv"))
    assert private_op_cache(env, "cpu") != cpu
    mine = {"TORCH_EXTENSIONS_DIR": "/mine"}
    assert use_private_op_cache(mine, "cpu") == Path("/mine") and mine == {"TORCH_EXTENSIONS_DIR": "/mine"}


def test_env_fixes_and_doctor_import_without_torch():
    # The launcher uses env_fixes before ranks start, and the CLI must start fast.
    code = "import sys, dstrain.launcher.env_fixes, dstrain.tools.doctor; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout
    assert out.split() == ["False", "False"]


# --------------------------------------------------------------------------- stale locks


def _make_lock(folder: Path, age_s: float) -> Path:
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def _torch_like(tmp_path: Path, with_bytecode: bool) -> Path:
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if with_bytecode:
        (package / "__pycache__").mkdir()
        (package / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"")
    return package


def test_bytecode_cache_only_where_every_process_would_compile_torch_again(tmp_path):
    home = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cache = tmp_path / "cache" / "dstrain" / "pycache"
    bare = _torch_like(tmp_path / "a", with_bytecode=False)
    # No bytecode and none can be written (read-only install, or PYTHONDONTWRITEBYTECODE): cache it.
    assert bytecode_cache_dir(bare, home, dont_write=False, writable=False) == cache
    assert bytecode_cache_dir(bare, home, dont_write=True, writable=True) == cache
    # Python writes it beside the sources itself, or it was installed with its bytecode: leave alone.
    assert bytecode_cache_dir(bare, home, dont_write=False, writable=True) is None
    compiled = _torch_like(tmp_path / "b", with_bytecode=True)
    assert bytecode_cache_dir(compiled, home, dont_write=True, writable=False) is None
    # The user's own prefix, or the opt-out, wins; no torch, nothing to do.
    assert bytecode_cache_dir(bare, {**home, "PYTHONPYCACHEPREFIX": "/x"}, dont_write=True, writable=False) is None
    assert bytecode_cache_dir(bare, {**home, "DSTRAIN_BYTECODE_CACHE": "off"}, dont_write=True, writable=False) is None
    assert bytecode_cache_dir(None, home, dont_write=True, writable=False) is None


def test_a_torch_without_bytecode_is_compiled_once_into_the_cache_by_this_process_and_its_children(tmp_path):
    """A stand-in torch package without bytecode, with PYTHONDONTWRITEBYTECODE as images set it: after
    use_bytecode_cache() this process writes its bytecode under the cache, and the environment the
    launcher and ranks inherit names the same folder."""
    package = _torch_like(tmp_path, with_bytecode=False)
    (package / "__init__.py").write_text("VALUE = 42\n")
    script = ("import os, sys\n"
              "from dstrain.launcher.env_fixes import use_bytecode_cache\n"
              "folder = use_bytecode_cache()\n"
              "import torch\n"
              "print(folder, os.environ['PYTHONPYCACHEPREFIX'], 'PYTHONDONTWRITEBYTECODE' in os.environ, torch.VALUE)\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(package.parent), str(Path(__file__).resolve().parents[1])])}
    env.pop("PYTHONPYCACHEPREFIX", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    cache = tmp_path / "cache" / "dstrain" / "pycache"
    assert result.stdout.split() == [str(cache), str(cache), "False", "42"]
    assert len(list(cache.rglob(f"torch/__init__.{sys.implementation.cache_tag}.pyc"))) == 1
    assert not (package / "__pycache__").exists()  # the installation is left as it was


def test_old_lock_is_stale(tmp_path):
    lock = _make_lock(tmp_path / "py311_cpu" / "cpu_adam", age_s=3600)
    assert stale_extension_locks(tmp_path, older_than_s=600) == [lock]


def test_fresh_lock_is_not_stale(tmp_path):
    _make_lock(tmp_path / "py311_cpu" / "cpu_adam", age_s=5)
    assert stale_extension_locks(tmp_path, older_than_s=600) == []


def test_old_lock_beside_fresh_build_output_is_not_stale(tmp_path):
    # A long build keeps writing object files next to its lock.
    lock = _make_lock(tmp_path / "fused_adam", age_s=3600)
    (lock.parent / "fused_adam.o").write_bytes(b"")
    assert stale_extension_locks(tmp_path, older_than_s=600) == []


def test_old_lock_held_open_by_a_process_is_not_stale(tmp_path):
    lock = _make_lock(tmp_path / "async_io", age_s=3600)
    with open(lock):  # torch's FileBaton keeps the lock open while it builds
        assert stale_extension_locks(tmp_path, older_than_s=600) == []
    assert stale_extension_locks(tmp_path, older_than_s=600) == [lock]


def test_missing_extensions_dir_has_no_locks(tmp_path):
    assert stale_extension_locks(tmp_path / "absent") == []


def test_extensions_dir_comes_from_the_environment(tmp_path, monkeypatch):
    lock = _make_lock(tmp_path / "cpu_adam", age_s=3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert stale_extension_locks() == [lock]


def test_doctor_reports_stale_lock_as_error_with_rm_fix(tmp_path, monkeypatch):
    lock = _make_lock(tmp_path / "cpu_adam", age_s=3600)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    report = doctor.collect()
    assert report["extension_locks"] == {"stale": [str(lock)]}
    assert {"check": "extension_locks", "severity": "error", "fix": f"rm {lock}"}.items() <= next(
        p for p in report["problems"] if p["check"] == "extension_locks").items()


def test_run_removes_a_stale_build_lock_before_the_ranks_start(tmp_path, monkeypatch):
    # A lock left by a killed build made a later run's ranks wait on it forever (seen in this
    # project's own CI, after an interrupted async_io build); `dstrain run` now clears it.
    from rich.console import Console
    from dstrain.launcher.preflight import clear_stale_build_locks as _clear_stale_build_locks
    lock = _make_lock(tmp_path / "async_io", age_s=3600)
    busy = _make_lock(tmp_path / "cpu_adam", age_s=0)  # a build in progress keeps its lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    console = Console(record=True, width=200)
    _clear_stale_build_locks(console, dry_run=True)
    assert lock.exists() and "a run removes it" in console.export_text()
    _clear_stale_build_locks(console, dry_run=False)
    assert not lock.exists() and busy.exists()
    assert f"removed stale op build lock {lock}" in console.export_text()


# --------------------------------------------------------------------------- collect


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return doctor.collect(nvme_path=tmp_path_factory.mktemp("nvme"))


def test_collect_reports_versions_and_host(report):
    import deepspeed
    import torch

    assert report["versions"] == {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "dstrain": "0.1.0",
    }
    host = report["host"]
    assert host["ram_total_bytes"] >= host["ram_available_bytes"] > 0
    assert host["cpu_count"] >= host["cpus_usable"] >= 1


def test_collect_on_this_cpu_machine(report):
    assert report["cuda"]["available"] is False
    assert report["gpus"] == []
    assert report["accelerator"]["name"] == "cpu"


def test_collect_checks_every_deepspeed_op(report):
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    assert set(report["ops"]) == set(ALL_OPS)
    for op in report["ops"].values():
        assert {type(op[key]) for key in ("compatible", "installed", "jit_cached")} == {bool}
        assert op["jit_cached"] == Path(op["cache_path"]).is_file()
    assert report["ops"]["cpu_adam"]["compatible"] is True


def test_collect_finds_libaio_as_installed_here(report):
    assert Path("/usr/include/libaio.h").is_file()  # libaio-dev is installed on this machine
    assert report["libaio"]["ok"] is True
    assert report["libaio"]["header"] == "/usr/include/libaio.h"


def test_collect_measures_nvme_throughput(report):
    nvme = report["nvme"]
    assert nvme["writable"] is True and nvme["explicit"] is True
    assert nvme["test_bytes"] > 0 and nvme["write_mb_s"] > 0 and nvme["read_mb_s"] > 0
    assert list(Path(nvme["path"]).iterdir()) == []  # the probe cleans up after itself


def test_report_is_json_and_problems_carry_fixes(report):
    assert json.loads(json.dumps(report)) == report
    for problem in report["problems"]:
        assert set(problem) == {"check", "severity", "message", "fix"}
        assert problem["severity"] in ("error", "warning") and problem["fix"]


def test_doctor_flags_suffixed_arch_list_with_export_fix(monkeypatch):
    monkeypatch.setenv(ARCH, "9.0a;10.0a+PTX")
    report = doctor.collect()
    assert report["torch_cuda_arch_list"]["sanitized"] == "9.0;10.0+PTX"
    fixes = [p["fix"] for p in report["problems"] if p["check"] == ARCH]
    assert fixes == [f"export {ARCH}='9.0;10.0+PTX'"]


def test_arch_list_missing_the_gpu_is_flagged(monkeypatch):
    monkeypatch.setenv(ARCH, "8.0")
    gpu = {"index": 0, "name": "H100", "compute_capability": "9.0"}
    problems = []
    doctor._arch_list([gpu], problems)
    assert [p["fix"] for p in problems] == [f"export {ARCH}='8.0;9.0'"]


# --------------------------------------------------------------------------- NVMe path


def test_nvme_file_path_is_an_error_with_fix(tmp_path):
    file = tmp_path / "offload.bin"
    file.write_text("x")
    info, problems = doctor.check_nvme(file)
    assert info["writable"] is False
    assert [p["severity"] for p in problems] == ["error"] and problems[0]["fix"]


def test_nvme_missing_dir_suggests_mkdir(tmp_path):
    info, problems = doctor.check_nvme(tmp_path / "nvme")
    assert info["exists"] is False
    assert [(p["severity"], p["fix"]) for p in problems] == [("error", f"mkdir -p {tmp_path / 'nvme'}")]


@pytest.mark.skipif(not Path("/proc/self").is_dir(),
                    reason="no /proc on this system: the test needs a directory that refuses new files even to root, "
                           "which Linux's procfs is (a chmod'ed directory does not stop root)")
def test_nvme_unwritable_dir_is_an_error_with_fix():
    # procfs refuses new files even to root, unlike a chmod'ed directory.
    info, problems = doctor.check_nvme(Path("/proc"))
    assert info["is_dir"] is True and info["writable"] is False
    assert [p["severity"] for p in problems] == ["error"]
    assert "chown" in problems[0]["fix"]


# --------------------------------------------------------------------------- output


def test_main_json_writes_only_json_to_stdout(capsys):
    code = doctor.main(json_output=True, nvme_path=None)
    report = json.loads(capsys.readouterr().out)
    errors = [p for p in report["problems"] if p["severity"] == "error"]
    assert code == (1 if errors else 0)
    assert report["nvme"]["explicit"] is False


@pytest.mark.slow
def test_fresh_process_json_mode_keeps_deepspeed_warnings_off_stdout():
    # The first deepspeed import logs to stdout; only a fresh process shows it.
    code = "import sys; from dstrain.tools.doctor import main; sys.exit(main(json_output=True, nvme_path=None))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, env={**os.environ, "PYTHONPATH": "."})
    report = json.loads(run.stdout)
    assert run.returncode == (1 if any(p["severity"] == "error" for p in report["problems"]) else 0)


def test_main_returns_1_for_an_unusable_nvme_path(tmp_path, capsys):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    assert doctor.main(json_output=True, nvme_path=file) == 1
    report = json.loads(capsys.readouterr().out)
    assert any(p["check"] == "nvme" and p["severity"] == "error" for p in report["problems"])


def test_doctor_shows_where_this_environment_builds_its_ops_and_which_are_built(report, monkeypatch):
    cache = report["op_cache"]
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        assert cache == {"path": os.environ["TORCH_EXTENSIONS_DIR"], "private": False, "keyed_by": None,
                         "built": cache["built"]}
    else:
        assert cache["path"] == str(private_op_cache(os.environ, "cpu")) and cache["private"] is True
        assert cache["keyed_by"]["environment"] == os.path.realpath(sys.prefix)
    assert cache["built"] == sorted(p.parent.name for p in Path(cache["path"]).glob("*/*.so")
                                    if p.stem == p.parent.name)
    out = io.StringIO()
    doctor.render(report, Console(file=out, width=300))
    assert f"Op build cache: {cache['path']}" in out.getvalue()


def test_render_shows_problems_and_their_fixes(report):
    problem = {"check": "libaio", "severity": "error", "message": "libaio missing",
               "fix": "apt-get install -y libaio-dev"}
    out = io.StringIO()
    doctor.render({**report, "problems": [problem]}, Console(file=out, width=200))
    text = out.getvalue()
    for expected in ("DeepSpeed ops", "cpu_adam", "libaio missing", "apt-get install -y libaio-dev",
                     "1 error(s)"):
        assert expected in text


def test_leftover_deepspeed_shm_buffers_are_reported_with_a_fix(tmp_path):
    import os
    import time
    leftover = Path("/dev/shm") / f"deepspeed_allreduce_buffer_0_127.0.0.1_1_doctor{os.getpid()}"
    leftover.write_bytes(b"\0" * 4096)
    old = time.time() - 3600
    os.utime(leftover, (old, old))
    try:
        report = doctor.collect(nvme_path=tmp_path)
    finally:
        leftover.unlink()
    assert report["shm_buffers"]["stale"] >= 1
    problem = next(p for p in report["problems"] if p["check"] == "shm_buffers")
    assert problem["severity"] == "warning" and "rm /dev/shm/deepspeed_allreduce_buffer_" in problem["fix"]


def test_doctor_says_whether_torch_bytecode_is_kept(report):
    # pip wrote torch's bytecode when it installed it here: nothing for dstrain to cache.
    assert report["bytecode"] == {"prefix": os.environ.get("PYTHONPYCACHEPREFIX"), "dstrain_cache": None}
    console = Console(file=io.StringIO(), width=200)
    doctor.render(report, console)
    assert "torch bytecode" in console.file.getvalue()
