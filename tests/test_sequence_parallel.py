"""Sequence parallelism (train.sequence_parallel, DeepSpeed's Ulysses attention for hf: models).

Fast: the config checks (each refusal names its key, exit 2 before any rank starts), the batch arithmetic
over world / N, each rank's share of a batch, the gradient factor per ZeRO path, and the memory estimate.

Launcher lane (CPU ranks, gloo: DeepSpeed's all-to-all runs on torch's gloo all_to_all_single): runs whose
sequences are split over 2 ranks against the same batches without the split (2 ranks in one group against
1 rank; 4 ranks in 2 data-parallel groups against 2 ranks), trained with SGD at lr 1 and no clipping, so
the weights after each step are the initial weights minus the summed gradients.
Tolerances, float32 rounding: losses, gradient norms and eval losses rel 1e-5; weights abs 1e-5.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_models import save_tiny_llama, save_tiny_qwen2
from launcher import assert_ok, dstrain, losses

from dstrain.config.resolve import resolve
from dstrain.data.sequence import Layout, shard, shifted
from dstrain.errors import UserError

transformers = pytest.importorskip("transformers")


def problems(world: int, *sets: str) -> dict[str, str]:
    """key path (without the layer that set it) -> message of every problem resolution reports."""
    with pytest.raises(UserError) as caught:
        resolve("stage2", None, list(sets), world_size=world, accelerator="cpu")
    return {p.where.split(": ")[-1]: p.message for p in caught.value.problems}


# ------------------------------------------------------------------ config


def test_every_impossible_combination_is_refused_at_once_naming_its_key():
    found = problems(4, "model.name=hf:some/model", "train.sequence_parallel=3", "data.seq_len=64",
                     "data.packing=true", "model.kwargs={attn_implementation: eager}")
    assert "does not divide the world size 4" in found["train.sequence_parallel"]
    assert "not divisible by sequence_parallel 3" in found["data.seq_len"]
    assert "packed examples" in found["data.packing"]
    assert "eager" in found["model.kwargs.attn_implementation"]


def test_deepspeeds_own_key_is_refused_naming_dstrains():
    found = problems(2, "model.name=hf:some/model", "deepspeed.sequence_parallel_size=2")
    assert "differs from train.sequence_parallel 1" in found["deepspeed.sequence_parallel_size"]


def test_the_built_in_gpt_is_refused():
    found = problems(2, "train.sequence_parallel=2")
    assert "'gpt' is not one" in found["train.sequence_parallel"]


def test_the_global_batch_counts_data_parallel_ranks_and_deepspeed_is_told_the_degree():
    resolved = resolve("stage2", None, ["model.name=hf:some/model", "train.sequence_parallel=2",
                                        "train.micro_batch_size=3", "data.seq_len=64"], world_size=4,
                       accelerator="cpu")
    assert resolved.config.train.global_batch_size == 6  # micro 3 x accum 1 x (4 ranks / 2)
    assert resolved.ds_config["train_batch_size"] == 6
    assert resolved.ds_config["sequence_parallel_size"] == 2


@pytest.mark.slow
def test_config_command_exits_2_before_anything_starts():
    result = dstrain("config", "--preset", "stage2", "--gpus", "2", "--accelerator", "cpu",
                     "--set", "train.sequence_parallel=4")
    assert result.returncode == 2
    assert "train.sequence_parallel" in result.stderr + result.stdout


def test_heads_that_do_not_split_are_refused_with_the_model(tmp_path):
    from dstrain.models import check_model
    from dstrain.models.hf import load_config, sequence_parallel_problem

    model_dir = save_tiny_llama(tmp_path / "llama")  # 4 attention heads, 2 key-value heads
    resolved = resolve("stage2", None, [f"model.name=hf:{model_dir}", "train.sequence_parallel=8",
                                        "data.seq_len=32", "data.tokenizer=byte"], world_size=8, accelerator="cpu")
    with pytest.raises(UserError) as caught:
        check_model(resolved.config)
    assert caught.value.problems[0].where == "train.sequence_parallel"
    assert "4 attention heads are not divisible by 8" in caught.value.problems[0].message
    hf_config = load_config(resolved.config)
    assert sequence_parallel_problem(hf_config, 2) is None
    assert sequence_parallel_problem(hf_config, 4) is None  # 2 key-value heads, each copied to 2 ranks


def test_packing_auto_falls_back_to_padding():
    from dstrain.config.schema import RunConfig
    from dstrain.models.packing import decide_packing

    config = RunConfig.model_validate({"model": {"name": "hf:some/model"}, "train": {"sequence_parallel": 2},
                                       "data": {"source": "jsonl", "format": "prompt_response"}})
    packed, note = decide_packing(config)
    assert packed is False and "sequence_parallel" in note


# ------------------------------------------------------------------ batches


def test_a_sequence_parallel_group_takes_the_same_samples():
    layouts = [Layout.of(rank, 4, 2) for rank in range(4)]
    assert [(lay.data_rank, lay.data_world, lay.sequence_rank) for lay in layouts] == [
        (0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert Layout.of(3, 4, 1) == Layout(3, 4)


def test_labels_are_shifted_before_the_split_and_the_shares_join_to_the_whole():
    ids = torch.arange(16).view(2, 8)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    whole = shifted({"input_ids": ids, "labels": labels})
    shares = [shard(whole, rank, 2) for rank in range(2)]
    for key in whole:
        assert torch.equal(torch.cat([s[key] for s in shares], dim=1), whole[key])
    assert shares[0]["shift_labels"][1, -1] == ids[1, 4]  # the first share's last token predicts the second's first
    assert shares[1]["shift_labels"][:, -1].tolist() == [-100, -100]
    assert shares[1]["position_ids"][0].tolist() == [4, 5, 6, 7]
    assert whole["shift_labels"][0, :2].tolist() == [-100, -100]


def test_windows_keep_their_shifted_targets():
    inputs, targets = torch.arange(8).view(1, 8), torch.arange(1, 9).view(1, 8)
    share = Layout(0, 1, 1, 2).share((inputs, targets))
    assert share["input_ids"].tolist() == [[4, 5, 6, 7]] and share["shift_labels"].tolist() == [[5, 6, 7, 8]]


def test_the_gradient_factor_follows_deepspeeds_reduction():
    from dstrain.rank.sequence_parallel import gradient_scale
    assert gradient_scale({"zero_optimization": {"stage": 3}}, 4) == 4.0
    assert gradient_scale({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 4) == 1.0
    assert gradient_scale({"zero_optimization": {"stage": 2}}, 4) == 1.0
    assert gradient_scale({}, 4) == 1.0


# ------------------------------------------------------------------ estimate


def test_each_gpu_holds_its_share_of_the_activations():
    from dstrain.tools.estimate import memory as E
    work = E.Workload(params=10**9, largest_layer_params=10**8, n_layer=16, d_model=2048, n_head=16,
                      seq_len=32768, micro_batch=1, activation_checkpointing=False, cpu_checkpointing=False,
                      precision="bf16", vocab_size=32000)
    act = {n: E.estimate_one("stage3", E.Placement(stage=3), E.replace(work, sequence_parallel=n),
                             E.Hardware(gpus_per_node=4, nodes=1, gpu_mem_bytes=80 * 2**30, cpu_mem_bytes=512 * 2**30)).activation_bytes_per_gpu for n in (1, 4)}
    assert act[4] * 4 == act[1]


def test_estimate_splits_sequences_over_the_fewest_ranks_that_let_a_faster_preset_fit(tmp_path):
    from dstrain.tools.estimate.planner import make_plan

    model_dir = save_tiny_llama(tmp_path / "llama")  # 4 heads, 2 key-value heads: 2 or 4 ranks split it

    def plan(seq_len: int, gpus: int):
        # tiled MLP and the chunked loss off: their smaller activations and logits would let these lengths fit
        # with fewer ranks (tests/test_tiled_mlp.py)
        sets = [f"model.name=hf:{model_dir}", f"data.seq_len={seq_len}", "train.micro_batch_size=1",
                "train.tiled_mlp=false", "train.loss_chunking=false"]
        return make_plan(None, sets, None, gpus, 1, 80, 512, "cuda")

    long = plan(2**24, 4)  # 16M tokens: stage1's activations and logits need ~100 GiB on one GPU, half on two
    assert (long.recommended, long.sequence_parallel) == ("stage1", 2)
    assert long.workload.sequence_parallel == 2 and "with train.sequence_parallel=2" in long.reason
    longer = plan(2**25, 4)  # twice as long: over all four
    assert (longer.recommended, longer.sequence_parallel) == ("stage1", 4)
    alone = plan(2**24, 1)  # one GPU: nothing to split over, a slower preset
    assert alone.sequence_parallel == 1 and alone.recommended != "stage1"
    short = plan(4096, 4)
    assert (short.recommended, short.sequence_parallel) == ("stage1", 1)


# ------------------------------------------------------------------ launcher lane

SGD = ("deepspeed.optimizer.type=SGD", "deepspeed.zero_allow_untested_optimizer=true", "train.lr=1",
       "train.grad_clip=0", "train.warmup_steps=0", "train.schedule=constant")


def instruction_rows() -> list[dict]:
    """Prompts and responses of many lengths: padded rows whose loss-taking tokens fall unevenly on the
    two shares, so a mean of per-share means would differ from the mean over the tokens."""
    words = ["alpha", "beta", "gamma", "delta", "one", "two", "three"]
    return [{"prompt": f"Q{i}: " + " ".join(words[(i * j) % 7] for j in range(2 + i % 9)) + "?",
             "response": " ".join(words[(i + j) % 7] for j in range(1 + i % 6))} for i in range(40)]


def run(run_dir, gpus: int, preset: str, sets: tuple[str, ...], *extra: str):
    args = ["run", "--preset", preset, "--accelerator", "cpu", "--gpus", str(gpus), "--run-dir", str(run_dir)]
    for item in sets:
        args += ["--set", item]
    return dstrain(*args, *extra)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(run_dir / "final.safetensors")


def assert_same_training(split, whole) -> None:
    """Loss, gradient norm and eval loss of every step, and the weights at the end (SGD: the gradients)."""
    for key in ("loss", "grad_norm", "eval_loss"):
        a, b = by_step(records(split), key), by_step(records(whole), key)
        assert a and sorted(a) == sorted(b), key
        for step in a:
            assert a[step] == pytest.approx(b[step], rel=1e-5), (key, step)
    mine, theirs = final_weights(split), final_weights(whole)
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.integration
def test_llama_stage2_two_groups_of_two_ranks_train_as_two_data_parallel_ranks_do(tmp_path):
    """4 ranks: 2 data-parallel groups, each sequence split over 2 ranks, against 2 ranks without the split
    (the same samples per data-parallel rank, the same averaging over them)."""
    model_dir = save_tiny_llama(tmp_path / "llama")
    sets = (f"model.name=hf:{model_dir}", "data.tokenizer=byte", "data.seq_len=32", "train.micro_batch_size=2",
            "train.max_steps=2", "train.log_every=1", "train.eval_batches=1", "train.eval_every=2",
            "train.save_every=2", "train.export_final=true", *SGD)
    result = run(tmp_path / "split", 4, "stage2", (*sets, "train.sequence_parallel=2"))
    assert_ok(result)
    assert "2 data-parallel groups (world 4 / sequence_parallel 2) = 4 sequences" in result.stdout
    assert "each sequence split over 2 ranks (16 tokens each), attention sdpa" in result.stdout
    assert_ok(run(tmp_path / "whole", 2, "stage2", sets))
    assert_same_training(tmp_path / "split", tmp_path / "whole")


@pytest.mark.integration
def test_qwen2_stage3_split_padded_rows_train_resume_evaluate_and_export_as_without_it(tmp_path):
    """ZeRO-3 (whose reduce-scatter averages over every rank), Qwen2 (biases, a tied head), padded
    prompt/response rows (loss-taking tokens uneven over the shares), and the split run's LM loss in chunks
    (train.loss_chunking: each rank's share summed chunk by chunk) and its MLPs tiled (train.tiled_mlp, 3
    shards, the decoder layers ZeRO-3 leaf modules) against the whole logits and MLPs without the split. Then: a resume from step 1 repeats step 2 exactly; `dstrain eval` gives the run's own eval loss;
    the Hugging Face export loads."""
    model_dir = save_tiny_qwen2(tmp_path / "qwen2")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in instruction_rows()))
    sets = (f"model.name=hf:{model_dir}", "data.source=jsonl", f"data.paths=[{data}]", "data.format=prompt_response",
            "data.tokenizer=byte", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=96", "data.eval_fraction=0.1",
            "data.packing=false", "train.micro_batch_size=2", "train.max_steps=2", "train.log_every=1",
            "train.eval_every=2", "train.save_every=1", "train.keep_last=3", "train.export_final=true", *SGD)
    split, whole = tmp_path / "split", tmp_path / "whole"
    split_sets = (*sets, "train.sequence_parallel=2", "train.loss_chunking=true", "train.loss_chunk_tokens=40",
                  "train.tiled_mlp=true", "train.tiled_mlp_shards=3")
    result = run(split, 2, "stage3", split_sets)
    assert_ok(result)
    assert "LM loss in chunks of 40 tokens" in result.stdout
    assert "tiled MLP: 2 Qwen2MLP layers each run over 48 tokens per sample in 3 shards" in result.stdout
    assert_ok(run(whole, 1, "stage3", sets))
    assert_same_training(split, whole)
    uninterrupted = records(split)

    assert_ok(run(split, 2, "stage3", split_sets, "--resume", "step00000001"))
    again = records(split)[len(uninterrupted):]
    assert by_step(again, "loss") == pytest.approx({2: by_step(uninterrupted, "loss")[2]}, rel=1e-6)
    assert by_step(again, "grad_norm") == pytest.approx({2: by_step(uninterrupted, "grad_norm")[2]}, rel=1e-6)

    assert_ok(dstrain("eval", "--run-dir", str(split), "--accelerator", "cpu"))
    evaluated = json.loads((split / "eval.json").read_text())
    assert evaluated["step"] == 2
    assert evaluated["eval_loss"] == pytest.approx(by_step(uninterrupted, "eval_loss")[2], rel=1e-5)

    out = tmp_path / "exported"
    assert_ok(dstrain("convert-checkpoint", str(split / "checkpoints"), str(out), "--format", "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    trained = final_weights(whole)  # the run without sequence parallelism: the same weights
    for name, value in model.state_dict().items():
        if f"model.{name}" in trained:
            torch.testing.assert_close(value, trained[f"model.{name}"], rtol=0, atol=1e-5, msg=name)
