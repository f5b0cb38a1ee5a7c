"""engine_stats reads DeepSpeed's global gradient norm before clipping (DeepSpeed 0.19.8, real engines
on one CPU rank, in a subprocess so its process group stays out of the test process). Not the launcher,
but ~15 s of DeepSpeed start-up and four engines: it runs with the slower, integration lane."""

from __future__ import annotations

import pytest

from one_rank import run_one_rank

pytestmark = pytest.mark.integration

SCRIPT = """
    from dstrain.rank.metrics import engine_stats

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    torch.manual_seed(1)
    x = torch.randn(4, 16) * 10
    reference = build()
    reference(x).pow(2).mean().backward()
    out = {"reference": torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()}
    for stage, precision in ((0, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32")):
        model = build()
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.01, "zero_allow_untested_optimizer": True,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True, "check_grad_overflow": False}  # as dstrain resolves bf16
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        engine.backward(engine(x.to(dtype)).float().pow(2).mean())
        engine.step()
        out[f"{stage}-{precision}"] = engine_stats(engine)
    result(out)
"""


def test_engine_stats_gives_the_norm_before_clipping_for_zero_2_and_3_and_none_for_stage_0_fp32():
    out = run_one_rank(SCRIPT, timeout=300)
    reference = out["reference"]
    assert reference > 100  # far above the clip at 0.01: a clipped norm would read 0.01
    assert out["2-fp32"]["grad_norm"] == pytest.approx(reference, rel=1e-5)
    assert out["3-fp32"]["grad_norm"] == pytest.approx(reference, rel=1e-5)
    assert out["2-bf16"]["grad_norm"] == pytest.approx(reference, rel=2e-2)  # bf16 weights and input
    assert out["0-fp32"] == {}  # DeepSpeed clips with torch's clip_grad_norm_ and keeps no norm
