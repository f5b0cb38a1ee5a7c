"""dstrain.models.preference_loss against TRL: every loss type and metric recomputed on the inputs that
tests/scripts/record_trl_preference_losses.py fed TRL 1.16's own trainer methods, equal to 1e-5 in fp32,
and so are the loss's gradients where recorded (tests/data/trl_preference_losses.json; no TRL needed here). Also: packed rows score as unpacked ones, the
chunked log-probs' gradients match autograd's, and bad arguments raise ValueError naming what is accepted.
All in-process, on CPU, in well under a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dstrain.config.preference import DPO_LOSS_TYPES, check_beta, check_loss_types
from dstrain.models import preference_loss as pl

RECORD = json.loads((Path(__file__).parent / "data" / "trl_preference_losses.json").read_text(encoding="utf-8"))
TOL = dict(rtol=1e-5, atol=1e-5)


def tensor(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def assert_close(actual, expected, what):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                          **TOL), f"{what}: dstrain {float(actual)!r}, TRL {expected!r}"


def assert_metrics(result, expected: dict):
    assert set(result.metrics) == set(expected), "the metric names differ from TRL's"
    for name, value in expected.items():
        assert_close(result.metrics[name], value, name)


def test_the_record_is_trl_1_16():
    assert RECORD["trl_version"] == "1.16.0"


# --- per-token and per-sequence log-probs ----------------------------------------------------------------

def test_token_logps_from_logits_match_trls_fused_head():
    rec = RECORD["token_logps"]
    labels = pl.shift_labels(tensor(rec["labels"], torch.long))
    expected = F.pad(tensor(rec["log_probs"]), (0, 1))  # TRL's are [B, T - 1]; the last position scores nothing
    for chunk in (1, 4, 1024):
        assert torch.allclose(pl.token_logps(tensor(rec["logits"]), labels, chunk=chunk), expected, **TOL)


def test_token_logps_from_the_head_match_trls_fused_head():
    rec = RECORD["token_logps"]
    labels = pl.shift_labels(tensor(rec["labels"], torch.long))
    expected = F.pad(tensor(rec["log_probs"]), (0, 1))
    got = pl.head_token_logps(tensor(rec["hidden"]), tensor(rec["lm_head_weight"]), labels, chunk=7)
    assert torch.allclose(got, expected, **TOL)


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_log_probs_have_autograds_gradients(bias):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(23, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(23, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    labels = torch.randint(0, 23, (2, 9), generator=gen)
    labels[0, :3] = -100
    upstream = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    logits = F.linear(hidden, weight, b)
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    reference = torch.where(labels != -100, picked, 0)
    inputs = [hidden, weight] + ([b] if bias else [])
    want = torch.autograd.grad((reference * upstream).sum(), inputs)
    from_head = pl.head_token_logps(hidden, weight, labels, b, chunk=4, vocab_slice=5)  # 23 rows: 5 slices
    got = torch.autograd.grad((from_head * upstream).sum(), inputs)
    from_logits = pl.token_logps(F.linear(hidden, weight, b), labels, chunk=5)
    got_logits = torch.autograd.grad((from_logits * upstream).sum(), inputs)
    assert torch.allclose(from_head.double(), reference, atol=1e-6)
    for w, g, gl in zip(want, got, got_logits):
        assert torch.allclose(g, w, atol=1e-6) and torch.allclose(gl, w, atol=1e-6)


def test_packed_pairs_give_the_unpacked_sequence_logps():
    """Chosen and rejected completions of 3 pairs, padded one a row and packed two rows of several
    examples: the same summed and averaged log-probs (fp32, 1e-5)."""
    gen = torch.Generator().manual_seed(3)
    vocab, pairs = 19, 3
    lengths = [7, 5, 9, 4, 6, 8]  # chosen 0..2, then rejected 0..2 (segment ids 0..5)
    prompts = [2, 3, 2, 3, 1, 2]
    examples = []
    for length, prompt in zip(lengths, prompts):
        logits = 4 * torch.randn(length, vocab, generator=gen)
        labels = torch.randint(0, vocab, (length,), generator=gen)
        labels[:prompt] = -100  # labels already aligned with the logits (shifted): the prompt scores nothing
        examples.append((logits, labels))
    # unpacked: one padded row per completion
    width = max(lengths)
    logits = torch.zeros(2 * pairs, width, vocab)
    labels = torch.full((2 * pairs, width), -100)
    for row, (lg, lb) in enumerate(examples):
        logits[row, :len(lb)], labels[row, :len(lb)] = lg, lb
    per_token = pl.token_logps(logits, labels)
    padded_ids = pl.row_segment_ids(labels)
    sums = pl.sequence_logps(per_token, padded_ids, 2 * pairs)
    means = pl.sequence_logps(per_token, padded_ids, 2 * pairs, average=True)
    # packed: rows [c0 r0 c1] and [r1 c2 r2], with padding at the end of the second
    order = [[0, 3, 1], [4, 2, 5]]
    packed_width = max(sum(lengths[i] for i in row) for row in order) + 2
    packed_logits = torch.randn(2, packed_width, vocab, generator=gen)  # padding: whatever the model gives
    packed_labels = torch.full((2, packed_width), -100)
    segments = torch.full((2, packed_width), -1)
    for r, row in enumerate(order):
        at = 0
        for seg in row:
            lg, lb = examples[seg]
            packed_logits[r, at:at + len(lb)], packed_labels[r, at:at + len(lb)] = lg, lb
            segments[r, at:at + len(lb)] = torch.where(lb != -100, seg, -1)
            at += len(lb)
    packed_token = pl.token_logps(packed_logits, packed_labels, chunk=5)  # chunks straddle the examples
    assert torch.allclose(pl.sequence_logps(packed_token, segments, 2 * pairs), sums, **TOL)
    assert torch.allclose(pl.sequence_logps(packed_token, segments, 2 * pairs, average=True), means, **TOL)
    # and the losses on them
    chosen, rejected = sums.chunk(2)
    packed_chosen, packed_rejected = pl.sequence_logps(packed_token, segments, 2 * pairs).chunk(2)
    ref = torch.zeros(pairs)
    assert torch.allclose(pl.dpo_loss(packed_chosen, packed_rejected, ref, ref).loss,
                          pl.dpo_loss(chosen, rejected, ref, ref).loss, **TOL)


def test_packed_segment_ids_never_score_across_examples():
    """Two examples packed in a row, Hugging Face labels (unshifted), the second with no prompt: its first
    token is a label but the last position of the first example must not score it."""
    example_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    labels = torch.tensor([[-100, -100, 5, 6, 7, 8, 9, -100]])  # example 1's completion starts at its first token
    assert pl.shift_segment_ids(example_ids, labels).tolist() == [[-1, 0, 0, -1, 1, 1, -1, -1]]
    # the scored positions are those of the shifted labels, less the boundary
    shifted = pl.shift_labels(labels)
    assert shifted.tolist() == [[-100, 5, 6, 7, 8, 9, -100, -100]]


def test_pairs_packed_through_the_builtin_gpt_score_as_unpacked():
    """Chosen and rejected sequences of 2 pairs through a tiny built-in GPT: one padded row each, or all
    four packed in one row (position ids restarting, block-diagonal attention). Same summed log-probs,
    the head's log-probs taken in chunks; one completion has no prompt (its first token is never scored)."""
    from dstrain.models.gpt import GPT, document_mask
    torch.manual_seed(0)
    model = GPT(vocab_size=31, seq_len=32, d_model=16, n_layer=2, n_head=2).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)  # logits far from uniform

    def hidden(ids, positions, packed):
        x = model.tok_emb(ids) + model.pos_emb(positions)
        for block in model.blocks:
            x = block(x, document_mask(positions)) if packed else block(x)
        return model.ln_f(x)

    gen = torch.Generator().manual_seed(1)
    prompts, completions = [3, 2, 3, 0], [4, 5, 2, 6]  # chosen 0, chosen 1, rejected 0, rejected 1
    sequences = [torch.randint(0, 31, (p + c,), generator=gen) for p, c in zip(prompts, completions)]
    hf_labels = [torch.cat([torch.full((p,), -100), s[p:]]) for s, p in zip(sequences, prompts)]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(4, width, dtype=torch.long)
    labels = torch.full((4, width), -100)
    for row, (s, lb) in enumerate(zip(sequences, hf_labels)):
        ids[row, :len(s)], labels[row, :len(s)] = s, lb
    positions = torch.arange(width).expand(4, width)
    with torch.no_grad():
        targets = pl.shift_labels(labels)
        per_token = pl.head_token_logps(hidden(ids, positions, False), model.head.weight, targets, chunk=3)
        unpacked = pl.sequence_logps(per_token, pl.row_segment_ids(targets), 4)
        packed_ids = torch.cat(sequences)[None]
        packed_labels = torch.cat(hf_labels)[None]
        packed_positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
        example_ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])[None]
        packed_token = pl.head_token_logps(hidden(packed_ids, packed_positions, True), model.head.weight,
                                           pl.shift_labels(packed_labels), chunk=3)
        packed = pl.sequence_logps(packed_token, pl.shift_segment_ids(example_ids, packed_labels), 4)
    assert torch.allclose(packed, unpacked, **TOL)
    counts = pl.segment_logps(packed_token, pl.shift_segment_ids(example_ids, packed_labels), 4)[1]
    assert counts.tolist() == [4, 5, 2, 5]  # the prompt-less completion: its first token has no predictor


def test_bf16_logits_give_fp32_log_probs_of_the_upcast_logits():
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(2, 6, 50, generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (2, 6), generator=gen)
    got = pl.token_logps(logits, labels, chunk=4)
    want = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


# --- DPO -------------------------------------------------------------------------------------------------

def assert_grad_close(actual, expected, what):
    assert actual is not None, f"{what}: no gradient"
    assert torch.allclose(actual, tensor(expected), **TOL), f"{what}: gradients differ from TRL's"


def dpo_inputs(per_token=None):
    rec = RECORD["dpo"]
    mask = tensor(rec["completion_mask"], torch.long)
    per_token = tensor(rec["per_token_logps"]) if per_token is None else per_token
    # the labels' mask, shifted as the log-probs are; segment = row (chosen rows first, then rejected)
    scored = mask[:, 1:]
    ids = torch.where(scored.bool(), torch.arange(mask.shape[0])[:, None], -1)
    sums, counts = pl.segment_logps(per_token, ids, mask.shape[0])
    return sums.chunk(2), counts.chunk(2), tensor(rec["ref_chosen_logps"]), tensor(rec["ref_rejected_logps"])


DPO_CASES = RECORD["dpo"]["cases"]


@pytest.mark.parametrize("case", DPO_CASES, ids=[c["id"] for c in DPO_CASES])
def test_dpo_losses_match_trl(case):
    per_token = tensor(RECORD["dpo"]["per_token_logps"]).requires_grad_()
    (chosen, rejected), (chosen_counts, rejected_counts), ref_chosen, ref_rejected = dpo_inputs(per_token)
    config = case["config"]
    result = pl.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type=config["loss_type"],
                         loss_weights=config.get("loss_weights"), beta=config["beta"],
                         label_smoothing=config.get("label_smoothing", 0.0),
                         discopop_tau=config.get("discopop_tau", 0.05),
                         f_divergence=config.get("f_divergence_type", "reverse_kl"),
                         f_alpha=config.get("f_alpha_divergence_coef", 1.0),
                         chosen_counts=chosen_counts, rejected_counts=rejected_counts)
    assert_close(result.loss, case["loss"], "loss")
    assert_metrics(result, case["metrics"])
    assert set(result.terms) == set(config["loss_type"])
    result.loss.backward()
    assert_grad_close(per_token.grad, case["grad_per_token_logps"], "d loss / d token log-probs")


def test_every_dpo_loss_type_is_checked_against_trl():
    checked = {name for case in DPO_CASES for name in case["config"]["loss_type"]}
    assert checked == set(DPO_LOSS_TYPES)


def test_the_dpo_loss_has_a_gradient_through_the_policy_only():
    (chosen, rejected), (cc, rc), ref_chosen, ref_rejected = dpo_inputs()
    chosen = chosen.clone().requires_grad_()
    pl.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type=["sigmoid", "sft"],
                chosen_counts=cc, rejected_counts=rc).loss.backward()
    assert chosen.grad is not None and torch.isfinite(chosen.grad).all() and chosen.grad.abs().sum() > 0


# --- CPO / SimPO and ORPO --------------------------------------------------------------------------------

def paired_logps(logits, nll_over_prompt: bool = False):
    """Summed log-probs and counts of the recorded CPO/ORPO batch, from its logits; and the chosen NLL over
    the completion (CPO) or, with nll_over_prompt, over prompt and completion (ORPO)."""
    rec = RECORD["cpo_orpo"]
    width = logits.shape[1]

    def padded(key, value):
        return F.pad(tensor(rec["batch"][key], torch.long), (0, width - len(rec["batch"][key][0])), value=value)

    labels = torch.cat([padded(f"{side}_labels", -100) for side in ("chosen", "rejected")])
    per_token = pl.token_logps(logits, pl.shift_labels(labels))
    sums, counts = pl.segment_logps(per_token, pl.row_segment_ids(pl.shift_labels(labels)), labels.shape[0])
    pairs = labels.shape[0] // 2
    if nll_over_prompt:  # every attended token of the chosen sequences is a label
        ids = padded("chosen_input_ids", 0)
        full = pl.shift_labels(torch.where(padded("chosen_attention_mask", 0) == 1, ids, -100))
        nll_token = pl.token_logps(logits[:pairs], full)
        nll = -nll_token.sum() / (full != -100).sum()
    else:
        nll = None
    return sums.chunk(2), counts.chunk(2), nll


CPO_CASES = RECORD["cpo_orpo"]["cpo_cases"]
ORPO_CASES = RECORD["cpo_orpo"]["orpo_cases"]


@pytest.mark.parametrize("case", CPO_CASES, ids=[c["id"] for c in CPO_CASES])
def test_cpo_and_simpo_losses_match_trl(case):
    logits = tensor(RECORD["cpo_orpo"]["logits"]).requires_grad_()
    (chosen, rejected), (chosen_counts, rejected_counts), _ = paired_logps(logits)
    config = case["config"]
    result = pl.cpo_loss(chosen, rejected, chosen_counts, rejected_counts, loss_type=config["loss_type"],
                         beta=config["beta"], label_smoothing=config.get("label_smoothing", 0.0),
                         simpo_gamma=config.get("simpo_gamma", 0.5), cpo_alpha=config["cpo_alpha"],
                         alpha=config.get("alpha", 0.0))
    assert_close(result.loss, case["loss"], "loss")
    assert_metrics(result, case["metrics"])
    if "grad_logits" in case:
        result.loss.backward()
        assert_grad_close(logits.grad, case["grad_logits"], "d loss / d logits")


@pytest.mark.parametrize("case", ORPO_CASES, ids=[c["id"] for c in ORPO_CASES])
def test_orpo_loss_matches_trl(case):
    logits = tensor(RECORD["cpo_orpo"]["logits"]).requires_grad_()
    (chosen, rejected), (chosen_counts, rejected_counts), nll = paired_logps(logits, nll_over_prompt=True)
    result = pl.orpo_loss(chosen, rejected, chosen_counts, rejected_counts, nll, beta=case["config"]["beta"])
    assert_close(result.loss, case["loss"], "loss")
    assert_metrics(result, case["metrics"])
    if "grad_logits" in case:
        result.loss.backward()
        assert_grad_close(logits.grad, case["grad_logits"], "d loss / d logits")


def test_gradients_are_checked_for_simpo_cpo_and_orpo():
    assert any("grad_logits" in case and case["config"]["loss_type"] == "simpo" for case in CPO_CASES)
    assert any("grad_logits" in case and case["config"]["loss_type"] == "sigmoid" for case in CPO_CASES)
    assert any("grad_logits" in case for case in ORPO_CASES)


def test_log1mexp_is_stable_at_both_ends():
    x = torch.tensor([-1e-7, -0.5, -0.7, -30.0], dtype=torch.float64)
    assert torch.allclose(pl.log1mexp(x), torch.log(1 - torch.exp(x)), rtol=1e-6)


# --- KTO -------------------------------------------------------------------------------------------------

KTO_CASES = RECORD["kto"]["cases"]


@pytest.mark.parametrize("case", KTO_CASES, ids=[c["id"] for c in KTO_CASES])
def test_kto_losses_match_trl(case):
    rec, config = RECORD["kto"], case["config"]

    per_token = tensor(rec["per_token_logps"]).requires_grad_()
    kl_per_token = tensor(rec["kl_per_token_logps"]).requires_grad_()

    def summed(values, mask_key):
        mask = tensor(rec[mask_key], torch.long)[:, 1:]
        ids = torch.where(mask.bool(), torch.arange(mask.shape[0])[:, None], -1)
        return pl.sequence_logps(values, ids, mask.shape[0])

    logps = summed(per_token, "completion_mask")
    kl = None
    if config["loss_type"] == "kto":
        kl_logps = summed(kl_per_token, "kl_completion_mask")
        kl = pl.kto_kl_estimate(kl_logps, tensor(rec["ref_kl_logps"]) - config.get("kl_shift", 0.0))
    result = pl.kto_loss(logps, tensor(rec["ref_logps"]), tensor(config["labels"], torch.bool), kl,
                         loss_type=config["loss_type"], beta=config["beta"],
                         desirable_weight=config.get("desirable_weight", 1.0),
                         undesirable_weight=config.get("undesirable_weight", 1.0))
    assert_close(result.loss, case["loss"], "loss")
    assert_metrics(result, case["metrics"])
    result.loss.backward()
    assert_grad_close(per_token.grad, case["grad_per_token_logps"], "d loss / d token log-probs")
    assert kl_per_token.grad is None  # the KL term is an estimate without gradient, as TRL's


def test_kto_mismatched_completions_rotate_by_one():
    assert pl.kto_mismatched_order(4) == [3, 0, 1, 2]
    assert pl.kto_mismatched_order(0) == []


# --- reward model ----------------------------------------------------------------------------------------

REWARD_CASES = RECORD["reward"]["cases"]


@pytest.mark.parametrize("case", REWARD_CASES, ids=[c["id"] for c in REWARD_CASES])
def test_reward_model_loss_matches_trl(case):
    rec, config = RECORD["reward"], case["config"]
    chosen, rejected = tensor(rec["rewards"]).chunk(2)
    result = pl.reward_loss(chosen, rejected, tensor(rec["margins"]) if config.get("margin") else None,
                            config.get("center_rewards_coefficient"))
    assert_close(result.loss, case["loss"], "loss")
    assert_metrics(result, case["metrics"])


# --- bad arguments ---------------------------------------------------------------------------------------

def zeros(n=3):
    return torch.zeros(n)


@pytest.mark.parametrize("call, message", [
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="rpo"), "accepted are sigmoid, hinge"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type=[]), "give one or more of sigmoid"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), beta=0), "beta must be a finite number > 0"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), beta=-0.1), "beta must be a finite number > 0"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
     "1 loss weights for 2 loss types"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="ipo"), "needs chosen_counts"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="exo_pair"), "(0, 1)"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="robust", label_smoothing=0.5), "[0, 0.5)"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="bco_pair", f_divergence="js_divergence"),
     "applies to the loss types sigmoid"),
    (lambda: pl.dpo_loss(zeros(), zeros(), zeros(), zeros(), f_divergence="kl"), "accepted are reverse_kl"),
    (lambda: pl.cpo_loss(zeros(), zeros(), zeros(), zeros(), loss_type="orpo"),
     "accepted are sigmoid, hinge, ipo, simpo"),
    (lambda: pl.cpo_loss(zeros(), zeros(), zeros(), zeros(), beta=0.0), "beta must be"),
    (lambda: pl.orpo_loss(zeros(), zeros(), zeros(), zeros(), zeros(1)[0], beta=-1), "beta must be"),
    (lambda: pl.kto_loss(zeros(), zeros(), zeros().bool(), loss_type="bco"), "accepted are kto, apo_zero_unpaired"),
    (lambda: pl.kto_loss(zeros(), zeros(), zeros().bool()), "needs kl"),
    (lambda: pl.token_logps(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)), "do not match labels"),
    (lambda: pl.segment_logps(zeros(4), torch.zeros(3, dtype=torch.long), 1), "do not match log-probs"),
], ids=["unknown-loss", "empty-list", "beta-0", "beta-negative", "weights-length", "ipo-counts",
        "exo-smoothing", "robust-smoothing", "f-divergence-loss", "f-divergence-name", "cpo-unknown", "cpo-beta",
        "orpo-beta", "kto-unknown", "kto-kl", "logits-shape", "segments-shape"])
def test_bad_arguments_raise_value_error_naming_what_is_accepted(call, message):
    with pytest.raises(ValueError) as caught:
        call()
    assert message in str(caught.value)


def test_the_names_table_is_torch_free_and_checks_alone():
    import ast
    import dstrain.config.preference as names
    tree = ast.parse(Path(names.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert "torch" not in imported
    assert check_loss_types("sigmoid") == (("sigmoid",), (1.0,))
    assert check_loss_types(["sigmoid", "sft"], [1, 0.5]) == (("sigmoid", "sft"), (1.0, 0.5))
    with pytest.raises(ValueError, match="finite"):
        check_beta(float("nan"))
