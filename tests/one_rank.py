"""Helpers for tests that drive real DeepSpeed engines in one rank (CPU and gloo, or one GPU), in a subprocess so its
process group stays out of the test process. run_script runs a module of tests/scripts/ with its parameters
on one rank or more and returns what each printed with result(); run_one_rank runs a short script's text
after ONE_RANK_PREAMBLE (a free port, the rank's environment, torch and deepspeed imported, the process
group up), for tests whose few lines read best beside their assertions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from op_gate import wait_for_ops

ONE_RANK_PREAMBLE = textwrap.dedent("""
    import json, os, socket, sys, warnings
    warnings.filterwarnings("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, deepspeed
    from pathlib import Path
    from dstrain.op_cache import remember_cpu_info
    remember_cpu_info(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    from dstrain.speedups.muon_lazy_compile import applies, muon_imported_lazily
    if applies() is None:  # as dstrain's ranks (speedups.muon_lazy_compile): about 3 s less per engine build
        with muon_imported_lazily():
            pass
    from dstrain.speedups import dynamo_lazy_import
    if dynamo_lazy_import.applies() is None:  # as the ranks (speedups.dynamo_lazy_import): ~1.5 s less
        with dynamo_lazy_import.dynamo_imported_when_needed():
            pass
    from dstrain.rank.runtime import skip_shared_memory_all_reduce_op
    skip_shared_memory_all_reduce_op()  # as the ranks: an op only AutoTP's inference_all_reduce calls
    if os.environ["DS_ACCELERATOR"] == "cuda":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo")

    def result(value):
        print("RESULT " + json.dumps(value))
""")

TESTS = Path(__file__).parent


def rank_env(accelerator: str, extra: dict | None = None) -> dict:
    """This process's environment for a rank on `accelerator`, with `extra` added; its ops build in this
    environment's own cache for that accelerator, as dstrain's ranks do."""
    from dstrain.op_cache import use_private_op_cache
    env = {**os.environ, **(extra or {}), "DS_ACCELERATOR": accelerator}
    use_private_op_cache(env, accelerator)
    return env


def run_one_rank(script: str, timeout: float = 600, accelerator: str = "cpu", env: dict | None = None):
    """Run ONE_RANK_PREAMBLE + `script` on DeepSpeed's CPU accelerator (gloo) or on GPU 0 (cuda, nccl),
    with `env` added to the environment; the value it passed to result()."""
    wait_for_ops()
    done = subprocess.run([sys.executable, "-c", ONE_RANK_PREAMBLE + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, env=rank_env(accelerator, env))
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def _result_of(stdout: str, stderr: str):
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, stdout[-2000:] + stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def run_script(module: str, params: dict, timeout: float = 600, accelerator: str = "cpu", env: dict | None = None,
               ranks: int = 1):
    """Run tests/scripts/<module>.py with `params` on DeepSpeed's CPU accelerator (gloo) or on GPUs (cuda,
    nccl), with `env` added to the environment: the value it passed to result(), or with ranks > 1 the
    list of each rank's (the ranks meet on a free port of this host)."""
    wait_for_ops()
    env = rank_env(accelerator, {**(env or {}), "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])})
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            params = {**params, "world_size": ranks, "port": s.getsockname()[1]}
    processes = [subprocess.Popen([sys.executable, "-m", f"scripts.{module}", json.dumps({**params, "rank": rank})],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for rank in range(ranks)]
    try:
        results = [_result_of(*process.communicate(timeout=timeout)) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return results if ranks > 1 else results[0]
