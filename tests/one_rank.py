"""Helpers for tests that drive real DeepSpeed engines in one rank (CPU and gloo, or one GPU), in a subprocess so its
process group stays out of the test process: a script starts with ONE_RANK_PREAMBLE (a free port,
the rank's environment, torch and deepspeed imported, the process group up) and ends by printing
`result(...)`; run_one_rank returns what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ONE_RANK_PREAMBLE = textwrap.dedent("""
    import json, os, socket, sys, warnings
    warnings.filterwarnings("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, deepspeed
    if os.environ["DS_ACCELERATOR"] == "cuda":
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if os.environ["DS_ACCELERATOR"] == "cuda" else "gloo")

    def result(value):
        print("RESULT " + json.dumps(value))
""")


# For scripts that train a small MLP with a real engine: the model (seeded, 6,337 parameters) and a
# training loop of random inputs, which can put a non-finite value into one micro-step's input.
# Put it before a script's text: `TINY_MLP + SCRIPT`.
TINY_MLP = """
    def tiny_mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 1))

    def train_tiny_mlp(engine, micro_steps, dtype, device, overflow_at=None):
        # Backward and step for each micro-step; the global gradient norm after each (DeepSpeed
        # repeats the last update's between accumulation boundaries).
        generator = torch.Generator().manual_seed(1)
        norms = []
        for micro in range(micro_steps):
            x = torch.randn(4, 32, generator=generator) * 5
            if micro == overflow_at:
                x[0, 0] = float("inf")  # non-finite gradients: DeepSpeed skips this update
            engine.backward(engine(x.to(device=device, dtype=dtype)).float().pow(2).mean())
            engine.step()
            norm = engine.get_global_grad_norm()
            if norm is not None:
                norms.append(float(norm))
        return norms
"""  # indented as the scripts are: run_one_rank dedents the whole


def rank_env(accelerator: str, extra: dict | None = None) -> dict:
    """This process's environment for a rank on `accelerator`, with `extra` added; its ops build in this
    environment's own cache for that accelerator, as dstrain's ranks do."""
    from dstrain.launcher.env_fixes import use_private_op_cache
    env = {**os.environ, **(extra or {}), "DS_ACCELERATOR": accelerator}
    use_private_op_cache(env, accelerator)
    return env


def run_one_rank(script: str, timeout: float = 600, accelerator: str = "cpu", env: dict | None = None):
    """Run ONE_RANK_PREAMBLE + `script` on DeepSpeed's CPU accelerator (gloo) or on GPU 0 (cuda, nccl),
    with `env` added to the environment; the value it passed to result()."""
    done = subprocess.run([sys.executable, "-c", ONE_RANK_PREAMBLE + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, env=rank_env(accelerator, env))
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("RESULT "):])
