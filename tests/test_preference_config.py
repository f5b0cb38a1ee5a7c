"""train.objective and the preference section through the real resolution (`resolve`, `dstrain config`,
`dstrain run --dry-run`): each mistake is exit 2 before any rank, with the key, what is accepted (from
dstrain/config/preference.py, the one table) and a fix, all problems at once. In-process, no rank started."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dstrain.cli import app
from dstrain.config.layers import ENV_DEEPSPEED_CONFIG
from dstrain.config.preference import CPO_LOSS_TYPES, DPO_LOSS_TYPES, KTO_LOSS_TYPES, dpo_loss_terms
from dstrain.config.resolve import resolve
from dstrain.errors import UserError

PREFERENCE = ["train.objective=dpo", "data.format=preference", "data.source=jsonl"]


def resolved(*sets: str):
    return resolve(sets=list(sets), world_size=1, accelerator="cpu", env={})


def problems(*sets: str) -> dict[str, str]:
    """{where: message + fix} of every problem resolution reports."""
    with pytest.raises(UserError) as caught:
        resolved(*sets)
    return {p.where: f"{p.message} | fix: {p.fix}" for p in caught.value.problems}


def config_fails(*sets: str) -> str:
    args = ["config", "--accelerator", "cpu"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args, env={ENV_DEEPSPEED_CONFIG: None, "COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.startswith("error: ")
    return " ".join(result.stderr.split())


def test_defaults_train_lm_and_auto_reference_follows_the_objective_and_lora():
    assert resolved().config.train.objective == "lm"
    dpo = resolved(*PREFERENCE)
    assert dpo.config.preference.reference == "model" and dpo.sources["preference.reference"].startswith("auto: model")
    lora = resolved(*PREFERENCE, "model.name=hf:gpt2", "model.lora={r: 8}")
    assert lora.config.preference.reference == "adapters_off"
    assert resolved("train.objective=simpo", "data.format=preference").config.preference.reference == "none"


def test_unknown_loss_types_name_the_key_and_what_each_objective_accepts():
    found = problems(*PREFERENCE, "preference.loss=[sigmoid, sigmod]")
    message = found["--set: preference.loss"]
    assert "unknown loss type 'sigmod'" in message and ", ".join(DPO_LOSS_TYPES) in message
    simpo = problems("train.objective=simpo", "data.format=preference", "preference.loss=apo_zero")
    assert ", ".join(CPO_LOSS_TYPES) in simpo["--set: preference.loss"]
    kto = problems("train.objective=kto", "data.format=preference", "preference.loss=sigmoid")
    assert ", ".join(KTO_LOSS_TYPES) in kto["--set: preference.loss"]
    two = problems("train.objective=simpo", "data.format=preference", "preference.loss=[simpo, hinge]")
    assert "takes one loss type" in two["--set: preference.loss"]


def test_bad_beta_weights_smoothing_and_reference_are_reported_together():
    found = problems(*PREFERENCE, "preference.loss=[sigmoid, robust]", "preference.loss_weights=[1.0]",
                     "preference.beta=0", "preference.label_smoothing=0.5", "preference.reference=adapters_off")
    assert set(found) == {"--set: preference.loss_weights", "--set: preference.beta",
                          "--set: preference.label_smoothing", "--set: preference.reference"}
    assert "1 loss weights for 2 loss types (sigmoid, robust)" in found["--set: preference.loss_weights"]
    assert "beta must be a finite number > 0, got 0.0" in found["--set: preference.beta"]
    assert "'robust' loss divides by 1 - 2 * label_smoothing" in found["--set: preference.label_smoothing"]
    assert "model.lora is not set" in found["--set: preference.reference"]
    none = problems(*PREFERENCE, "preference.reference=none")
    assert "use train.objective simpo or orpo" in none["--set: preference.reference"]


def test_a_preference_objective_needs_preference_data_and_preference_data_a_preference_objective():
    found = problems("train.objective=orpo", "data.format=chat")
    assert "train.objective orpo trains on preference data, but data.format is 'chat'" in found["--set: data.format"]
    assert "set data.format: preference" in found["--set: data.format"]
    lm = problems("data.format=preference")
    assert "train.objective lm (next-token training) does not read" in lm["--set: data.format"]


def test_kto_needs_two_examples_a_micro_batch_and_reward_an_hf_model():
    found = problems("train.objective=kto", "data.format=preference", "train.micro_batch_size=1")
    assert "TRL requires a batch > 1" in found["--set: train.micro_batch_size"]
    resolved("train.objective=kto", "data.format=preference", "train.micro_batch_size=1",
             "preference.loss=apo_zero_unpaired")  # no KL term: one example is enough
    reward = problems("train.objective=reward", "data.format=preference")
    assert "not an \"hf:\" model" in reward["model.name"]


def test_keys_the_objective_does_not_read_are_warnings():
    warnings = resolved("train.objective=orpo", "data.format=preference", "preference.simpo_gamma=1.0").warnings
    assert any("preference.simpo_gamma: train.objective orpo does not read it (it is read by simpo)" in w
               for w in warnings)


def test_sft_weight_is_trls_extra_sft_term():
    assert dpo_loss_terms("sigmoid", None, 0.5) == (("sigmoid", "sft"), (1.0, 0.5))
    assert dpo_loss_terms(["sigmoid", "sft"], [1.0, 0.2], 0.3) == (("sigmoid", "sft"), (1.0, 0.5))
    assert dpo_loss_terms("ipo", None, 0.0) == (("ipo",), (1.0,))


def test_dstrain_config_exits_2_naming_the_keys():
    message = config_fails(*PREFERENCE, "preference.loss=dpo", "preference.beta=-1")
    assert "error: 2 problems" in message
    assert "--set: preference.loss: unknown loss type 'dpo': accepted are sigmoid, hinge" in message
    assert "--set: preference.beta: beta must be a finite number > 0, got -1.0" in message
    objective = config_fails("train.objective=ppo")
    assert "train.objective: Input should be 'lm', 'dpo', 'simpo', 'orpo', 'kto' or 'reward'" in objective


def test_run_dry_run_stops_before_any_rank_and_accepts_good_preference_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(ENV_DEEPSPEED_CONFIG, raising=False)
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}? ", "chosen": "yes", "rejected": "no"}) + "\n"
                            for i in range(20)))
    base = ["run", "--dry-run", "--accelerator", "cpu", "--gpus", "1", "--set", "train.objective=dpo",
            "--set", "data.format=preference", "--set", "data.source=jsonl", "--set", f"data.paths=[{rows}]",
            "--set", "data.tokenizer=byte", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.seq_len=64"]
    bad = CliRunner().invoke(app, [*base, "--set", "preference.loss=sigmoidd"], env={"COLUMNS": "300"})
    output = " ".join(bad.output.split())
    assert bad.exit_code == 2 and "preference.loss: unknown loss type 'sigmoidd'" in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.jsonl"]  # no run directory
    good = CliRunner().invoke(app, base, env={"COLUMNS": "300"})
    assert good.exit_code == 0, good.output
    # KTO's precomputed reference is not implemented: a dry run warns, a real run refuses before any rank
    precomputed = [*base, "--set", "train.objective=kto", "--set", "preference.reference=precomputed"]
    warned = CliRunner().invoke(app, precomputed, env={"COLUMNS": "300"})
    assert warned.exit_code == 0 and "precomputed" in warned.output and "dpo only" in warned.output
    refused = CliRunner().invoke(app, [arg for arg in precomputed if arg != "--dry-run"], env={"COLUMNS": "300"})
    output = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "preference.reference precomputed" in output and "dpo only" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "pairs.jsonl"]  # no run directory


def test_run_starts_reward_models_and_dpos_precomputed_reference_and_refuses_ktos(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(ENV_DEEPSPEED_CONFIG, raising=False)
    from dstrain.launcher.job import _refuse_untrained
    _refuse_untrained(resolved("train.objective=reward", "data.format=preference", "model.name=hf:x"), dry_run=False)
    _refuse_untrained(resolved(*PREFERENCE), dry_run=False)  # dpo trains
    _refuse_untrained(resolved(*PREFERENCE, "preference.reference=precomputed"), dry_run=False)
    with pytest.raises(UserError) as caught:
        _refuse_untrained(resolved(*PREFERENCE, "train.objective=kto", "preference.reference=precomputed"),
                          dry_run=False)
    assert "precomputed" in str(caught.value) and "dpo only" in str(caught.value)


def test_a_preference_objective_needs_the_built_in_gpt_or_an_hf_model():
    found = problems(*PREFERENCE, "model.name=mypkg.models:build")
    assert "trains the built-in gpt or an \"hf:\" model" in found["--set: model.name"]
