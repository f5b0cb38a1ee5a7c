"""dstrain/rank/offload_syncs.py: the ZeRO-1/2 CPU-offload optimizer without its per-parameter waits
trains exactly as DeepSpeed's own (real engines, DeepSpeedCPUAdam, one CPU rank, in a subprocess so its
process group stays out of the test process). Integration lane: DeepSpeed start-up and the CPU Adam op."""

from __future__ import annotations

import pytest

from one_rank import run_one_rank

pytestmark = pytest.mark.integration

SCRIPT = """
    from dstrain.rank.offload_syncs import remove_offload_syncs

    def train(stage, precision, accum, clip, patched):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 1))
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
                  "gradient_clipping": clip,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True, "check_grad_overflow": False}  # as dstrain renders bf16
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        applied = remove_offload_syncs(engine) if patched else None
        tracker = engine.optimizer.update_offload_overflow_tracker
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        generator = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(3 * accum):
            x = torch.randn(4, 32, generator=generator) * 5
            engine.backward(engine(x.to(dtype)).float().pow(2).mean())
            engine.step()
            norm = engine.get_global_grad_norm()  # the last update's: repeated between boundaries
            if norm is not None:
                norms.append(float(norm))
        weights = torch.cat([p.detach().float().flatten() for p in engine.module.parameters()]).tolist()
        return {"applied": applied, "tracker_patched": getattr(tracker, "__name__", "") == "_no_overflow_tracking",
                "norms": norms, "weights": weights}

    out = {}
    # A clip of 0.05 is below every norm here (each step clips, with the norm computed); 100 is above
    # them (the unscale factor is 1 and the pass over the gradients is skipped).
    for stage, precision, accum, clip in ((2, "fp32", 1, 0.05), (1, "fp32", 2, 0.05), (2, "bf16", 1, 0.05),
                                          (2, "fp32", 1, 100.0)):
        key = f"{stage}-{precision}-{accum}-clip{clip}"
        out[key] = {"deepspeed": train(stage, precision, accum, clip, False),
                    "dstrain": train(stage, precision, accum, clip, True)}
    result(out)
"""


def test_offload_optimizer_without_per_parameter_syncs_trains_as_deepspeeds_own():
    out = run_one_rank(SCRIPT)
    for key, runs in out.items():
        ours, theirs = runs["dstrain"], runs["deepspeed"]
        assert ours["applied"] is True, key
        assert ours["tracker_patched"] and not theirs["tracker_patched"], key  # no overflow check: no tracker
        assert len(ours["norms"]) == len(theirs["norms"]) >= 3, key
        assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6), key
        assert min(ours["norms"]) > 0.05, key  # so a clip at 0.05 acts on every step, one at 100 on none
        assert ours["weights"] == pytest.approx(theirs["weights"], rel=1e-6, abs=1e-7), key
