"""Long-sequence memory switches: train.tiled_mlp (DeepSpeed's TiledMLP on each decoder layer's MLP of an
hf: model) and train.activation_checkpointing_offload (DeepSpeed's checkpoint hidden-states offload).

In process: a tiny Llama and a tiny Qwen2 give the same loss and every gradient with their MLPs tiled as
without (fp32, abs 1e-5), with and without transformers' activation checkpointing. One rank through
DeepSpeed (one subprocess for both stages, gloo): ZeRO-2 and ZeRO-3 (decoder layers as leaf modules, as
dstrain makes them), one SGD step tiled against one untiled: loss, gradient norm and weights equal. Config:
"auto"'s rule, and each refusal names its key (no launcher). The estimate's terms. On a GPU only (skipped without
CUDA): the checkpoint offload moves layer inputs to the host and keeps every gradient.
"""

from __future__ import annotations

import contextlib
import importlib.util
import copy
import textwrap

import pytest
import torch

from hf_models import save_tiny_llama, save_tiny_qwen2
from one_rank import run_one_rank

from dstrain.config.resolve import resolve
from dstrain.errors import UserError

transformers = pytest.importorskip("transformers")

# DeepSpeed's checkpoint offload manager is new in 0.19 (CI's oldest-DeepSpeed lane runs 0.18.9); where it is
# missing dstrain refuses the setting before any rank starts, which test_checkpoint_offload_is_checked_against_
# the_installed_deepspeed checks on both kinds of DeepSpeed.
HAS_OFFLOAD_MANAGER = importlib.util.find_spec("deepspeed.runtime.activation_checkpointing.offload_activations") is not None
needs_offload_manager = pytest.mark.skipif(
    not HAS_OFFLOAD_MANAGER,
    reason="this DeepSpeed has no activation checkpoint offload manager (new in 0.19), so dstrain refuses "
           "train.activation_checkpointing_offload here (checked by the refusal test) and there is no offload to run")

BUILDERS = {"llama": save_tiny_llama, "qwen2": save_tiny_qwen2}


def problems(*sets: str, accelerator: str = "cpu", preset: str = "stage2") -> dict[str, str]:
    with pytest.raises(UserError) as caught:
        resolve(preset, None, list(sets), world_size=1, accelerator=accelerator)
    return {p.where.split(": ")[-1]: p.message for p in caught.value.problems}


# ------------------------------------------------------------------ the tiled MLP, in process


def _loss_and_grads(model, inputs, targets):
    from dstrain.models.hf import CausalLM
    model.zero_grad(set_to_none=True)
    loss = CausalLM(model)((inputs, targets))
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(BUILDERS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_same_loss_and_gradients(tmp_path, family, checkpointing):
    from dstrain.models import tiled_mlp
    directory = BUILDERS[family](tmp_path / family)
    whole = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tiled = copy.deepcopy(whole)
    assert len(tiled_mlp.apply(tiled, 3)) == 2  # both decoder layers' MLPs
    for model in (whole, tiled):
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 41))  # 40 positions: 3 shards of 14, 14 and 12
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss, grads = _loss_and_grads(whole, inputs, targets)
    tiled_loss, tiled_grads = _loss_and_grads(tiled, inputs, targets)
    assert tiled_loss == pytest.approx(loss, abs=1e-5)
    assert sorted(grads) == sorted(tiled_grads)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], rtol=0, atol=1e-5, msg=name)


def test_only_mlp_classes_are_tiled_and_shards_follow_alsts_rule(tmp_path):
    from dstrain.models import tiled_mlp
    model = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "llama"))
    assert [type(m).__name__ for m in tiled_mlp.mlp_modules(model)] == ["LlamaMLP", "LlamaMLP"]
    assert tiled_mlp.mlp_modules(torch.nn.Linear(2, 2)) == []
    assert tiled_mlp.hidden_size(model) == 32
    assert (tiled_mlp.auto_shards(32768, 2048), tiled_mlp.auto_shards(100, 2048)) == (16, 1)


# ------------------------------------------------------------------ the tiled MLP through DeepSpeed, one rank

ONE_STEP = """
    import copy
    from transformers import AutoModelForCausalLM
    from deepspeed.utils import set_z3_leaf_modules
    from dstrain.models import tiled_mlp
    from dstrain.models.hf import CausalLM, decoder_blocks

    def step(tile, stage):
        model = AutoModelForCausalLM.from_pretrained(DIRECTORY, dtype=torch.float32)
        if tile:
            tiled_mlp.apply(model, 3)
        if stage == 3:  # each decoder layer one fetch, as dstrain makes it (preflight._fetch_blocks_whole)
            set_z3_leaf_modules(model, [type(decoder_blocks(model)[0])])
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=CausalLM(model), config=config)
        torch.manual_seed(0)
        tokens = torch.randint(0, 256, (2, 41))
        loss = engine((tokens[:, :-1], tokens[:, 1:]))
        engine.backward(loss)
        with torch.no_grad():
            engine.step()
        norm = float(engine.get_global_grad_norm())
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            weights = [p.detach().clone().flatten().tolist() for p in params]
        return loss.item(), norm, weights

    found = {}
    for stage in STAGES:  # each stage its own two engines, one after the other
        (loss, norm, weights), (tiled_loss, tiled_norm, tiled_weights) = step(False, stage), step(True, stage)
        found[stage] = {"loss": [loss, tiled_loss], "norm": [norm, tiled_norm],
                        "weights": max(max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(weights, tiled_weights))}
    result(found)
"""

ZERO_STAGES = [2, 3]


@pytest.fixture(scope="module")
def zero_steps(tmp_path_factory) -> dict:
    """ONE_STEP at each of ZERO_STAGES on one rank, one start-up for both: by stage (as a string, JSON's key),
    the tiled and untiled engines' loss, gradient norm and largest weight difference after one step."""
    directory = save_tiny_qwen2(tmp_path_factory.mktemp("tiled_zero") / "qwen2")
    return run_one_rank(f"DIRECTORY, STAGES = {str(directory)!r}, {ZERO_STAGES!r}\n" + textwrap.dedent(ONE_STEP))



@pytest.mark.slow
@pytest.mark.oldest_deepspeed  # real ZeRO-2/3 engines on one rank: DeepSpeed's version matters
@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_tiled_mlp_trains_as_the_whole_mlp_under_zero(zero_steps, stage):
    """ZeRO reduces each MLP gradient once, after the last shard (TiledMLP's ds_grad_is_ready), and at
    ZeRO-3 the leaf decoder layer's weights stay gathered while its shards recompute in backward. Reads
    `zero_steps`' run of this stage (both stages share its one-rank process)."""
    found = zero_steps[str(stage)]
    assert found["loss"][1] == pytest.approx(found["loss"][0], abs=1e-5)
    assert found["norm"][1] == pytest.approx(found["norm"][0], rel=1e-5)
    assert found["norm"][0] > 0
    assert found["weights"] <= 1e-5


# ------------------------------------------------------------------ config


def test_auto_is_on_from_16384_tokens_of_a_sequence_per_rank_on_cuda_only():
    def decided(accelerator: str, *sets: str, micro: int = 1):
        resolved = resolve("stage2", None, ["model.name=hf:some/model", f"train.micro_batch_size={micro}", *sets],
                           world_size=4, accelerator=accelerator)
        return resolved.config.train.tiled_mlp, resolved.sources["train.tiled_mlp"]

    assert decided("cuda", "data.seq_len=16384") == (True, "auto: on (16,384 tokens of a sequence per rank >= 16,384)")
    on, why = decided("cuda", "data.seq_len=16384", "train.sequence_parallel=2")  # 8,192 a rank
    assert not on and "8,192 tokens of a sequence per rank < 16,384" in why
    # Many short sequences in a micro batch: the recompute measured 18-22% slower at 4 x 2,048 tokens
    assert decided("cuda", "data.seq_len=2048", micro=8)[0] is False
    assert decided("cuda", "data.seq_len=32768", "train.sequence_parallel=2")[0] is True
    assert decided("cpu", "data.seq_len=16384") == (False, "auto: off (CPU ranks)")
    assert decided("cuda", "data.seq_len=16384", "model.name=gpt")[0] is False
    assert decided("cuda", "data.seq_len=16384", "train.tiled_mlp=false")[0] is False


def test_tiled_mlp_true_is_refused_where_it_cannot_apply():
    found = problems("train.tiled_mlp=true")
    assert "'gpt' is not an \"hf:\" model" in found["train.tiled_mlp"]
    found = problems("model.name=hf:some/model", "train.tiled_mlp=true", "model.lora={r: 4}", preset="stage3")
    assert "frozen weights" in found["train.tiled_mlp"]
    auto = resolve("stage3", None, ["model.name=hf:some/model", "model.lora={r: 4}", "data.seq_len=16384"],
                   world_size=1, accelerator="cuda")
    assert auto.config.train.tiled_mlp is False and "frozen weights" in auto.sources["train.tiled_mlp"]


@pytest.mark.slow
def test_config_command_exits_2_naming_the_keys():
    from launcher import dstrain
    result = dstrain("config", "--preset", "stage2", "--accelerator", "cpu", "--set", "train.tiled_mlp=true",
                     "--set", "train.activation_checkpointing_offload=true")
    assert result.returncode == 2
    assert "train.tiled_mlp" in result.stderr + result.stdout
    assert "train.activation_checkpointing_offload" in result.stderr + result.stdout


def test_a_model_without_mlp_modules_is_refused_for_true_and_off_for_auto(tmp_path):
    from dstrain.launcher.preflight import _decide_tiled_mlp
    sets = ["model.name=hf:some/model", "data.seq_len=16384"]
    auto = resolve("stage2", None, sets, world_size=1, accelerator="cuda")
    _decide_tiled_mlp(auto, mlps=0)
    assert auto.config.train.tiled_mlp is False and "no decoder layer" in auto.sources["train.tiled_mlp"]
    chosen = resolve("stage2", None, [*sets, "train.tiled_mlp=true"], world_size=1, accelerator="cuda")
    with pytest.raises(UserError, match="train.tiled_mlp"):
        _decide_tiled_mlp(chosen, mlps=0)
    _decide_tiled_mlp(chosen, mlps=2)
    assert chosen.config.train.tiled_mlp is True


def test_the_model_check_counts_the_mlps_it_can_tile(tmp_path):
    from dstrain.models import check_model
    resolved = resolve("stage2", None, [f"model.name=hf:{save_tiny_llama(tmp_path / 'llama')}",
                                        "data.tokenizer=byte"], world_size=1, accelerator="cpu")
    assert check_model(resolved.config).mlps == 2


def test_checkpoint_offload_is_refused_without_checkpointing_on_cpu_and_for_the_gpt():
    found = problems("model.name=hf:some/model", "train.activation_checkpointing_offload=true")
    message = found["train.activation_checkpointing_offload"]
    assert "train.activation_checkpointing is false" in message or "CPU ranks" in message
    with pytest.raises(UserError) as caught:
        resolve("stage2", None, ["model.name=hf:some/model", "train.activation_checkpointing_offload=true"],
                world_size=1, accelerator="cpu")
    messages = [p.message for p in caught.value.problems]
    assert any("train.activation_checkpointing is false" in m for m in messages)
    assert any("on CPU ranks" in m for m in messages)
    gpt = problems("train.activation_checkpointing=true", "train.activation_checkpointing_offload=true",
                   accelerator="cuda")
    assert "'gpt' is not an \"hf:\" model" in gpt["train.activation_checkpointing_offload"]
    ok = resolve("stage2", None, ["model.name=hf:some/model", "train.activation_checkpointing=true",
                                  "train.activation_checkpointing_offload=true"], world_size=1, accelerator="cuda")
    assert ok.config.train.activation_checkpointing_offload is True


def test_checkpoint_offload_is_checked_against_the_installed_deepspeed(tmp_path):
    """Accepted where DeepSpeed has the offload manager (0.19); refused before any rank starts where it has
    not (0.18), naming the setting and the DeepSpeed that has it."""
    from dstrain.launcher.preflight import check_runnable
    resolved = resolve("stage3", None, [f"model.name=hf:{save_tiny_llama(tmp_path / 'llama')}", "data.tokenizer=byte",
                                        "train.activation_checkpointing=true",
                                        "train.activation_checkpointing_offload=true"],
                       world_size=1, accelerator="cuda", env={})
    if HAS_OFFLOAD_MANAGER:
        check_runnable(resolved)
        return
    with pytest.raises(UserError) as err:
        check_runnable(resolved)
    message = str(err.value)
    assert "no activation checkpoint offload" in message and "train.activation_checkpointing_offload" in message
    assert "deepspeed==0.19.8" in message


@needs_offload_manager
def test_checkpoint_offload_changes_nothing_without_a_gpu(tmp_path):
    """On the CPU accelerator DeepSpeed's manager offloads nothing (is_synchronized_device): the context the
    loop enters is harmless there, which is why dstrain refuses the switch on CPU ranks rather than pretend."""
    from types import SimpleNamespace

    from dstrain.rank.runtime import activation_offload
    model = transformers.AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "llama"))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    train = SimpleNamespace(activation_checkpointing_offload=True)
    context = activation_offload(SimpleNamespace(train=train))
    tokens = torch.randint(0, 256, (1, 16))
    manager = context()
    with manager:
        model(input_ids=tokens, labels=tokens).loss.backward()
    stats = manager.stats
    assert stats.marked_tensors == 2 and stats.offloaded_tensors == 0  # each layer's input marked, none moved


# ------------------------------------------------------------------ the estimate


def test_the_estimate_counts_one_mlp_shard_and_offloaded_checkpoints():
    from dstrain.tools.estimate import memory as E
    work = E.Workload(params=10**9, largest_layer_params=10**8, n_layer=16, d_model=2048, n_head=16,
                      seq_len=32768, micro_batch=1, activation_checkpointing=False, cpu_checkpointing=False,
                      precision="bf16", vocab_size=32000, sequence_parallel=2)
    hw = E.Hardware(gpus_per_node=2, nodes=1, gpu_mem_bytes=80 * 2**30, cpu_mem_bytes=512 * 2**30)

    def activations(**changes):
        gpu, host = E._activations(E.replace(work, **changes), 2)
        return gpu, host

    local, h, b = 16384, 2048, 1
    whole, _ = activations()
    tiled, _ = activations(tiled_mlp=True)  # 8 shards of 2,048 tokens: ceil(16384 / 2048)
    assert whole["all_blocks"] - tiled["all_blocks"] == 16 * 17 * local * b * h
    assert tiled["tiled_mlp_shard"] == 19 * 2048 * b * h
    assert activations(tiled_mlp=True, tiled_mlp_shards=4)[0]["tiled_mlp_shard"] == 19 * 4096 * b * h
    on_gpu, _ = activations(activation_checkpointing=True)
    offloaded, host = activations(activation_checkpointing=True, cpu_checkpointing=True)
    assert "checkpointed_block_inputs" not in offloaded
    assert host["checkpointed_block_inputs"] == on_gpu["checkpointed_block_inputs"] == 16 * 2 * local * b * h
    stage3 = E.estimate_one("stage3", E.Placement(stage=3), E.replace(work, tiled_mlp=True), hw)
    assert stage3.activation_bytes_per_gpu == sum(tiled.values())


def test_the_planner_takes_both_switches_from_the_config():
    from dstrain.tools.estimate.memory import workload
    resolved = resolve("stage2", None, ["model.name=hf:some/model", "data.seq_len=16384",
                                        "train.activation_checkpointing=true",
                                        "train.activation_checkpointing_offload=true", "train.tiled_mlp_shards=4"],
                       world_size=1, accelerator="cuda")
    work = workload(resolved.config, resolved.ds_config, 10**9, 10**8, True)
    assert (work.tiled_mlp, work.tiled_mlp_shards, work.cpu_checkpointing) == (True, 4, True)


def test_the_plan_needs_fewer_ranks_with_the_tiled_mlp(tmp_path):
    """The tiny Llama at 16M tokens on 4 x 80 GiB: stage1 over 2 sequence-parallel ranks with the whole MLP
    (tests/test_sequence_parallel.py), on one rank with it tiled (auto: on, CUDA and >= 16,384 tokens a sequence)."""
    from dstrain.tools.estimate.planner import make_plan
    model_dir = save_tiny_llama(tmp_path / "llama")

    def plan(tiled: str):
        sets = [f"model.name=hf:{model_dir}", "data.seq_len=16777216", "train.micro_batch_size=1",
                f"train.tiled_mlp={tiled}", "train.loss_chunking=false"]  # the MLP's saving alone
        found = make_plan(None, sets, None, 4, 1, 80, 512, "cuda")
        return found.recommended, found.sequence_parallel

    assert plan("false") == ("stage1", 2)
    assert plan("auto") == ("stage1", 1)


# ------------------------------------------------------------------ on a GPU (skipped without CUDA)


@needs_offload_manager
@pytest.mark.skipif(not torch.cuda.is_available(), reason="checkpoint offload moves GPU activations: needs CUDA")
def test_checkpoint_offload_moves_layer_inputs_and_keeps_the_gradients(tmp_path):
    """A tiny Llama on GPU 0 with transformers' checkpointing: inside the manager the layers' inputs go to
    host memory (all but the newest), and the loss and every gradient equal those without it."""
    from types import SimpleNamespace

    from dstrain.rank.runtime import activation_offload
    directory = save_tiny_llama(tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, 256, (2, 64), device="cuda")

    def loss_and_grads(context):
        model.zero_grad(set_to_none=True)
        with context:
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
        torch.cuda.synchronize()
        return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}

    loss, grads = loss_and_grads(contextlib.nullcontext())
    manager = activation_offload(SimpleNamespace(train=SimpleNamespace(activation_checkpointing_offload=True)))()
    offloaded_loss, offloaded_grads = loss_and_grads(manager)
    stats = manager.stats  # 2 layers: the first's input offloaded, the newest kept on the GPU
    assert stats.offloaded_tensors >= 1 and stats.restored_tensors == stats.offloaded_tensors
    assert offloaded_loss == pytest.approx(loss, abs=1e-6)
    for name in grads:
        torch.testing.assert_close(offloaded_grads[name], grads[name], rtol=0, atol=1e-6, msg=name)
