"""Preference objectives in the real training path (issue 52): the loss the model's forward computes
(dstrain.models.preference) against preference_loss's functions on log-probs computed by hand from the
whole logits; the micro batch weighting and metric averaging of the rank (dstrain.rank.preference); one DPO
step with a real deepspeed.initialize per reference mode (both modes in one one-rank process); and one
launcher run (LoRA DPO at ZeRO-2 on two ranks, resumed on one, converted and generated from)."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch

from dstrain.config.resolve import resolve
from dstrain.data import build_samplers
from dstrain.models import build_model
from dstrain.models import preference_loss as pl
from preference_data import write_zen_pairs


def gpt_and_sampler(tmp_path, objective: str, *sets: str):
    """The built-in GPT (tiny) with train.objective's loss attached, a frozen copy as its reference, and the
    train sampler of the Zen pairs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    resolved = resolve(sets=[f"train.objective={objective}", "data.format=preference", "data.source=jsonl",
                             f"data.paths=[{write_zen_pairs(tmp_path / 'pairs.jsonl')}]", "data.tokenizer=byte",
                             f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=128", "model.n_layer=1",
                             "model.n_head=2", "model.d_model=32", "model.vocab_size=256", "train.micro_batch_size=4",
                             *sets], world_size=1, accelerator="cpu", env={})
    train, _ = build_samplers(resolved.config)
    torch.manual_seed(0)
    model = build_model(resolved.config, {}, torch.device("cpu"))
    if objective in ("dpo", "kto"):
        model.preference.reference = copy.deepcopy(model).requires_grad_(False)
    return model, train


def whole_logits_sums(model, batch, prefix="", every_token=False):
    """(summed log-probs, counts) per completion from the GPT's whole fp32 logits: the reference computation."""
    targets, segments = model.preference.targets_of(batch, prefix, every_token)
    with torch.no_grad():
        logits = model.head(model.hidden_states(batch[prefix + "input_ids"], batch[prefix + "position_ids"])).float()
    logps = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return pl.segment_logps(torch.where(targets != -100, logps, 0.0), segments, len(batch["desirable"]))


def nudge(model):
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_dpo_forward_is_ln2_at_the_start_and_then_the_dpo_loss_of_the_whole_logits(tmp_path, packing):
    model, train = gpt_and_sampler(tmp_path, "dpo", f"data.packing={packing}", "preference.beta=0.3",
                                   "preference.loss=[sigmoid, ipo]", "preference.loss_weights=[1.0, 0.5]")
    batch = train.batch(0, 4)
    assert model(batch).item() == pytest.approx(math.log(2) + 0.5 * (1 / 0.6) ** 2, rel=1e-6)  # ipo: (0 - 1/2b)^2
    nudge(model)
    loss = model(batch)
    loss.backward()  # the chunked head's backward runs
    (sums, counts), (ref, _) = whole_logits_sums(model, batch), whole_logits_sums(model.preference.reference, batch)
    P = len(batch["margin"])
    expected = pl.dpo_loss(sums[:P], sums[P:], ref[:P], ref[P:], loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5],
                           beta=0.3, chosen_counts=counts[:P], rejected_counts=counts[P:])
    assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
    metrics = model.preference.last_metrics
    assert metrics["rewards/margins"][0].item() == pytest.approx(expected.metrics["rewards/margins"].item(), abs=1e-5)
    assert metrics["rewards/margins"][1] == P


def test_simpo_orpo_and_kto_forwards_match_their_losses_on_the_whole_logits(tmp_path):
    model, train = gpt_and_sampler(tmp_path / "simpo", "simpo", "preference.beta=2.0", "preference.simpo_gamma=0.4")
    batch = train.batch(0, 4)
    P = len(batch["margin"])
    sums, counts = whole_logits_sums(model, batch)
    expected = pl.cpo_loss(sums[:P], sums[P:], counts[:P], counts[P:], loss_type="simpo", beta=2.0, simpo_gamma=0.4,
                           cpo_alpha=0.0)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)

    model, train = gpt_and_sampler(tmp_path / "orpo", "orpo", "preference.beta=0.2")
    batch = train.batch(0, 4)
    sums, counts = whole_logits_sums(model, batch)
    every, every_counts = whole_logits_sums(model, batch, every_token=True)
    nll = -every[:P].sum() / every_counts[:P].sum()
    expected = pl.orpo_loss(sums[:P], sums[P:], counts[:P], counts[P:], nll, beta=0.2)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)

    model, train = gpt_and_sampler(tmp_path / "kto", "kto", "preference.beta=0.5")
    nudge(model)
    batch = train.batch(0, 4)
    sums, _ = whole_logits_sums(model, batch)
    ref, _ = whole_logits_sums(model.preference.reference, batch)
    kl = pl.kto_kl_estimate(whole_logits_sums(model, batch, "kl_")[0],
                            whole_logits_sums(model.preference.reference, batch, "kl_")[0])
    expected = pl.kto_loss(sums, ref, batch["desirable"], kl, beta=0.5)
    assert model(batch).item() == pytest.approx(expected.loss.item(), rel=1e-5)
    assert model.preference.last_metrics["kl"][0].item() == pytest.approx(expected.metrics["kl"].item(), abs=1e-6)


def test_packed_micro_batches_are_weighted_by_their_pairs_so_the_step_is_the_mean_over_its_pairs(monkeypatch):
    from dstrain.rank.preference import PreferenceMetrics, micro_batch_weight
    per_pair = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])]  # two micro batches of 3 and 1 pairs
    batches = [{"margin": torch.zeros(len(p))} for p in per_pair]
    # DeepSpeed averages the micro batches' (weighted) losses: the step's loss is the mean over its 4 pairs
    weighted = [p.mean() * micro_batch_weight(b, 4, 2) for p, b in zip(per_pair, batches)]
    assert (sum(weighted) / 2).item() == pytest.approx(torch.cat(per_pair).mean().item())
    monkeypatch.setattr("dstrain.rank.preference.dist.all_reduce", lambda tensor: None)  # one rank: the sums as they are
    stats = PreferenceMetrics("kto", torch.device("cpu"))
    stats.add({"kl": (torch.tensor(0.2), 1.0), "rewards/chosen": (torch.tensor(1.0), 3.0),
               "logps/chosen": (torch.tensor(-5.0), 3.0), "rewards/rejected": (torch.tensor(0.0), 0.0),
               "logps/rejected": (torch.tensor(0.0), 0.0)})
    stats.add({"kl": (torch.tensor(0.4), 1.0), "rewards/chosen": (torch.tensor(2.0), 1.0),
               "logps/chosen": (torch.tensor(-1.0), 1.0), "rewards/rejected": (torch.tensor(-1.0), 2.0),
               "logps/rejected": (torch.tensor(-9.0), 2.0)})
    out = stats.reduce()
    assert out["rewards/chosen"] == pytest.approx(1.25) and out["rewards/rejected"] == pytest.approx(-1.0)
    assert out["rewards/margins"] == pytest.approx(2.25) and out["kl"] == pytest.approx(0.3)


# --- a real engine on one rank ------------------------------------------------------------------------------

# The two reference modes: adapters_off (LoRA at ZeRO-2) and model (a frozen copy at ZeRO-3).
DPO_STEP_CASES = [("adapters_off", "stage2", ["model.lora={r: 4, alpha: 8}"]), ("model", "stage3", [])]


@pytest.fixture(scope="module")
def dpo_steps(tmp_path_factory) -> dict:
    """One DPO step of a real engine for each of DPO_STEP_CASES, by reference mode: one rank, one start-up
    for both (tests/scripts/preference_step.py; each case its own engine, model and folder)."""
    from one_rank import run_script
    cases = [{"dir": str(tmp_path_factory.mktemp(f"dpo_{reference}")), "reference": reference, "preset": preset,
              "sets": sets} for reference, preset, sets in DPO_STEP_CASES]
    return run_script("preference_step", {"cases": cases}, timeout=600)


@pytest.mark.integration
@pytest.mark.parametrize("reference, preset, sets", DPO_STEP_CASES)
def test_one_dpo_step_of_a_real_engine_equals_the_dpo_loss_computed_by_hand(dpo_steps, reference, preset, sets):
    """Reads `dpo_steps`: this reference mode's step, run beside the other mode's in one process."""
    out = dpo_steps[reference]
    assert out["first"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the first step
    assert out["moved"] > 1e-3  # the step changed the policy's log-probs
    assert out["engine"] == pytest.approx(out["by_hand"], rel=1e-4, abs=1e-6)


# --- the launcher -------------------------------------------------------------------------------------------

def dpo_loss_of(policy, reference, batch: dict, beta: float) -> float:
    """The sigmoid DPO loss over all pairs of a (packed) batch, from the whole fp32 logits of two transformers
    models: what the run logs for that batch when `policy` holds its weights and `reference` the start."""
    segments = pl.shift_segment_ids(batch["example_ids"], batch["labels"])
    targets = torch.where(segments >= 0, pl.shift_labels(batch["labels"]), -100)

    def sums(model):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logps = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return pl.segment_logps(torch.where(targets != -100, logps, 0.0), segments, len(batch["desirable"]))[0]

    mine, theirs, pairs = sums(policy), sums(reference), len(batch["margin"])
    return pl.dpo_loss(mine[:pairs], mine[pairs:], theirs[:pairs], theirs[pairs:], beta=beta).loss.item()


@pytest.mark.integration
def test_lora_dpo_trains_on_two_ranks_resumes_on_one_converts_and_generates(tmp_path, monkeypatch):
    """`dstrain run` on 2 CPU ranks: DPO, LoRA, ZeRO-2, packed Zen pairs, the reference precomputed (the two
    ranks share the pass, rank 0 writes the cache). Step 1's loss is ln 2 (policy == reference), metrics.jsonl
    has TRL's rewards/* and logps/* (and eval_ ones), a checkpoint is saved at 3. Then --resume on ONE rank
    (grad accum 2: the same global batch), through a universal checkpoint, reading the cache the two ranks
    wrote. In-process afterwards (no ranks): step 4's logged loss is the DPO loss of step 4's pairs computed by
    hand from `convert-checkpoint --format peft` of the two-rank checkpoint against the base model, so the
    one-rank run continued from the trained weights, at the data position, against the starting model's
    log-probs; and `dstrain generate` on the run converts the one-rank checkpoint, whose model gives the
    run's step-4 eval loss by hand and writes other text than the base model."""
    from typer.testing import CliRunner

    from dstrain.cli import app
    from dstrain.config.resolve import resolve as resolve_config
    from dstrain.tools import generate
    from hf_models import save_tiny_llama
    from launcher import assert_ok, dstrain, losses, run_hf
    from tiny_tokenizer import build_tokenizer
    run_dir = tmp_path / "run"
    pairs = write_zen_pairs(tmp_path / "pairs.jsonl", repeat=2)
    llama = build_tokenizer(save_tiny_llama(tmp_path / "llama", vocab_size=320))  # a tokenizer for generate
    result = run_hf(run_dir, "stage2", llama, "train.objective=dpo", "data.format=preference", "data.source=jsonl",
                    f"data.paths=[{pairs}]", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=96",
                    "model.lora={r: 4, alpha: 8}", "train.lr=0.02", "train.warmup_steps=0", "train.max_steps=3",
                    "train.eval_every=3", "train.save_every=3", "preference.beta=0.5",
                    "preference.reference=precomputed")
    assert_ok(result)
    cache = next((tmp_path / "cache" / "reference").glob("*.npy"))
    assert f"computed with the starting weights into {cache}" in result.stdout
    assert "batch: micro 2 x grad accum 1 x world 2 = 4 sequences" in result.stdout
    trained = losses(run_dir)
    assert sorted(trained) == [1, 2, 3] and all(math.isfinite(v) for v in trained.values())
    assert trained[1] == pytest.approx(math.log(2), abs=1e-5)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert all(key in row for row in steps), key
    assert steps[0]["rewards/margins"] == 0.0 and steps[-1]["rewards/margins"] != 0.0  # the policy moved
    evals = [row for row in rows if "eval_loss" in row]
    assert evals and math.isfinite(evals[-1]["eval_loss"]) and "eval_rewards/accuracies" in evals[-1]
    assert "acc " in result.stdout and "margin " in result.stdout  # the console line
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000003"

    resumed = dstrain("run", "--accelerator", "cpu", "--gpus", "1", "--run-dir", str(run_dir), "--resume", "latest",
                      "--set", "train.max_steps=4", "--set", "train.grad_accum_steps=2")
    assert_ok(resumed)
    out = " ".join(resumed.stdout.split())
    assert "universal checkpoint" in out and (run_dir / "universal" / "step00000003").is_dir()
    assert "batch: micro 2 x grad accum 2 x world 1 = 4 sequences" in out
    assert f"read from {cache}" in out and len(list(cache.parent.glob("*.npy"))) == 1
    assert "resumed from step00000003 at step 3" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = {row["step"]: row for row in rows if "loss" in row}
    assert sorted(after) == [1, 2, 3, 4] and "rewards/margins" in after[4]
    assert {row["step"]: row["loss"] for row in after.values() if row["step"] < 4} == trained
    eval_loss = {row["step"]: row["eval_loss"] for row in rows if "eval_loss" in row}

    # In-process from here: the models as dstrain's convert-checkpoint and generate give them to transformers.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # generate sets it for DeepSpeed's import; the test's env is kept
    config = resolve_config(None, run_dir / "config.yaml", [], world_size=1, accelerator="cpu", env={}).config
    train, held_out = build_samplers(config)
    G = config.train.global_batch_size
    base, _ = generate.load(generate.find_model(llama), "cpu")
    converted = CliRunner().invoke(app, ["convert-checkpoint", str(run_dir / "checkpoints"), str(tmp_path / "at3"),
                                         "--format", "peft", "--tag", "step00000003"])
    assert converted.exit_code == 0, converted.output
    at3, _ = generate.load(generate.find_model(tmp_path / "at3"), "cpu")
    # step 4 trains samples 3G..4G-1 whatever the ranks (dstrain.data.sampler.rank_batch) and logs the mean over
    # their pairs (dstrain.rank.preference): one batch of all of them gives it
    assert dpo_loss_of(at3, base, train.batch(3 * G, G), beta=0.5) == pytest.approx(after[4]["loss"], rel=1e-5)

    found = generate.find_model(run_dir)  # what `dstrain generate RUN_DIR` loads: step 4, converted
    try:
        assert "checkpoint step00000004" in found.note
        at4, tokenizer = generate.load(found, "cpu")
        whole_split = held_out.batch(0, held_out.size)
        assert dpo_loss_of(at4, base, whole_split, beta=0.5) == pytest.approx(eval_loss[4], rel=1e-5)
    finally:
        shutil.rmtree(found.temporary, ignore_errors=True)
    written = CliRunner().invoke(app, ["generate", str(run_dir), "--prompt", "Beautiful is", "--max-new-tokens", "8"])
    assert written.exit_code == 0, written.output
    assert "checkpoint step00000004 of" in written.stderr and written.stdout.strip()
    prompt = tokenizer("Beautiful is", return_tensors="pt")["input_ids"]
    assert written.stdout == generate.complete(at4, tokenizer, prompt, 8, 0.0, 1.0) + "\n"
    assert written.stdout != generate.complete(base, tokenizer, prompt, 8, 0.0, 1.0) + "\n"  # trained, not the base
