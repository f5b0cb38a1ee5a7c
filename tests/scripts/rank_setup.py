"""What every script under tests/scripts/ starts with: its rank's environment and process group (gloo on
DeepSpeed's CPU accelerator, NCCL on a GPU), its parameters, and result() for what it sends back."""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path


def parameters() -> dict:
    """The script's parameters: the JSON object of its first argument."""
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def start_rank(params: dict) -> str:
    """Join the process group as params' "rank" of "world_size" (one rank on a free port by default);
    the device the rank trains on ("cpu" or "cuda")."""
    warnings.filterwarnings("ignore")
    rank, world_size, port = params.get("rank", 0), params.get("world_size", 1), params.get("port")
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    import deepspeed
    import torch

    from dstrain.op_cache import remember_cpu_info
    remember_cpu_info(Path(os.environ["TORCH_EXTENSIONS_DIR"]))  # as dstrain's ranks: py-cpuinfo asked once a machine
    lean_muon_import()
    from dstrain.rank.runtime import skip_shared_memory_all_reduce_op
    skip_shared_memory_all_reduce_op()  # as the ranks: an op only AutoTP's inference_all_reduce calls
    on_gpu = os.environ["DS_ACCELERATOR"] == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    return "cuda" if on_gpu else "cpu"


def lean_muon_import() -> None:
    """DeepSpeed's Muon module imported without TorchInductor, as dstrain's ranks do (speedups.muon_lazy_compile):
    about 3 s less per engine build; torch._dynamo's import deferred as theirs is."""
    from dstrain.speedups import dynamo_lazy_import
    from dstrain.speedups.muon_lazy_compile import applies, muon_imported_lazily
    if applies() is None:
        with muon_imported_lazily():
            pass
    # and torch._dynamo imported only when something compiles (speedups.dynamo_lazy_import): ~1.5 s less
    if dynamo_lazy_import.applies() is None:
        with dynamo_lazy_import.dynamo_imported_when_needed():
            pass


def result(value) -> None:
    print("RESULT " + json.dumps(value), flush=True)
