"""dstrain/speedups/zero3_flatten.py: ZeRO-3's parameter partitions flattened where they are, not through host
memory, give the engine the same flat buffer, the same views into it, and the same training (real
engines, one rank in a subprocess, the CPU accelerator; on a GPU the same code runs on the device)."""

from __future__ import annotations

import pytest
import torch

from one_rank import TINY_MLP, run_one_rank

SCRIPT = TINY_MLP + """
    from deepspeed.runtime.zero import stage3
    from dstrain.speedups import building_engine, zero3_flatten

    calls = []
    flatten = zero3_flatten.flatten_on_device
    zero3_flatten.flatten_on_device = lambda tensors: calls.append(len(tensors)) or flatten(tensors)
    original = stage3.defragment
    device = "cuda" if os.environ["DS_ACCELERATOR"] == "cuda" else "cpu"

    def build_and_train(ours):
        config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                  "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = tiny_mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if ours:
            with building_engine():  # as the ranks build their engines, every change on
                engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        buffer = engine.optimizer.lp_param_buffer
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        views = all(start <= p.ds_tensor.data_ptr() < end for p in model.parameters())
        on = str(buffer.device.type)
        flat = [float(x) for x in buffer.float()]
        norms = train_tiny_mlp(engine, 4, torch.bfloat16, device)
        masters = [float(x) for group in engine.optimizer.fp32_partitioned_groups_flat for x in group[:50]]
        return {"flat": flat, "dtype": str(buffer.dtype), "views": views, "device": on, "norms": norms, "masters": masters}

    theirs = build_and_train(False)
    ours = build_and_train(True)
    result({"theirs": theirs, "ours": ours, "calls": calls, "restored": stage3.defragment is original})
"""


def _assert_same(out: dict, device: str) -> None:
    ours, theirs = out["ours"], out["theirs"]
    assert out["calls"] == [6], out["calls"]  # one flatten of the MLP's six partitions, ours
    assert out["restored"] is True  # DeepSpeed's own function is back after the engine is built
    assert ours["dtype"] == theirs["dtype"] == "torch.bfloat16"
    assert ours["device"] == theirs["device"] == device
    assert len(ours["flat"]) == 6_337 and ours["flat"] == theirs["flat"]
    assert ours["views"] is True and theirs["views"] is True  # every partition lives in the buffer
    assert len(ours["norms"]) == 4 and ours["norms"] == theirs["norms"]
    assert ours["masters"] == theirs["masters"] and any(m != 0.0 for m in ours["masters"])


def test_partitions_flattened_in_place_give_the_same_buffer_views_and_training():
    _assert_same(run_one_rank(SCRIPT), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: there the flatten stays on the device")
def test_partitions_flattened_on_a_gpu_give_the_same_buffer_views_and_training():
    _assert_same(run_one_rank(SCRIPT, accelerator="cuda"), "cuda")
