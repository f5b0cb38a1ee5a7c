"""dstrain/speedups/zero3_step.py: ZeRO-3's step with the release, the norm and the persistent parameters'
gather batched trains as DeepSpeed's own step does: the same weights to the bit without clipping, the
same norms to rounding, the same skipped steps; and the gather after the step is one collective instead
of one a parameter (real engines, one rank and two CPU ranks in subprocesses so their process groups
stay out of the test process). Integration lane: DeepSpeed start-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from one_rank import ONE_RANK_PREAMBLE, TINY_MLP, rank_env, run_one_rank

pytestmark = pytest.mark.integration

SCRIPT = TINY_MLP + """
    import torch.distributed
    from deepspeed.comm import comm as ds_comm
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from dstrain.speedups import apply, state_of
    from dstrain.speedups.zero3_step import release_all_parameters
    STEP = ("zero3_step", "zero3_gather")  # the batched step, its gather regrouped as the worker has it

    device = "cuda" if os.environ["DS_ACCELERATOR"] == "cuda" else "cpu"
    gathers = {"count": 0}

    def counted_all_gather(*args, **kwargs):  # DeepSpeed's backend: every all-gather of its comm goes here
        gathers["count"] += 1
        return type(ds_comm.cdb).all_gather_into_tensor(ds_comm.cdb, *args, **kwargs)

    def real_elements(optimizer, flats):
        # each sub-group's flat partition without the padding of the parameters' last partitions, which
        # holds whatever its memory held (DeepSpeed's own runs differ from each other there)
        rank, values = torch.distributed.get_rank(), []
        for params, flat in zip(optimizer.fp16_groups, flats):
            offset = 0
            for p in params:
                size = p.ds_tensor.ds_numel
                real = min(size, max(0, p.ds_numel - rank * size))
                values += flat.detach().float().cpu()[offset:offset + real].tolist()
                offset += size
        return values

    def train(precision, accum, clip, overflow_at, bucket, variant, offload=False):
        model = tiny_mlp()  # 6,337 parameters
        zero = {"stage": 3, "sub_group_size": 4000,  # two sub-groups
                # the biases and the last layer's weight stay gathered between steps
                "stage3_param_persistence_threshold": 100}
        if bucket:  # the reduce bucket fills in the backward; a weight larger than it is reduced where it is
            zero["reduce_bucket_size"] = bucket
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accum,
                  "gradient_clipping": clip, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True, "check_grad_overflow": overflow_at is not None}
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        applied = "zero3_step" in apply(engine, only=STEP).applied if variant != "deepspeed" else None
        if variant != "deepspeed":
            apply(engine, only=("zero3_grads",))  # nothing without the lean step (offload)
        lean = {"zero3_step", "zero3_grads"} <= set(getattr(state_of(engine), "applied", []))
        unhooked = 0  # 0 without the lean step
        if variant == "unhooked" and "zero3_hooks" in apply(engine, only=("zero3_hooks",)).applied:
            unhooked = state_of(engine).unhooked
        if offload:
            return {"applied": applied, "unhooked": unhooked}
        # count the all-gathers of the steps (the persistent parameters' gather after each update)
        step = engine.optimizer.step
        def counting_step(*args, **kwargs):
            ds_comm.cdb.all_gather_into_tensor = counted_all_gather
            try:
                return step(*args, **kwargs)
            finally:
                del ds_comm.cdb.all_gather_into_tensor
        engine.optimizer.step = counting_step
        gathers["count"] = 0
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        norms = train_tiny_mlp(engine, 4 * accum, dtype, device, overflow_at)
        optimizer = engine.optimizer
        persistent = set(map(id, optimizer.persistent_parameters))
        params = list(model.parameters())
        loss = None
        if variant == "unhooked" and int(os.environ["WORLD_SIZE"]) == 1:
            probe = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
            loss = float(engine(probe).float().pow(2).mean())
            # every parameter released, as at the start of a step: the model's guard gathers the unhooked
            # layer's parameters at the next forward (its data is empty until then)
            release_all_parameters(engine.optimizer)
            assert engine.module[4].weight.numel() == 0
            assert float(engine(probe).float().pow(2).mean()) == loss
            # a checkpoint loaded into a fresh engine (DeepSpeed partitions the persistent parameters on
            # load and gathers them again): the unhooked layer computes with the loaded weights
            engine.save_checkpoint(CHECKPOINTS, tag=key_of(precision, accum, clip, overflow_at, bucket))
            fresh, *_ = deepspeed.initialize(model=tiny_mlp(), config=config)
            apply(fresh, only=STEP + ("zero3_hooks", "zero3_grads"))
            fresh.load_checkpoint(CHECKPOINTS, tag=key_of(precision, accum, clip, overflow_at, bucket))
            loss = [loss, float(fresh(probe).float().pow(2).mean())]
        return {"applied": applied, "lean": lean, "norms": norms, "unhooked": unhooked, "reloaded_loss": loss,
                "masters": real_elements(optimizer, optimizer.fp32_partitioned_groups_flat),
                "bit16": real_elements(optimizer, optimizer.fp16_partitioned_groups_flat),
                "skipped": engine.skipped_steps, "persistent": len(persistent), "gathers": gathers["count"],
                # between steps: the persistent parameters gathered and current, the others released
                "statuses_right": all(p.ds_status == (ZeroParamStatus.AVAILABLE if id(p) in persistent
                                                      else ZeroParamStatus.NOT_AVAILABLE) for p in params),
                # a list, not a generator: every rank gathers every parameter, whatever it finds
                "persistent_current": all([torch.equal(p.data.flatten().cpu(), whole(p))
                                           for p in params if id(p) in persistent])}

    def whole(param):
        # the parameter as every rank's partition makes it, gathered here apart from the step
        shares = [torch.empty_like(param.ds_tensor) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(shares, param.ds_tensor)
        return torch.cat(shares)[:param.numel()].cpu()

    def key_of(precision, accum, clip, overflow_at, bucket):
        return (f"{precision}-{accum}-clip{clip}" + (f"-bucket{bucket}" if bucket else "")
                + ("-overflow" if overflow_at is not None else ""))

    import tempfile
    CHECKPOINTS = tempfile.mkdtemp()
    out = {}
    for precision, accum, clip, overflow_at, bucket in CASES:
        out[key_of(precision, accum, clip, overflow_at, bucket)] = {
            name: train(precision, accum, clip, overflow_at, bucket, name)
            for name in ("deepspeed", "lean", "unhooked")}
    out["offload"] = train("bf16", 1, 0.0, None, None, "unhooked", offload=True)
    result(out)
"""

# A clip of 0.05 is below every norm here (each step clips); 0 turns clipping off. Accumulation 2 (the
# gradients added to their slots), with a reduce bucket of 3,000 elements (reduced twice in a backward; the
# 4,096-element weight reduced outside it); an overflow at the first micro-step (DeepSpeed skips that update).
CASES = (("bf16", 1, 0.0, None, None), ("bf16", 1, 0.05, None, None), ("fp32", 2, 0.0, None, 3000),
         ("bf16", 1, 0.0, 1, None))


def _assert_trains_as_deepspeed(out: dict, ranks: int) -> None:
    # CPU offload keeps its own step (offload_chunked_step_zero3.py) and its hooks
    assert out.pop("offload") == {"applied": False, "unhooked": 0}
    for key, by_name in out.items():
        # without the module hooks on the last layer (its weight and bias persistent), the same training
        unhooked = by_name.pop("unhooked")
        assert unhooked["unhooked"] == 1 and by_name["lean"]["unhooked"] == 0, key
        for name in ("norms", "masters", "bit16", "skipped", "gathers", "statuses_right", "persistent_current"):
            assert unhooked[name] == by_name["lean"][name], (key, name)
        if ranks == 1:  # a forward after a checkpoint load
            assert unhooked["reloaded_loss"][0] == unhooked["reloaded_loss"][1], key
    for key, by_name in out.items():
        ours, theirs = by_name["lean"], by_name["deepspeed"]
        assert ours["applied"] is True and ours["lean"] is True and theirs["lean"] is False, key
        assert len(ours["norms"]) >= 4, key
        assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-12), key  # both in fp64
        assert ours["skipped"] == theirs["skipped"] == (1 if key.endswith("overflow") else 0), key
        if key.split("-")[2] == "clip0.0":  # no clip factor made from the norm: the weights to the bit
            assert ours["masters"] == theirs["masters"], key
            assert ours["bit16"] == theirs["bit16"], key
        else:
            assert ours["masters"] == pytest.approx(theirs["masters"], rel=1e-5, abs=1e-7), key
        assert ours["statuses_right"] and theirs["statuses_right"], key
        assert ours["persistent"] == theirs["persistent"] == 4, key  # three biases and the last weight
        updates = 4 - ours["skipped"]
        # after the last step the persistent parameters hold what their partitions make
        assert ours["persistent_current"] is True and theirs["persistent_current"] is True, key
        if ranks == 1:  # nothing to gather on one rank: each parameter's data is its partition
            assert ours["gathers"] == theirs["gathers"] == 0, key
        else:  # one collective a persistent parameter for DeepSpeed, one for all of them here
            assert theirs["gathers"] == 4 * updates, key
            assert ours["gathers"] == updates, key


def test_lean_zero3_step_trains_as_deepspeeds_step_on_one_rank():
    _assert_trains_as_deepspeed(run_one_rank(f"    CASES = {CASES!r}\n" + SCRIPT), ranks=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_lean_zero3_step_trains_as_deepspeeds_step_on_a_gpu():
    _assert_trains_as_deepspeed(run_one_rank(f"    CASES = {CASES!r}\n" + SCRIPT, accelerator="cuda"), ranks=1)


@pytest.mark.parametrize("accelerator", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
])
def test_lean_zero3_step_trains_as_deepspeeds_step_on_two_ranks(accelerator):
    """Two ranks (gloo on CPU, NCCL on two GPUs), each holding half of every partition: the persistent
    parameters are gathered after each update, in one all-gather, whole and current."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    preamble = ONE_RANK_PREAMBLE.replace('RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"',
                                         'RANK=os.environ["TEST_RANK"], WORLD_SIZE="2", '
                                         'LOCAL_RANK=os.environ["TEST_RANK"]')
    preamble = preamble.replace('MASTER_PORT=str(port)', 'MASTER_PORT=os.environ["TEST_PORT"]')
    preamble = preamble.replace("torch.cuda.set_device(0)", 'torch.cuda.set_device(int(os.environ["TEST_RANK"]))')
    assert preamble.count("TEST_RANK") == 3 and "TEST_PORT" in preamble
    code = preamble + textwrap.dedent(f"    CASES = {CASES[:1] + CASES[2:3]!r}\n" + SCRIPT)
    env = rank_env(accelerator, {"TEST_PORT": str(port)})
    ranks = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "TEST_RANK": str(rank)})
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    results = []
    for stdout, stderr in outputs:
        line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
        assert line, stdout[-2000:] + stderr[-3000:]
        results.append(json.loads(line[len("RESULT "):]))
    for out in results:
        _assert_trains_as_deepspeed(out, ranks=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fast_current_stream_is_torchs_current_stream():
    """speedups/cuda_stream.py: DeepSpeed's accelerator gives the stream torch would, outside a
    stream context and inside one."""
    out = run_one_rank("""
        from deepspeed.accelerator import get_accelerator
        from dstrain.speedups import cuda_stream
        accelerator = get_accelerator()
        applied = cuda_stream.applies() is None
        cuda_stream.install()
        side = torch.cuda.Stream()
        outside = accelerator.current_stream() == torch.cuda.current_stream()
        with torch.cuda.stream(side):
            inside = accelerator.current_stream() == side and accelerator.current_stream(0) == side
        result({"applied": applied, "outside": outside, "inside": inside})
    """, accelerator="cuda")
    assert out == {"applied": True, "outside": True, "inside": True}
