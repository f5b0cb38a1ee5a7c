"""Records TRL's own preference losses and metrics on fixed inputs, for tests/test_preference_loss.py to
compare dstrain.models.preference_loss against (tests/data/trl_preference_losses.json).

Run with a Python that has TRL (not dstrain's venv; nothing of dstrain is imported here):

    python3 -m venv /work/trl-venv && /work/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0
    /work/trl-venv/bin/python tests/scripts/record_trl_preference_losses.py

How TRL is called: each trainer's loss method, unbound, on an instance made without __init__
(`Trainer.__new__(Trainer)`) that carries only the attributes the method reads, and a stand-in model that
returns fixed outputs for fixed inputs (per-token log-probs for DPO and KTO, as TRL's fused LM head returns
them; logits for CPO and ORPO; reward logits for the reward model). So the recorded numbers go through TRL's
own masking, summing, averaging, loss and metric code, with no dataset, tokenizer or training loop. Besides
each loss and its metrics, the loss's gradient w.r.t. those inputs is recorded (DPO, KTO: the per-token
log-probs; some CPO/SimPO and ORPO cases: the logits), which also pins what TRL detaches:

- DPOTrainer._compute_loss(self, model, inputs, return_outputs=False), reference log-probs precomputed
- CPOTrainer.get_batch_loss_metrics(self, model, batch) (trl.experimental.cpo; SimPO is loss_type "simpo")
- ORPOTrainer.get_batch_loss_metrics(self, model, batch) (trl.experimental.orpo)
- KTOTrainer._compute_loss(self, model, inputs, return_outputs=False), reference log-probs precomputed
- RewardTrainer.compute_loss(self, model, inputs)
- the per-token log-probs of a tiny random Llama through trl's add_fused_lm_head (model(..., labels,
  fused_lm_head=True).log_probs), with its logits, last hidden states and LM head weight.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
import trl
from trl import DPOTrainer, KTOTrainer, RewardTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer
from trl.trainer.utils import add_fused_lm_head

OUT = Path(__file__).resolve().parents[1] / "data" / "trl_preference_losses.json"
DEVICE = torch.device("cpu")


class Accelerator:
    """One process: gathers return their input."""
    device = DEVICE

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def unwrap_model(model):
        return model


class LookupModel(torch.nn.Module):
    """Returns the output recorded for the input_ids it is called with (compared by value)."""

    def __init__(self, table):
        super().__init__()
        self.table = table  # list of (input_ids, output factory)

    def forward(self, input_ids=None, labels=None, **kwargs):
        for ids, make in self.table:
            if ids.shape == input_ids.shape and torch.equal(ids, input_ids):
                return make(labels)
        raise KeyError("no recorded output for these input_ids")


def fused_output(per_token):
    """What TRL's fused LM head returns: log-probs of the shifted labels, 0 where the label is -100."""
    def make(labels):
        mask = labels[:, 1:] != -100
        zeros = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token.masked_fill(~mask, 0.0), entropy=zeros, mean_logits=zeros,
                               is_top1=torch.zeros_like(mask), aux_loss=None)
    return make


def bare(cls, **attributes):
    """An instance of a TRL trainer without its __init__, carrying `attributes` and one process's state."""
    trainer = cls.__new__(cls)
    base = {"accelerator": Accelerator(), "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
            "_total_train_tokens": 0, "_tp_size": 1, "aux_loss_enabled": False}
    for key, value in {**base, **attributes}.items():
        setattr(trainer, key, value)
    return trainer


def rows(t):
    """A tensor as nested lists; fp32 values to 9 significant digits, which read back as the same fp32."""
    return [rows(part) for part in t] if t.dim() > 1 else [
        float(f"{v:.9g}") if isinstance(v, float) else v for v in t.tolist()]


def last_metrics(trainer):
    return {key: values[-1] for key, values in trainer._metrics["train"].items()}


def padded_rows(gen, count, width, prompt_range, length_range, vocab):
    """input_ids, attention_mask, completion_mask [count, width]: a prompt then a completion, right padding."""
    ids = torch.randint(1, vocab, (count, width), generator=gen)
    attention = torch.zeros(count, width, dtype=torch.long)
    completion = torch.zeros(count, width, dtype=torch.long)
    for row in range(count):
        length = int(torch.randint(*length_range, (1,), generator=gen))
        prompt = int(torch.randint(*prompt_range, (1,), generator=gen))
        attention[row, :length] = 1
        completion[row, prompt:length] = 1
        ids[row, length:] = 0
    return ids, attention, completion


# --- DPO -------------------------------------------------------------------------------------------------

DPO_CASES = [
    {"loss_type": ["sigmoid"], "beta": 0.1},
    {"loss_type": ["hinge"], "beta": 0.3},
    {"loss_type": ["ipo"], "beta": 0.1},
    {"loss_type": ["exo_pair"], "beta": 0.1, "label_smoothing": 0.1},
    {"loss_type": ["nca_pair"], "beta": 0.2},
    {"loss_type": ["robust"], "beta": 0.1, "label_smoothing": 0.2},
    {"loss_type": ["bco_pair"], "beta": 0.1},
    {"loss_type": ["sppo_hard"], "beta": 0.5},
    {"loss_type": ["aot"], "beta": 0.1, "label_smoothing": 0.1},
    {"loss_type": ["aot_unpaired"], "beta": 0.1, "label_smoothing": 0.05},
    {"loss_type": ["apo_zero"], "beta": 0.1},
    {"loss_type": ["apo_down"], "beta": 0.1},
    {"loss_type": ["discopop"], "beta": 0.05, "discopop_tau": 0.05},
    {"loss_type": ["sft"], "beta": 0.1},
    {"loss_type": ["sigmoid_norm"], "beta": 0.5},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.7], "beta": 0.1},  # RPO
    {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0], "beta": 0.1},  # MPO
    {"loss_type": ["sigmoid"], "beta": 0.1, "f_divergence_type": "forward_kl"},
    {"loss_type": ["sigmoid"], "beta": 0.1, "f_divergence_type": "js_divergence"},
    {"loss_type": ["sigmoid"], "beta": 0.1, "f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5},
    {"loss_type": ["ipo", "hinge"], "beta": 0.2, "f_divergence_type": "js_divergence"},
]


def case_id(case):
    parts = ["+".join(case["loss_type"])]
    parts += [f"{key}={value}" for key, value in case.items() if key not in ("loss_type", "loss_weights")]
    if "loss_weights" in case:
        parts.append(f"weights={case['loss_weights']}")
    return ",".join(parts)


def record_dpo(gen):
    pairs, width, vocab = 6, 12, 50
    ids, attention, completion = padded_rows(gen, 2 * pairs, width, (2, 5), (7, width + 1), vocab)
    per_token = -4 * torch.rand(2 * pairs, width - 1, generator=gen)
    sums = (per_token * completion[:, 1:]).sum(1)
    ref = sums + 2 * torch.randn(2 * pairs, generator=gen)
    ref_chosen, ref_rejected = ref.chunk(2)
    per_token.requires_grad_()  # the loss's gradient w.r.t. the policy's token log-probs is recorded too
    model = LookupModel([(ids, fused_output(per_token))])
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    results = []
    for case in DPO_CASES:
        trainer = bare(DPOTrainer, model=model, beta=case["beta"], precompute_ref_logps=True,
                       loss_types=case["loss_type"],
                       loss_weights=case.get("loss_weights") or [1.0] * len(case["loss_type"]),
                       ld_alpha=None, f_divergence_type=case.get("f_divergence_type", "reverse_kl"),
                       f_alpha_divergence_coef=case.get("f_alpha_divergence_coef", 1.0),
                       label_smoothing=case.get("label_smoothing", 0.0), use_weighting=False,
                       args=SimpleNamespace(discopop_tau=case.get("discopop_tau", 0.05),
                                            gradient_checkpointing_kwargs=None))
        loss = DPOTrainer._compute_loss(trainer, model, dict(inputs), return_outputs=False)
        (grad,) = torch.autograd.grad(loss, per_token)
        metrics = {key: value for key, value in last_metrics(trainer).items()
                   if key.startswith(("rewards/", "logps/"))}
        results.append({"id": case_id(case), "config": case, "loss": loss.item(), "metrics": metrics,
                        "grad_per_token_logps": rows(grad)})
    return {"completion_mask": rows(completion), "per_token_logps": rows(per_token.detach()),
            "ref_chosen_logps": rows(ref_chosen), "ref_rejected_logps": rows(ref_rejected), "cases": results}


# --- CPO / SimPO and ORPO --------------------------------------------------------------------------------

CPO_GRAD_CASES = (2, 4)  # the cases whose gradient w.r.t. the logits is recorded (one SimPO, one CPO)
ORPO_GRAD_CASES = (1,)
CPO_CASES = [
    {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
    {"loss_type": "simpo", "beta": 2.5, "simpo_gamma": 1.4, "cpo_alpha": 0.0, "label_smoothing": 0.1},
    {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.05},
    {"loss_type": "sigmoid", "beta": 0.1, "cpo_alpha": 1.0},
    {"loss_type": "sigmoid", "beta": 0.1, "cpo_alpha": 1.0, "label_smoothing": 0.2},
    {"loss_type": "hinge", "beta": 0.1, "cpo_alpha": 1.0},
    {"loss_type": "ipo", "beta": 0.5, "cpo_alpha": 0.5},
    {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "alpha": 0.25},  # AlphaPO
]
ORPO_CASES = [{"beta": 0.1}, {"beta": 0.5}, {"beta": 2.0}]


def paired_logits_batch(gen):
    """A CPO/ORPO batch (chosen and rejected of different widths) and the logits of its concatenation."""
    pairs, vocab = 4, 13
    batch = {}
    for side, width in (("chosen", 9), ("rejected", 11)):
        ids, attention, completion = padded_rows(gen, pairs, width, (2, 5), (6, width + 1), vocab)
        batch[f"{side}_input_ids"] = ids
        batch[f"{side}_attention_mask"] = attention
        batch[f"{side}_labels"] = ids.masked_fill(completion == 0, -100)
    logits = 3 * torch.randn(2 * pairs, 11, vocab, generator=gen)
    return batch, logits


def record_cpo_orpo(gen):
    batch, logits = paired_logits_batch(gen)
    logits.requires_grad_()
    width = logits.shape[1]
    concatenated = torch.cat([torch.nn.functional.pad(batch[f"{s}_input_ids"],
                                                      (0, width - batch[f"{s}_input_ids"].shape[1]))
                              for s in ("chosen", "rejected")])
    model = LookupModel([(concatenated, lambda labels: SimpleNamespace(logits=logits))])
    cpo = []
    for case in CPO_CASES:
        trainer = bare(CPOTrainer, is_encoder_decoder=False, pad_token_id=0, loss_type=case["loss_type"],
                       beta=case["beta"], label_smoothing=case.get("label_smoothing", 0.0),
                       simpo_gamma=case.get("simpo_gamma", 0.5), cpo_alpha=case["cpo_alpha"],
                       alpha=case.get("alpha", 0.0))
        loss, metrics = CPOTrainer.get_batch_loss_metrics(trainer, model, dict(batch))
        metrics = {key: value for key, value in metrics.items() if not key.startswith("logits/")}
        cpo.append({"id": ",".join(f"{k}={v}" for k, v in case.items()), "config": case, "loss": loss.item(),
                    "metrics": metrics})
        if len(cpo) - 1 in CPO_GRAD_CASES:
            cpo[-1]["grad_logits"] = rows(torch.autograd.grad(loss, logits)[0])
    orpo = []
    for case in ORPO_CASES:
        trainer = bare(ORPOTrainer, is_encoder_decoder=False, padding_value=0, beta=case["beta"])
        loss, metrics = ORPOTrainer.get_batch_loss_metrics(trainer, model, dict(batch))
        metrics = {key: value for key, value in metrics.items() if not key.startswith("logits/")}
        orpo.append({"id": f"beta={case['beta']}", "config": case, "loss": loss.item(), "metrics": metrics})
        if len(orpo) - 1 in ORPO_GRAD_CASES:
            orpo[-1]["grad_logits"] = rows(torch.autograd.grad(loss, logits)[0])
    return {"batch": {key: rows(value) for key, value in batch.items()}, "logits": rows(logits.detach()),
            "cpo_cases": cpo, "orpo_cases": orpo}


# --- KTO -------------------------------------------------------------------------------------------------

KTO_CASES = [
    {"loss_type": "kto", "beta": 0.1, "labels": [1, 0, 1, 1, 0, 0, 1, 0]},
    {"loss_type": "kto", "beta": 0.5, "desirable_weight": 1.33, "undesirable_weight": 0.7,
     "labels": [1, 1, 1, 0, 1, 0, 1, 1]},
    {"loss_type": "kto", "beta": 0.1, "labels": [1, 0, 1, 1, 0, 0, 1, 0], "kl_shift": -40.0},  # KL clamped to 0
    {"loss_type": "kto", "beta": 0.1, "labels": [1, 1, 1, 1, 1, 1, 1, 1]},  # no undesirable completion
    {"loss_type": "apo_zero_unpaired", "beta": 0.2, "labels": [0, 1, 0, 1, 1, 0, 0, 1]},
]


def record_kto(gen):
    count, width, vocab = 8, 12, 50
    ids, attention, completion = padded_rows(gen, count, width, (2, 5), (7, width + 1), vocab)
    kl_ids, kl_attention, kl_completion = padded_rows(gen, count, width + 2, (2, 5), (7, width + 3), vocab)
    per_token = -4 * torch.rand(count, width - 1, generator=gen)
    kl_per_token = -4 * torch.rand(count, width + 1, generator=gen)
    ref = (per_token * completion[:, 1:]).sum(1) + 2 * torch.randn(count, generator=gen)
    ref_kl = (kl_per_token * kl_completion[:, 1:]).sum(1) + 2 * torch.randn(count, generator=gen) - 1.0
    per_token.requires_grad_()
    kl_per_token.requires_grad_()  # TRL's KL forward runs under no_grad: no gradient reaches these
    model = LookupModel([(ids, fused_output(per_token)), (kl_ids, fused_output(kl_per_token))])
    results = []
    for case in KTO_CASES:
        trainer = bare(KTOTrainer, model=model, beta=case["beta"], loss_type=case["loss_type"],
                       desirable_weight=case.get("desirable_weight", 1.0),
                       undesirable_weight=case.get("undesirable_weight", 1.0),
                       calculate_KL=case["loss_type"] != "apo_zero_unpaired", precompute_ref_logps=True)
        inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion,
                  "KL_input_ids": kl_ids, "KL_attention_mask": kl_attention, "KL_completion_mask": kl_completion,
                  "label": torch.tensor(case["labels"]), "ref_logps": ref,
                  "ref_KL_logps": ref_kl - case.get("kl_shift", 0.0)}
        loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
        grad, kl_grad = torch.autograd.grad(loss, (per_token, kl_per_token), allow_unused=True)
        assert kl_grad is None
        metrics = {key: value for key, value in last_metrics(trainer).items()
                   if key.startswith(("rewards/", "logps/", "kl"))}
        results.append({"id": ",".join(f"{k}={v}" for k, v in case.items() if k != "labels")
                        + f",desirable={sum(case['labels'])}", "config": case, "loss": loss.item(),
                        "metrics": metrics, "grad_per_token_logps": rows(grad)})
    return {"completion_mask": rows(completion), "per_token_logps": rows(per_token.detach()),
            "kl_completion_mask": rows(kl_completion), "kl_per_token_logps": rows(kl_per_token.detach()),
            "ref_logps": rows(ref), "ref_kl_logps": rows(ref_kl), "cases": results}


# --- reward model ----------------------------------------------------------------------------------------

REWARD_CASES = [{}, {"margin": True}, {"center_rewards_coefficient": 0.01},
                {"margin": True, "center_rewards_coefficient": 0.1}]


def record_reward(gen):
    pairs = 6
    rewards = 2 * torch.randn(2 * pairs, 1, generator=gen)
    margins = torch.rand(pairs, generator=gen)
    ids = torch.randint(1, 50, (2 * pairs, 5), generator=gen)
    model = LookupModel([(ids, lambda labels: SimpleNamespace(logits=rewards))])
    results = []
    for case in REWARD_CASES:
        trainer = bare(RewardTrainer, model=model,
                       args=SimpleNamespace(center_rewards_coefficient=case.get("center_rewards_coefficient")))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if case.get("margin"):
            inputs["margin"] = margins
        loss = RewardTrainer.compute_loss(trainer, model, inputs)
        metrics = {key: value for key, value in last_metrics(trainer).items() if key != "num_tokens"}
        results.append({"id": ",".join(f"{k}={v}" for k, v in case.items()) or "plain", "config": case,
                        "loss": loss.item(), "metrics": metrics})
    return {"rewards": rows(rewards.squeeze(-1)), "margins": rows(margins), "cases": results}


# --- per-token log-probs of a tiny causal LM -------------------------------------------------------------

def record_token_logps(gen):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.5)  # logits far from uniform
    model = transformers.LlamaForCausalLM(config).eval()
    ids, attention, completion = padded_rows(gen, 3, 10, (2, 4), (6, 11), 37)
    labels = ids.masked_fill(completion == 0, -100)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        add_fused_lm_head(model)
        log_probs = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs
    return {"labels": rows(labels), "logits": rows(logits), "hidden": rows(hidden),
            "lm_head_weight": rows(model.lm_head.weight), "log_probs": rows(log_probs)}


def main() -> int:
    gen = torch.Generator().manual_seed(1234)
    record = {
        "about": "TRL's preference losses on fixed inputs; written by tests/scripts/record_trl_preference_losses.py",
        "trl_version": trl.__version__, "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "token_logps": record_token_logps(gen),
        "dpo": record_dpo(gen), "cpo_orpo": record_cpo_orpo(gen), "kto": record_kto(gen),
        "reward": record_reward(gen),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1)
    # one line per innermost list of numbers
    text = re.sub(r"\[\s+([-0-9.e, \n]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {OUT} (TRL {trl.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
