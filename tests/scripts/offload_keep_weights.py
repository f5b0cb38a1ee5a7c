"""tests/test_offload_keep_weights.py's rank: trains a stack of linear layers with ZeRO-3, the parameters and
the optimizer offloaded and gradient accumulation, with DeepSpeed's releases ("deepspeed"), with
offload_keep_weights forced on alone ("keep"), and with every default change plus it forced on ("all"),
and sends back the losses, the trained weights and masters, and after each micro step how many of the
weights were still gathered on the device and the coordinator's count of gathered elements (what its
prefetch budget is checked against)."""

from __future__ import annotations

import deepspeed
import torch

from dstrain.config.schema import SpeedupsConfig
from dstrain.speedups import apply, state_of
from scripts.rank_setup import parameters, result, start_rank
from scripts.tiny_mlp import mlp_stack


def gathered(engine) -> int:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters() if not p.ds_persist)


def counted(engine) -> int:
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    return getattr(coordinator, "_PartitionedParameterCoordinator__n_available_params")


def train(device: str, variant: str, windows: int, accum: int, width: int) -> dict:
    model = mlp_stack(width, 4)
    pin = device == "cuda"
    # A reuse distance of 0 and a prefetch budget of about one layer: DeepSpeed releases every weight in
    # the forward and fetches it again in the backward, the case keeping saves most on.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 4 * width * width, "stage3_max_live_parameters": 8 * width * width,
            "overlap_comm": True, "offload_param": {"device": "cpu", "pin_memory": pin},
            "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
              "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    applied = kept = None
    if variant != "deepspeed":
        settings = SpeedupsConfig(offload_keep_weights=True, offload_accumulate=True)
        report = apply(engine, settings, only=("offload_keep_weights",) if variant == "keep" else None)
        applied = sorted(report.applied)
        kept = state_of(engine).kept_weight_bytes
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())  # each rank its own batches
    losses, held, counts = [], [], []
    for _ in range(windows * accum):
        x = torch.randn(4, 16, width, generator=generator).to(device=device, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        held.append(gathered(engine))
        counts.append(counted(engine))
    overlap = getattr(state_of(engine), "overlap", None) if variant != "deepspeed" else None
    if overlap is not None:
        overlap.drain()  # the last step's update: read below
    optimizer = engine.optimizer
    weights = torch.cat([p.ds_tensor.detach().float().flatten().cpu() for p in engine.module.parameters()])
    masters = torch.cat([m.detach().flatten() for m in optimizer.fp32_partitioned_groups_flat])
    return {"applied": applied, "kept_bytes": kept, "losses": losses, "held": held, "counted": counts,
            "count": sum(1 for _ in engine.module.parameters()),
            "weights": weights[::97].tolist(), "weights_sum": float(weights.double().sum()),
            "masters": masters[::97].tolist(), "masters_sum": float(masters.double().sum())}


def main(params: dict) -> None:
    device = start_rank(params)
    result({name: train(device, name, params["windows"], params["accum"], params["width"])
            for name in ("deepspeed", "keep", "all")})


if __name__ == "__main__":
    main(parameters())
