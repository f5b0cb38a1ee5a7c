"""What a rank's start costs before its first step: DeepSpeed's Muon module imported without
TorchInductor (dstrain/speedups/muon_lazy_compile.py), torch._dynamo imported only when something compiles
(dstrain/speedups/dynamo_lazy_import.py) and py-cpuinfo asked once per machine (dstrain/op_cache.py
remember_cpu_info). Measured figures are in docs/performance.md, "Start-up"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def test_a_lazily_compiled_function_is_compiled_once_at_its_first_call(monkeypatch):
    from dstrain.speedups.muon_lazy_compile import compiled_at_first_call

    compiled = []
    real_compile = torch.compile

    def recording_compile(function, **kwargs):
        compiled.append(function)
        return real_compile(function, backend="eager")  # the same graph, run eagerly: no C++ build here

    def newton_step(x):
        return 1.5 * x - 0.5 * x @ x.T @ x

    monkeypatch.setattr(torch, "compile", recording_compile)
    lazy = compiled_at_first_call(newton_step)
    assert compiled == [] and lazy.__wrapped__ is newton_step and lazy.__name__ == "newton_step"
    x = torch.randn(4, 4)
    assert torch.equal(lazy(x), newton_step(x))
    assert torch.equal(lazy(2 * x), newton_step(2 * x))
    assert compiled == [newton_step]  # compiled at the first call only


@pytest.mark.slow
def test_deepspeeds_muon_module_imports_without_inductor_and_the_optimizer_check_answers_as_before():
    """In a fresh interpreter: the module DeepSpeed imports at every engine build comes in without
    TorchInductor, and DeepSpeed's own check then gives its answers (Muon's class is on its list). Only on the
    DeepSpeed releases the speed layer was verified on, as the ranks decide (0.18.9 imports Muon with
    `import deepspeed` already: there is nothing to change)."""
    from dstrain.speedups.registry import unverified
    if unverified():
        pytest.skip(f"nothing to check on this DeepSpeed: {unverified()}")
    script = """
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from dstrain.rank.runtime import skip_shared_memory_all_reduce_op
skip_shared_memory_all_reduce_op()  # as the ranks
deepspeed.init_distributed(dist_backend="gloo")  # the check asks the process group for this rank
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
from dstrain.speedups.muon_lazy_compile import MUON_MODULES, applies, muon_imported_lazily
before = applies()
with muon_imported_lazily():
    pass
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import zeropower_via_newtonschulz5
p = [torch.nn.Parameter(torch.zeros(2))]
print(json.dumps({"before": before, "after": applies(engine=object()),
    "muon": all(name in sys.modules for name in MUON_MODULES),
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "lazy": hasattr(zeropower_via_newtonschulz5, "__wrapped__"),
    "adamw": is_zero_supported_optimizer(torch.optim.AdamW(p)),
    "sgd": is_zero_supported_optimizer(torch.optim.SGD(p, lr=0.1)),
    "muon_listed": MuonWithAuxAdam in __import__("deepspeed.runtime.zero.utils").runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS}))
"""
    from dstrain.launcher.topology import free_port

    out = subprocess.run([sys.executable, "-c", script, str(free_port())], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == {"before": None, "after": None, "muon": True, "inductor": False, "lazy": True,
                     "adamw": True, "sgd": False, "muon_listed": True}


@pytest.mark.slow
def test_a_zero3_engine_trains_checkpoints_and_saves_without_torch_dynamo_and_compiling_still_works():
    """In a fresh rank-like process: a ZeRO-3 engine built as the ranks build it, with DeepSpeed's activation
    checkpointing, trains two steps and gives its optimizer state without importing torch._dynamo; the same
    run with the switch off (torch's marks, torch._dynamo imported) ends at the same weights to the bit; once
    torch._dynamo is imported, torch's own marks are back and a compiled function that checkpoints and
    zeroes gradients runs."""
    from dstrain.speedups.registry import unverified
    if unverified():
        pytest.skip(f"nothing to check on this DeepSpeed: {unverified()}")
    from one_rank import run_one_rank

    facts = run_one_rank("""
        from dstrain.config.schema import SpeedupsConfig
        from dstrain.speedups import building_engine
        from dstrain.speedups import dynamo_lazy_import as lazy

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

            def forward(self, x):
                return self.b(deepspeed.checkpointing.checkpoint(lambda h: torch.nn.functional.gelu(self.a(h)), x))

        def train(switch):
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
            with building_engine(SpeedupsConfig(dynamo_lazy_import=switch)):
                engine, *_ = deepspeed.initialize(model=Net(), config=config)
            deepspeed.checkpointing.configure(None)
            for step in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
            engine.optimizer.state_dict()
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                return [p.detach().clone() for p in engine.module.parameters()]

        lazy_weights = train(True)
        facts = {"dynamo_after_lazy_run": "torch._dynamo" in sys.modules, "stand_ins": len(lazy._marked)}
        stock_weights = train(False)
        facts["dynamo_after_stock_run"] = "torch._dynamo" in sys.modules
        facts["same_weights"] = all(torch.equal(a, b) for a, b in zip(lazy_weights, stock_weights))
        facts["stand_ins_left"] = len(lazy._marked)
        facts["marks_are_torchs"] = all(
            getattr(f.__wrapped__, "__dynamo_disable", None) is not f.__wrapped__
            for f in (torch.optim.Optimizer.zero_grad, torch.utils.checkpoint.checkpoint))

        opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        def step(x):
            opt.zero_grad()
            return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False) * 2
        x = torch.randn(3)
        facts["compiled_runs"] = torch.equal(torch.compile(step, backend="eager")(x), torch.sin(x) * 2)
        result(facts)
    """)
    assert facts.pop("stand_ins") > 4  # the optimizer's four, DeepSpeed's checkpoint and coordinator, ...
    assert facts == {"dynamo_after_lazy_run": False, "dynamo_after_stock_run": True, "same_weights": True,
                     "stand_ins_left": 0, "marks_are_torchs": True, "compiled_runs": True}


def test_cpu_info_is_asked_once_per_machine_and_read_back_by_later_processes(tmp_path, monkeypatch):
    import cpuinfo

    from dstrain.op_cache import remember_cpu_info

    asked = []
    real_answer = {"arch": "X86_64", "flags": ["avx2"], "brand_raw": "the CPU py-cpuinfo saw"}

    def py_cpuinfo():  # stands in for the 1 s subprocess; what is tested is who asks it and when
        asked.append(1)
        return dict(real_answer)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", py_cpuinfo)
    remember_cpu_info(tmp_path)
    assert cpuinfo.get_cpu_info() == real_answer and cpuinfo.get_cpu_info() == real_answer
    (record,) = tmp_path.glob("cpu_info-*.json")
    assert asked == [1] and json.loads(record.read_text()) == real_answer
    remember_cpu_info(tmp_path)  # a second time in one process changes nothing
    assert cpuinfo.get_cpu_info() == real_answer and asked == [1]

    # another process on this machine: py-cpuinfo unasked, the file answers
    monkeypatch.setattr(cpuinfo, "get_cpu_info", py_cpuinfo)
    remember_cpu_info(tmp_path)
    assert cpuinfo.get_cpu_info() == real_answer and asked == [1]
    record.write_text("{half a rec")  # unreadable: asked again and rewritten
    assert cpuinfo.get_cpu_info() == real_answer and asked == [1, 1]
    assert json.loads(record.read_text()) == real_answer
    assert not list(tmp_path.glob("*.tmp"))


def test_ranks_skip_deepspeeds_shared_memory_all_reduce_op_unless_a_layer_is_tensor_parallel():
    """DeepSpeed builds its CPU shared-memory all-reduce op at init_distributed (about 100 s of CPU at an
    environment's first run) for `inference_all_reduce`, which only tensor-parallel layers call. dstrain's
    ranks skip it for every other run: DeepSpeed's own `build_shm_op` then builds and loads nothing. (A
    launched run's rank logs show it too: test_run.py's default-job test.)"""
    import importlib

    from dstrain.rank.runtime import skip_shared_memory_all_reduce_op, uses_shared_memory_all_reduce

    assert not uses_shared_memory_all_reduce({})
    assert not uses_shared_memory_all_reduce({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 1}})
    assert uses_shared_memory_all_reduce({"tensor_parallel": {"autotp_size": 2}})
    assert uses_shared_memory_all_reduce({"tensor_parallel": {"tp": {"tp_size": 4}}})
    skip_shared_memory_all_reduce_op()
    deepspeed_comm = importlib.import_module("deepspeed.comm.torch")  # (`import ... as` finds deepspeed.comm's `torch`)
    assert deepspeed_comm.build_shm_op() is None
