"""dstrain/speedups/offload_fetch_wait.py: with the parameters offloaded on one GPU, fetches waited for by the
GPU instead of the host train to the same bits as DeepSpeed's own waits (one rank in a subprocess:
tests/scripts/offload_fetch_wait.py). The change covers CUDA only (a CPU rank's copies are synchronous)."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_script

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the change is for CUDA copy streams")
def test_fetches_waited_for_on_the_gpu_train_as_deepspeeds_host_waits():
    out = run_script("offload_fetch_wait", {"steps": 3, "accum": 2}, accelerator="cuda")
    ours, theirs = out["dstrain"], out["deepspeed"]
    assert ours["applied"] is True and theirs["applied"] is None
    assert len(ours["losses"]) == 6 and ours["losses"] == theirs["losses"]
    assert ours["losses"][-1] != ours["losses"][0]  # it trained
    assert ours["weights"] == theirs["weights"] and ours["weights_sum"] == theirs["weights_sum"]
