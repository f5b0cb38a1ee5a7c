"""Facts the speed work relies on: the FLOPs count behind TFLOP/s and MFU, the GPU peak table, the
ZeRO-3 fetch unit dstrain renders for the built-in GPT, and a pre-launch model count that stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dstrain.config.resolve import resolve
from dstrain.config.speed_defaults import GPT_ZERO3_LEAF, SMALL_GPT_PARAMS
from dstrain.hardware import dense_bf16_peak_tflops

SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.vocab_size=256", "data.seq_len=32"]


def test_flops_per_token_counts_the_tied_lm_head_as_a_matmul():
    from dstrain.models.gpt import GPT, flops_per_token
    layers, width, seq, vocab = 2, 64, 32, 256
    n_params = sum(p.numel() for p in GPT(vocab, seq, width, layers, 2).parameters())  # tied head once
    blocks = n_params - (vocab + seq) * width  # every block matrix and norm, no embedding
    expected = 6.0 * (blocks + vocab * width) + 12.0 * layers * width * seq
    assert flops_per_token(n_params, layers, width, seq, vocab) == expected


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0),
                                        ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0)])
def test_dense_bf16_peak_is_found_from_the_device_name(name, peak):
    assert dense_bf16_peak_tflops(name) == peak


def test_dense_bf16_peak_of_an_unknown_device_is_none():
    assert dense_bf16_peak_tflops("CPU (2 cores)") is None


def test_stage3_fetches_each_gpt_block_as_one_unit():
    ds = resolve("stage3", None, SMALL, world_size=1, accelerator="cpu", env={}).ds_config
    assert ds["zero_optimization"]["leaf_module"] == {"classes": [GPT_ZERO3_LEAF]}


def test_the_leaf_class_name_is_the_built_in_gpt_block():
    from dstrain.models.gpt import Block
    assert GPT_ZERO3_LEAF == f"{Block.__module__}.{Block.__qualname__}"


def test_a_user_leaf_setting_and_other_stages_are_left_alone():
    mine = resolve("stage3", None, SMALL + ["deepspeed.zero_optimization.stage3_module_granularity_threshold=5000"],
                   world_size=1, accelerator="cpu", env={}).ds_config["zero_optimization"]
    assert "leaf_module" not in mine and mine["stage3_module_granularity_threshold"] == 5000
    for preset in ("stage2", "stage3_nvme"):
        ds = resolve(preset, None, SMALL, world_size=1, accelerator="cpu", env={}).ds_config
        assert "leaf_module" not in ds["zero_optimization"], preset


GPT_406M = ["model.n_layer=24", "model.d_model=1024", "model.n_head=16", "model.vocab_size=100352", "data.seq_len=1024"]
GPT_1_3B = ["model.n_layer=24", "model.d_model=2048", "model.n_head=16", "model.vocab_size=50304", "data.seq_len=1024"]
GPT_2_65B = ["model.n_layer=32", "model.d_model=2560", "model.n_head=20", "model.vocab_size=50304", "data.seq_len=2048"]
GPT_3_3B = ["model.n_layer=40", "model.d_model=2560", "model.n_head=20", "model.vocab_size=50304", "data.seq_len=2048"]
ZERO = "deepspeed.zero_optimization"


@pytest.mark.parametrize("shape, n_layer, d_model", [(GPT_406M, 24, 1024), (GPT_1_3B, 24, 2048), (GPT_2_65B, 32, 2560)])
def test_stage3_keeps_a_small_gpts_blocks_whole_on_gpus(shape, n_layer, d_model):
    resolved = resolve("stage3", None, shape, world_size=2, accelerator="cuda", env={})
    zero = resolved.ds_config["zero_optimization"]
    # the MLP's 4d x d weight is a block's largest: every block persists, the token embedding not
    assert zero["stage3_param_persistence_threshold"] == 4 * d_model * d_model
    assert zero["memory_efficient_linear"] is False
    note = resolved.sources[f"{ZERO}.stage3_param_persistence_threshold"]
    whole_gib = 2 * n_layer * 12 * d_model ** 2 / 2**30  # the blocks' bf16 weights
    assert note.startswith("dstrain default") and f"({whole_gib:.1f} GiB of weights a GPU" in note  # what it costs


def test_eager_stage3_on_one_gpu_keeps_blocks_whole_at_any_size():  # one rank's shard is the whole model
    eager = GPT_1_3B + ["deepspeed.compile.deepcompile=false"]
    zero = resolve("stage3", None, eager, world_size=1, accelerator="cuda", env={}).ds_config["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 4 * 2048 * 2048 and zero["memory_efficient_linear"] is False


@pytest.mark.parametrize("preset, sets, accelerator, threshold, linear", [
    ("stage3", GPT_3_3B, "cuda", 100000, None),  # above 3B parameters on two GPUs: the shards are what stage 3 is for
    ("stage3", GPT_406M, "cpu", 100000, None),  # measured on GPUs only
    ("stage3_offload", GPT_406M, "cuda", 100000, None),  # with offload: not measured
    ("stage3", GPT_406M + [f"{ZERO}.stage3_param_persistence_threshold=200000"], "cuda", 200000, None),  # the user's
    ("stage3", GPT_406M + [f"{ZERO}.memory_efficient_linear=true"], "cuda", 100000, True),
])
def test_stage3_keeps_its_shards_elsewhere(preset, sets, accelerator, threshold, linear):
    zero = resolve(preset, None, sets, world_size=2, accelerator=accelerator, env={}).ds_config["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == threshold
    assert zero.get("memory_efficient_linear") == linear


GPT_3_78B = ["model.n_layer=32", "model.d_model=3072", "model.n_head=24", "model.vocab_size=50304", "data.seq_len=2048",
             "train.micro_batch_size=2"]
LARGEST_3_78B = 50304 * 3072  # its token embedding


@pytest.mark.parametrize("gpu_gib, world, whole", [
    (80, 4, True), (80, 2, True),  # estimated 41 / 54 GiB a GPU with the blocks whole: under 85% of 80
    (40, 4, False),  # 41 GiB would not fit: the blocks stay split, as DeepSpeed renders them
    (None, 4, False),  # no GPU on the launching host: nothing known, nothing changed
    (80, 1, False),  # one GPU: speed_defaults keeps them whole already (a rank's shard is the whole model)
])
def test_a_large_gpts_blocks_stay_whole_where_the_estimate_says_they_fit(gpu_gib, world, whole):
    from dstrain.launcher.preflight import LARGE_GPT_WHOLE_MAX_SHARE, keep_large_gpt_blocks_whole
    from dstrain.tools.estimate import memory as E
    from dstrain.tools.estimate.memory import workload
    resolved = resolve("stage3", None, GPT_3_78B, world_size=world, accelerator="cuda", env={})
    params = 50304 * 3072 + 2048 * 3072 + 32 * 12 * 3072 ** 2
    assert params > SMALL_GPT_PARAMS
    before = dict(resolved.ds_config["zero_optimization"])
    assert keep_large_gpt_blocks_whole(resolved, params, LARGEST_3_78B, lambda: gpu_gib and gpu_gib * 2**30) is whole
    zero = resolved.ds_config["zero_optimization"]
    if not whole:
        assert zero == before
        return
    assert zero["stage3_param_persistence_threshold"] == 4 * 3072 ** 2 and zero["memory_efficient_linear"] is False
    note = resolved.sources[f"{ZERO}.stage3_param_persistence_threshold"]
    assert "each block stays whole" in note and f"of {gpu_gib} GiB" in note
    # what the note gives as the estimate is the estimate of what now runs, under the share
    hw = E.Hardware(gpus_per_node=world, nodes=1, gpu_mem_bytes=gpu_gib * 2**30, cpu_mem_bytes=256 * 2**30)
    work = workload(resolved.config, resolved.ds_config, params, 50304 * 3072, False)
    peak = E.estimate_one("stage3", E.placement_from_ds_config(resolved.ds_config), work, hw).gpu_bytes_per_gpu
    assert f"estimated peak {peak / 2**30:.1f} of" in note and peak <= LARGE_GPT_WHOLE_MAX_SHARE * gpu_gib * 2**30


def test_a_large_gpts_blocks_stay_split_where_the_user_chose(tmp_path):
    from dstrain.launcher.preflight import keep_large_gpt_blocks_whole
    params = 50304 * 3072 + 2048 * 3072 + 32 * 12 * 3072 ** 2
    for extra in ([f"{ZERO}.stage3_param_persistence_threshold=200000"], [f"{ZERO}.memory_efficient_linear=true"]):
        resolved = resolve("stage3", None, GPT_3_78B + extra, world_size=4, accelerator="cuda", env={})
        zero = dict(resolved.ds_config["zero_optimization"])
        assert keep_large_gpt_blocks_whole(resolved, params, LARGEST_3_78B, lambda: 80 * 2**30) is False, extra
        assert resolved.ds_config["zero_optimization"] == zero
    # a user's DeepSpeed JSON may use DeepSpeed's field names; adding the alias beside one would make
    # DeepSpeed refuse the config at every rank's start ("Extra inputs are not permitted")
    for key in ("param_persistence_threshold", "model_persistence_threshold"):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                    "zero_optimization": {"stage": 3, key: 100000}}))
        resolved = resolve(None, None, GPT_3_78B, world_size=4, accelerator="cuda",
                           env={"PL_DEEPSPEED_CONFIG_PATH": str(path)})
        zero = dict(resolved.ds_config["zero_optimization"])
        assert keep_large_gpt_blocks_whole(resolved, params, LARGEST_3_78B, lambda: 80 * 2**30) is False, key
        assert resolved.ds_config["zero_optimization"] == zero
    offload = resolve("stage3_offload", None, GPT_3_78B, world_size=4, accelerator="cuda", env={})
    assert keep_large_gpt_blocks_whole(offload, params, LARGEST_3_78B, lambda: 80 * 2**30) is False  # with offload: not measured
    small = resolve("stage3", None, GPT_2_65B, world_size=4, accelerator="cuda", env={})
    asked = []  # nvidia-smi is asked only where the rest applies
    assert keep_large_gpt_blocks_whole(small, 2_650_000_000, 50304 * 2560, lambda: asked.append(1)) is False and not asked


def test_a_large_gpts_blocks_stay_split_where_they_would_turn_auto_checkpointing_on():
    """auto turns checkpointing on over half the GPU (estimate.memory.auto_checkpointing): 3.78B at micro
    batch 2 on 4 x 80 GiB needs 36 GiB split, 41 GiB whole, so whole blocks would turn recompute on."""
    from dstrain.launcher.preflight import keep_large_gpt_blocks_whole
    params = 50304 * 3072 + 2048 * 3072 + 32 * 12 * 3072 ** 2
    auto = resolve("stage3", None, GPT_3_78B + ["train.activation_checkpointing=auto"], world_size=4,
                   accelerator="cuda", env={})
    assert keep_large_gpt_blocks_whole(auto, params, LARGEST_3_78B, lambda: 80 * 2**30) is False
    roomy = resolve("stage3", None, GPT_3_78B + ["train.activation_checkpointing=auto"], world_size=4,
                    accelerator="cuda", env={})
    assert keep_large_gpt_blocks_whole(roomy, params, LARGEST_3_78B, lambda: 141 * 2**30) is True  # off either way on an H200


def test_the_estimate_plans_what_a_run_on_those_gpus_renders():
    from dstrain.tools.estimate.planner import make_plan
    shape = GPT_3_78B
    big = next(e for e in make_plan(None, shape, None, 4, 1, 80, 256, "cuda").estimates if e.name == "stage3")
    small = next(e for e in make_plan(None, shape, None, 4, 1, 40, 256, "cuda").estimates if e.name == "stage3")
    assert big.placement.stage3_param_persistence_threshold == 4 * 3072 ** 2  # whole where they fit
    assert small.placement.stage3_param_persistence_threshold == 100000  # split where they would not
    assert big.gpu_bytes_per_gpu > small.gpu_bytes_per_gpu


def test_the_estimate_counts_whole_blocks_on_every_gpu():
    from dstrain.tools.estimate import memory as E
    work = E.Workload(params=405_899_264, largest_layer_params=100352 * 1024, n_layer=24, d_model=1024, n_head=16,
                      seq_len=1024, micro_batch=8, activation_checkpointing=False, cpu_checkpointing=False,
                      precision="bf16", vocab_size=100352)
    hw = E.Hardware(gpus_per_node=2, nodes=1, gpu_mem_bytes=80 * 2**30, cpu_mem_bytes=256 * 2**30,
                    nvme_free_bytes=None, accelerator="cuda")
    ds = resolve("stage3", None, GPT_406M, world_size=2, accelerator="cuda", env={}).ds_config
    whole = E.estimate_one("stage3", E.placement_from_ds_config(ds), work, hw)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 100000
    sharded = E.estimate_one("stage3", E.placement_from_ds_config(ds), work, hw)
    persistent = work.params - 100352 * 1024  # all but the token embedding
    assert whole.gpu_bytes_per_gpu - sharded.gpu_bytes_per_gpu == 2 * (persistent - persistent // 2)


@pytest.mark.slow
def test_counting_the_model_before_launch_does_not_import_torch_dynamo():
    code = ("import sys; from dstrain.models import count_model; from dstrain.models.gpt import GPT; "
            "print(count_model(lambda: GPT(256, 32, 64, 2, 2))[0], 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from dstrain.models.gpt import GPT
    assert out == [str(sum(p.numel() for p in GPT(256, 32, 64, 2, 2).parameters())), "False"]


LONG_RUN = ["train.max_steps=5000"]  # long enough to repay DeepCompile's compile (finding 32)


def test_one_gpu_stage3_stays_eager_in_long_runs_and_says_why():
    """Eager stage 3 with dstrain's step and unhooked blocks ran as fast as DeepCompile (findings 36, 37)."""
    for sets in (GPT_406M + LONG_RUN, GPT_406M):
        resolved = resolve("stage3", None, sets, world_size=1, accelerator="cuda", env={})
        assert resolved.ds_config["compile"] == {"deepcompile": False} and resolved.config.train.compile is False
        assert "ran as fast" in resolved.sources["deepspeed.compile.deepcompile"]
        assert resolved.ds_config["zero_optimization"]["leaf_module"] == {"classes": [GPT_ZERO3_LEAF]}


def test_a_users_deepcompile_on_one_gpu_gets_no_module_fetching_defaults():
    resolved = resolve("stage3", None, GPT_406M + ["deepspeed.compile.deepcompile=true"], world_size=1,
                       accelerator="cuda", env={})
    zero = resolved.ds_config["zero_optimization"]
    assert resolved.ds_config["compile"] == {"deepcompile": True} and resolved.config.train.compile is True
    # no leaf module (DeepCompile cannot trace its backward hook) and DeepSpeed's own persistence
    assert "leaf_module" not in zero and zero["stage3_param_persistence_threshold"] == 100000
    assert "memory_efficient_linear" not in zero
    assert resolved.sources["train.compile"] == "auto: on (DeepCompile starts with engine.compile())"


@pytest.mark.parametrize("preset, sets, world", [
    ("stage3", [], 2),  # several GPUs: not measured
    ("stage3_offload", [], 1),
    ("stage3", ["train.activation_checkpointing=true"], 1),
    ("stage3", ["train.mixed_precision=autocast"], 1),
    ("stage3", ["train.compile=false"], 1),
    ("stage3", [f"{ZERO}.stage3_module_granularity_threshold=5000"], 1),  # the user's module fetching
    ("stage2", [], 1),
])
def test_deepcompile_is_not_chosen_where_it_was_not_measured(preset, sets, world):
    resolved = resolve(preset, None, GPT_406M + LONG_RUN + sets, world_size=world, accelerator="cuda", env={})
    assert (resolved.ds_config.get("compile") or {}).get("deepcompile") is not True


def test_a_users_deepcompile_on_several_gpus_gets_no_module_fetching_defaults():
    resolved = resolve("stage3", None, GPT_406M + ["deepspeed.compile.deepcompile=true"], world_size=2,
                       accelerator="cuda", env={})
    zero = resolved.ds_config["zero_optimization"]
    assert resolved.config.train.compile is True and "leaf_module" not in zero and "memory_efficient_linear" not in zero
    assert not any("0.52x" in w for w in resolved.warnings)  # the compile warning is for hooks, not DeepCompile


@pytest.mark.parametrize("sets, accelerator, expected", [
    ([f"{ZERO}.leaf_module.classes=[dstrain.models.gpt.Block]"], "cuda",
     f"--set: {ZERO}.leaf_module"),
    ([f"{ZERO}.stage3_module_granularity_threshold=5000"], "cuda", "remove deepspeed.zero_optimization."),
    (["train.compile=false"], "cuda", "set train.compile=true (or auto)"),
    ([], "cpu", "DeepCompile needs CUDA"),
])
def test_deepcompile_settings_that_cannot_run_are_refused_with_the_fix(sets, accelerator, expected):
    from dstrain.errors import UserError
    with pytest.raises(UserError) as caught:
        resolve("stage3", None, SMALL + ["deepspeed.compile.deepcompile=true", *sets], world_size=1,
                accelerator=accelerator, env={})
    message = str(caught.value)
    assert "--set: deepspeed.compile.deepcompile" in message and expected in message


class _CompileRecorder:
    """Records what dstrain's worker hands engine.compile() (DeepCompile itself needs CUDA)."""

    def __init__(self, global_steps, module=None):
        import torch
        self.global_steps, self.schedules = global_steps, []
        self.module = module if module is not None else torch.nn.Linear(2, 2)  # no ZeRO-3 leaf modules

    def compile(self, schedule=None):
        self.schedules.append(schedule)


@pytest.mark.parametrize("world, stage, resumed_at", [(1, 3, 0), (1, 3, 20), (2, 3, 20), (1, 2, 7)])
def test_deepcompiles_schedule_starts_at_the_step_the_run_starts_at(world, stage, resumed_at):
    from deepspeed.compile.passes import prefetch, zero3_compile

    from dstrain.rank.runtime import compile_engine, zero_1_and_2_passes
    engine = _CompileRecorder(resumed_at)
    compile_engine(engine, {"compile": {"deepcompile": True}, "zero_optimization": {"stage": stage}}, world)
    [schedule] = engine.schedules
    assert schedule[0][0] == resumed_at  # DeepSpeed's own starts at 0, which a resumed run never reaches
    if stage == 2:
        assert schedule == [(resumed_at, [zero_1_and_2_passes().add_z2_reduce])]
    elif world == 1:  # one GPU: the gather/release pass alone, no profiled passes
        assert schedule == [(resumed_at, [zero3_compile.add_z3_gather_release])]
    else:
        assert prefetch.schedule_prefetch in schedule[1][1] and schedule[1][0] == resumed_at + 5


@pytest.mark.parametrize("ds_config", [
    {"zero_optimization": {"stage": 3}},  # no DeepCompile: torch.compile as is
    {"compile": {"deepcompile": True, "passes": ["z3"]}, "zero_optimization": {"stage": 3}},  # the user's passes
    {"compile": {"deepcompile": True}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
])
def test_deepspeeds_own_schedule_is_kept_where_dstrain_has_no_reason_to_choose(ds_config):
    from dstrain.rank.runtime import compile_engine
    engine = _CompileRecorder(0)
    compile_engine(engine, ds_config, 1)
    assert engine.schedules == [None]


def test_zero3_compiles_its_leaf_modules_forward_not_the_whole_model():
    """ZeRO-3 without DeepCompile: each leaf module's forward is compiled (DeepSpeed's hooks, in the
    module's call around it, stay eager) and engine.compile() is not called; the output is eager's."""
    import torch
    from deepspeed.utils import set_z3_leaf_modules

    from dstrain.rank.runtime import compile_engine
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    set_z3_leaf_modules(model, [torch.nn.Linear])
    x = torch.randn(3, 8)
    eager = model(x)
    engine = _CompileRecorder(0, model)
    compile_engine(engine, {"zero_optimization": {"stage": 3}}, 1)
    assert engine.schedules == []
    assert ["forward" in vars(m) for m in model] == [True, False, True]
    assert torch.allclose(model(x), eager, atol=1e-6)


def test_the_smallest_gpu_is_read_from_nvidia_smi_and_mig_slices_are_not_guessed():
    from dstrain.hardware import smallest_gpu_memory
    assert smallest_gpu_memory("81559, Disabled\n143771, [N/A]\n") == 81559 * 2**20
    assert smallest_gpu_memory("81559, Enabled\n") is None  # a slice's memory is not the card's
    assert smallest_gpu_memory("[N/A], [N/A]\n") is None and smallest_gpu_memory("") is None
