"""The launch guard (tests/launch_count.py) counts the processes this session starts that look like ranks:
real child processes here, each living a little longer than one look."""

import subprocess
import sys
import textwrap
from launch_count import _POLL_S, RANK_BUDGET, SELF_TEST_MARK, LaunchCounter


def _counted(*commands: list[str]) -> LaunchCounter:
    counter = LaunchCounter(self_test=True)  # the session's counter leaves these processes out
    counter.current_test = "this test"
    counter.start()
    try:
        for process in [subprocess.Popen(command) for command in commands]:  # side by side
            assert process.wait() == 0
    finally:
        counter.stop()
    return counter


def test_a_launchers_children_and_a_one_rank_process_are_counted_and_nothing_else():
    live = f"# {SELF_TEST_MARK}\nimport time; time.sleep({2.5 * _POLL_S})"
    # Stands in for DeepSpeed's per-node launcher by its command line: the guard knows ranks by their parent.
    launcher = textwrap.dedent(f"""
        # deepspeed.launcher.launch {SELF_TEST_MARK}
        import subprocess, sys
        ranks = [subprocess.Popen([sys.executable, "-c", {live!r}]) for _ in range(2)]
        [rank.wait() for rank in ranks]
    """)
    counter = _counted([sys.executable, "-c", launcher],
                       [sys.executable, "-c", f"# init_distributed\n{live}"],  # a test's own one-rank process
                       [sys.executable, "-c", live])  # a helper process: no rank
    if not counter.counts()["counted"]:
        return  # not Linux: the report says nothing was counted
    assert counter.counts() == {"ranks": ["this test"] * 3, "launchers": 1, "counted": True}
    assert counter.report() == [f"rank processes started: 3 (budget {RANK_BUDGET}, tests/launch_count.py), "
                                "by 1 DeepSpeed launcher runs"]

