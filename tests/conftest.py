"""Shared test setup: tests import their helpers (tests/launcher.py) by module name; a one-rank process group."""

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import op_gate  # noqa: E402  (tests/ is on the path now)
from launch_count import LaunchCounter  # noqa: E402


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A real one-rank gloo process group: checkpointing.save's barriers and gathers run as in a job."""
    import torch.distributed as dist
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def transformers_missing(monkeypatch):
    """This process behaves as if transformers were not installed (the test extra installs it): its
    import raises ImportError and find_spec finds nothing; modules that imported it are forgotten."""
    for name in [n for n in sys.modules if n == "transformers" or n.startswith(("transformers.", "examples.huggingface"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)


# Each lane's time, printed at the end of every run (CI runs both lanes in one `pytest -q`), never asserted:
# a timing assertion fails on a slow day. What is guarded instead is the count of rank processes started
# (launch_count.py): CI's time is mostly rank start-ups, so a new feature's tests share runs.
#
# The suite runs on pytest-xdist's workers (pyproject.toml: `-n 2`): on 2 cores two launcher tests side by
# side finish in about two thirds of the time of one after the other, since a launch spends seconds in one
# process at a time (the CLI's checks, DeepSpeed's launcher, the ranks' teardown). A test goes to a worker with
# the rest of its group (_group: its module, the launching fixture it shares with other modules, or itself in
# modules whose launches share nothing), so that a module or session fixture runs once. The first worker writes
# each test's group to a file the controller's scheduler reads (GroupScheduling; xdist's own --dist loadgroup
# cannot rename test ids under pytest 9). Each worker counts the ranks it starts; the controller adds them up.
_GATE_WAITS: list[float] = []  # seconds each process's tests waited for the op build (tests/op_gate.py)
_LANE_SECONDS = {"fast lane (not integration)": 0.0, "launcher lane (integration)": 0.0}
_LAUNCHES = LaunchCounter()
CPU_REPORT_TESTS = 40  # tests named in the end-of-run CPU list
_OP_BUILD: subprocess.Popen | None = None
_OP_BUILD_LOG = Path(tempfile.gettempdir()) / f"dstrain-tests-build-ops-{os.getpid()}.log"
_OP_BUILD_SAID: list[str] = []  # the build's summary line, from whichever process ran it
_TEST_CPU: dict[str, float] = {}  # CPU seconds of each test (pytest_runtest_protocol), printed at the end

# Groups other than a test's module: the launching fixtures several tests read (they run once, on one worker),
# and the modules whose launcher tests share nothing (each test a group of its own; test_run's presets by preset).
_RUN_FIXTURE_GROUPS = {"zero3_llama_run": "zero3_llama", "default_job": "default_job",
                       "stage2_interrupted": "stage2_resume", "stage2_straight": "stage2_resume"}
_SPLIT_MODULES = ("test_benchmarks", "test_sequence_parallel", "test_run")

# Launcher groups that take longest start first, so that the last minutes do not leave a worker idle beside
# one long group; the NVMe preset goes last, as DeepSpeed's async_io op takes minutes to build beside the rest.
_LONG_GROUPS_FIRST = ("test_suite_trains_an_hf_shape_three_ways_with_a_variant_and_bounds_the_offload_row",
                      "zero3_llama", "stage2_resume",
                      "test_qwen2_stage3_split_padded_rows_train_resume_evaluate_and_export_as_without_it")
_LAST = ("nvme",)


def _worker(config) -> str | None:
    """This process's xdist worker id (gw0, gw1, ...); None in the controller or without xdist."""
    return config.workerinput["workerid"] if hasattr(config, "workerinput") else None


def _controller(config) -> bool:
    """Whether this process hands tests to xdist workers (and runs none itself)."""
    return _worker(config) is None and getattr(config.option, "dist", "no") != "no"


def pytest_sessionstart(session):
    if not _controller(session.config):
        _LAUNCHES.start()
        # In-process engines load DeepSpeed's CPU ops, and DeepSpeed asks py-cpuinfo twice per op: a Python
        # subprocess, 1 s of CPU each time. Answered once per machine, as dstrain's ranks are.
        from dstrain.op_cache import op_cache, remember_cpu_info
        remember_cpu_info(op_cache(os.environ, "cpu")[0])


def pytest_collection_modifyitems(session, config, items):
    """Modules without launcher tests first, each module's tests kept together and in order (module fixtures
    are set up once): the fast lane's failures show in its first minutes, and the op builds started below
    run beside it; of those, the modules whose tests start one-rank processes last, as they wait for the ops. Then the launcher groups, the longest first. The first xdist worker writes the groups down
    for the controller's scheduler."""
    launches = {item.module.__name__ for item in items if item.get_closest_marker("integration")}

    def order(item) -> tuple:
        if item.module.__name__ not in launches:
            # modules that start rank processes themselves (tests/one_rank.py) wait at the op gate: after the rest
            return (0, int(_starts_ranks(item.module)))
        if any(mark in item.nodeid for mark in _LAST):
            return (3, 0)
        name = _group(item)
        return (1, _LONG_GROUPS_FIRST.index(name)) if name in _LONG_GROUPS_FIRST else (2, 0)
    items.sort(key=order)
    if _worker(config) == "gw0":
        groups = _groups_file(os.getppid())
        partial = groups.with_suffix(".partial")
        partial.write_text(json.dumps({item.nodeid: _group(item) for item in items}))
        partial.replace(groups)


@functools.cache
def _starts_ranks(module) -> bool:
    """Whether a module's tests start rank processes through tests/one_rank.py."""
    text = Path(module.__file__).read_text()
    return "run_one_rank(" in text or "run_script(" in text


def _groups_file(controller_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"dstrain-tests-groups-{controller_pid}.json"


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduler by scope, with the scope of a test its group (written by the first worker before it
    reports its collection, so it is there when the scheduler splits the collection); tests it does not name
    go by module. Whole groups go to a worker, in collection order (--no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                path = _groups_file(os.getpid())
                self.groups = json.loads(path.read_text()) if path.exists() else {}
                path.unlink(missing_ok=True)
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]
    return GroupScheduling(config, log)


def _group(item) -> str:
    """A test's xdist group: an xdist_group mark's name, the group of a launching fixture it shares with other
    modules (_RUN_FIXTURE_GROUPS), test_run's preset runs by preset, the test itself in _SPLIT_MODULES, else
    its module."""
    marked = item.get_closest_marker("xdist_group")
    if marked is not None:
        return marked.args[0]
    shared = [_RUN_FIXTURE_GROUPS[name] for name in item.fixturenames if name in _RUN_FIXTURE_GROUPS]
    if shared:
        return shared[0]
    if "preset_runs" in item.fixturenames:
        return f"preset_{item.callspec.params['preset']}"
    if item.module.__name__ in _SPLIT_MODULES:
        return item.name
    return item.module.__name__


def pytest_collection_finish(session):
    """Where the session will start ranks, build DeepSpeed's CPU ops now, in the background (scripts/build_ops.py):
    the fast lane leaves room for it. One process builds: the first xdist worker, or pytest itself."""
    global _OP_BUILD
    if _controller(session.config):
        return
    launching = [item for item in session.items if item.get_closest_marker("integration")]
    if not launching or session.config.option.collectonly:
        return
    # Every worker collects the same tests, so each knows that gw0 builds and where its gate is.
    controller = os.getppid() if _worker(session.config) is not None else os.getpid()
    gate = _gate_prefix(controller)
    os.environ[op_gate.GATE_ENV] = gate
    if _worker(session.config) in (None, "gw0"):
        for part in (op_gate.BASE, op_gate.NVME):
            Path(gate + part).unlink(missing_ok=True)
        nvme = ["--nvme"] if any("nvme" in item.nodeid for item in launching) else []
        with open(_OP_BUILD_LOG, "w") as log:
            _OP_BUILD = subprocess.Popen([sys.executable, "-m", "scripts.build_ops", gate, *nvme],
                                         cwd=Path(__file__).parent, stdout=log, stderr=subprocess.STDOUT)


def _gate_prefix(controller_pid: int) -> str:
    """The op gate's files of the session whose controller (or plain pytest process) is `controller_pid`."""
    return str(Path(tempfile.gettempdir()) / f"dstrain-tests-ops-{controller_pid}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A launcher test (its fixtures included) starts once the op build has what its ranks load."""
    if item.get_closest_marker("integration"):
        op_gate.wait_for_ops(nvme="nvme" in item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _LAUNCHES.current_test = item.nodeid  # a module or session fixture's launch counts for the test that set it up
    before = _cpu_seconds()
    yield
    _TEST_CPU[item.nodeid] = _cpu_seconds() - before


def _cpu_seconds() -> float:
    """This process's CPU and that of the children it waited for (a launch's ranks are the launcher's children,
    the launcher the CLI's, the CLI this process's or its own): the cost of a test, fixtures included."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def pytest_runtest_logreport(report):
    lane = "launcher lane (integration)" if "integration" in report.keywords else "fast lane (not integration)"
    _LANE_SECONDS[lane] += report.duration


def pytest_testnodedown(node, error):
    """The controller, as each xdist worker ends: its rank count and the op build's summary."""
    output = getattr(node, "workeroutput", {})
    _LAUNCHES.add(output.get("launches", {}))
    _OP_BUILD_SAID.extend(output.get("op_build", []))
    _GATE_WAITS.append(output.get("op_gate_waited_s", 0.0))
    _TEST_CPU.update(output.get("test_cpu", {}))


def pytest_sessionfinish(session):
    if _OP_BUILD is not None:
        if _OP_BUILD.poll() is None:
            _OP_BUILD.wait(timeout=900)  # never killed mid-build: torch's build lock would stay behind
        said = [line for line in _OP_BUILD_LOG.read_text().splitlines() if line.endswith((" s", "here"))]
        _OP_BUILD_SAID.append(f"DeepSpeed ops built beside the fast lane (exit {_OP_BUILD.returncode}): "
                              + ("; ".join(said) or "none"))
    if _worker(session.config) is None:
        # The gate files go when the whole session ends: the controller's end (or pytest's own without xdist),
        # never a worker's. xdist ends a worker whose queue ran dry while another still runs its last group, and
        # a test of that group still waiting at the gate would then wait for a file that is gone (2026-11-29).
        for part in (op_gate.BASE, op_gate.NVME):
            Path(_gate_prefix(os.getpid()) + part).unlink(missing_ok=True)
    _LAUNCHES.stop()
    if _worker(session.config) is not None:
        session.config.workeroutput["launches"] = _LAUNCHES.counts()
        session.config.workeroutput["op_build"] = _OP_BUILD_SAID
        session.config.workeroutput["op_gate_waited_s"] = op_gate.waited_seconds()
        session.config.workeroutput["test_cpu"] = _TEST_CPU
        return
    _GATE_WAITS.append(op_gate.waited_seconds())
    if _LAUNCHES.over_budget() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("")
    for lane, seconds in _LANE_SECONDS.items():
        if seconds:
            terminalreporter.write_line(f"{lane}: {seconds:.0f} s ({seconds / 60:.1f} min) of test time")
    for line in _OP_BUILD_SAID:
        terminalreporter.write_line(line)
    if _OP_BUILD_SAID:  # what the session's processes built in all: an op a test built itself shows here
        from dstrain.op_cache import built_ops, op_cache
        folder, _ = op_cache(dict(os.environ), "cpu")
        terminalreporter.write_line(f"ops in the session's op cache: {', '.join(built_ops(folder)) or 'none'}")
    if any(_GATE_WAITS):
        terminalreporter.write_line(f"tests waited at the op gate for the build: {sum(_GATE_WAITS):.0f} s "
                                    f"(all workers, tests/op_gate.py)")
    for line in _LAUNCHES.report():
        terminalreporter.write_line(line)
    if _TEST_CPU and os.environ.get("DSTRAIN_TEST_COSTS"):  # every test's CPU and ranks, for trimming the suite
        ranks_by_test = Counter(_LAUNCHES.ranks.values())
        rows = sorted(_TEST_CPU.items(), key=lambda item: -item[1])
        Path(os.environ["DSTRAIN_TEST_COSTS"]).write_text(
            "".join(f"{seconds:.1f}\t{ranks_by_test.get(nodeid, 0)}\t{nodeid}\n" for nodeid, seconds in rows))
    if _TEST_CPU:
        ranked = sorted(_TEST_CPU.items(), key=lambda item: -item[1])
        terminalreporter.write_line(f"CPU of the tests: {sum(_TEST_CPU.values()):.0f} s (each test's process and the "
                                    f"processes it waited for; the op build apart); the most:")
        for nodeid, seconds in ranked[:CPU_REPORT_TESTS]:
            terminalreporter.write_line(f"  {seconds:7.1f} s  {nodeid}")


# Tiny Hugging Face model folders (tests/hf_models.py), one per test module that asks.
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from hf_models import save_tiny_llama
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from hf_models import save_tiny_gpt2
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "model")


@pytest.fixture(scope="session")
def zero3_llama_run(tmp_path_factory):
    """A tiny Llama fine-tuned 3 steps at ZeRO-3 on 2 CPU ranks (lr 0.01; train.compile "auto" is eager on CPU):
    test_hf_runs checks what it loaded and exports, test_hf_compile compares the same run compiled with it.
    Launched once for both files (an hf: launch costs ~15 s)."""
    from hf_models import save_tiny_llama
    from launcher import run_hf
    root = tmp_path_factory.mktemp("zero3_llama")
    model_dir, run_dir = save_tiny_llama(root / "llama"), root / "run"
    sets = ("train.lr=0.01", "train.warmup_steps=0", "train.max_steps=3")
    return SimpleNamespace(model_dir=model_dir, run_dir=run_dir, sets=sets,
                           result=run_hf(run_dir, "stage3", model_dir, *sets))


@pytest.fixture(scope="session")
def default_job(tmp_path_factory):
    """The default job (`dstrain run --preset stage2_offload`, written out as examples/default.yaml: the fast
    lane checks they resolve alike) at the tiny size, 30 steps: test_run checks that its loss falls,
    test_examples that the example trains. Launched once for both (a launch costs ~12 s)."""
    from launcher import TINY, dstrain
    run_dir = tmp_path_factory.mktemp("default") / "run"
    args = ["run", "--config", str(Path(__file__).parent.parent / "examples" / "default.yaml"),
            "--accelerator", "cpu", "--gpus", "2", "--run-dir", str(run_dir)]
    for item in (*TINY, "train.max_steps=30", "train.log_every=5", "train.lr=3e-3", "train.warmup_steps=5"):
        args += ["--set", item]
    return run_dir, dstrain(*args)
