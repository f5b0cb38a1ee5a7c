"""dstrain/rank/zero3_host.py: with dstrain's ZeRO-3 host trims (current stream by device index,
print_rank_0 without a rank lookup, each fetch unit's parameters remembered) the built-in GPT trains
bit for bit as with DeepSpeed's own code: a real engine built as dstrain's worker builds it (zero.Init,
transformer blocks as ZeRO-3 leaf modules, no parameter persistent, so every block is fetched and
released), one rank in a subprocess. Integration lane: DeepSpeed start-up."""

from __future__ import annotations

import pytest
import torch

from one_rank import run_one_rank

pytestmark = pytest.mark.integration

SCRIPT = """
    from dstrain.config.resolve import resolve
    from dstrain.models import build_model
    from dstrain.rank import zero3_host
    from deepspeed.runtime.zero import partition_parameters, partitioned_param_coordinator

    accelerator = os.environ["DS_ACCELERATOR"]
    device = torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")
    sets = ["model.n_layer=3", "model.d_model=64", "model.n_head=4", "model.vocab_size=256", "data.seq_len=32",
            "train.micro_batch_size=2", "data.source=synthetic", "train.lr=1e-2"]

    def train(trimmed):
        resolved = resolve("stage3", None, sets, world_size=1, accelerator=accelerator, env={})
        ds_config = resolved.ds_config
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every block fetched
        applied = zero3_host.trim_zero3_host_work({}, accelerator) if trimmed else []
        torch.manual_seed(0)
        model = build_model(resolved.config, ds_config, device)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(5):  # one batch again and again: its loss must fall
            loss = engine((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()]).tolist()
        block = model.blocks[0]
        remembered = block.__dict__.get("_dstrain_params", {}).get(True)
        return {"applied": applied, "losses": losses, "weights": weights,
                "block_params_remembered": remembered is not None
                and [id(p) for p in remembered[1]] == [id(p) for p in block.parameters()],
                "print_guarded": getattr(partition_parameters.print_rank_0, "_dstrain_guarded", False),
                "iter_params_remembers": getattr(partitioned_param_coordinator.iter_params,
                                                 "_dstrain_remembers", False)}

    result({"deepspeed": train(False), "trimmed": train(True)})
"""


def _check(out, accelerator):
    own, trimmed = out["deepspeed"], out["trimmed"]
    assert not own["print_guarded"] and not own["block_params_remembered"]
    expected = ["print_rank_0 without a rank lookup", "each fetch unit's parameters remembered"]
    if accelerator == "cuda":
        expected.insert(0, "current stream by device index")
    assert trimmed["applied"] == expected
    assert trimmed["print_guarded"] and trimmed["iter_params_remembers"] and trimmed["block_params_remembered"]
    assert trimmed["losses"] == own["losses"]  # bit for bit
    assert trimmed["weights"] == own["weights"]
    assert own["losses"][-1] < own["losses"][0]  # it trained


def test_zero3_host_trims_train_bit_for_bit_as_deepspeeds_own_code():
    _check(run_one_rank(SCRIPT), "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (checked in the benchmark calls)")
def test_zero3_host_trims_on_a_gpu_train_bit_for_bit_as_deepspeeds_own_code():
    _check(run_one_rank(SCRIPT, accelerator="cuda"), "cuda")


def test_zero3_host_trims_switch_off():
    from dstrain.rank.zero3_host import trim_zero3_host_work
    assert trim_zero3_host_work({"DSTRAIN_ZERO3_HOST": "off"}, "cuda") == []
