"""Train a tiny model for 2 steps with DeepSpeed and save a real ZeRO checkpoint.

Run through the launcher, for example:

    deepspeed --num_gpus 2 tests/convert_fixtures/train_tiny.py \
        --run 3:fp32:/tmp/ckpt:/tmp/ref.pt --run 2:bf16:/tmp/ckpt2:/tmp/ref2.pt

Each --run trains a fresh model. Besides the checkpoint it writes REFERENCE (rank 0 only): a torch.save'd dict with
  "fp32":   every parameter's full fp32 master value, gathered from the live engine
            (plus buffers), i.e. what a converter must reproduce bit for bit;
  "params": every parameter as the model holds it (training dtype), gathered with
            deepspeed.zero.GatheredParameters under stage 3;
  "state_dict_keys": the keys of the plain model's state_dict, for strict loading.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param
from dstrain.rank.runtime import end_rank, skip_shared_memory_all_reduce_op
from torch import nn

VOCAB = 37
DIM = 13  # odd sizes so that flat partitions need padding


class TinyLM(nn.Module):
    """Embedding -> Linear -> LayerNorm -> tied output head, with buffers and a frozen weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: saved once, named twice
        # Frozen weights are stored apart from the optimizer's flat groups.
        # Random, not constant: a loader must really restore these to match.
        self.frozen_scale = nn.Parameter(0.5 + torch.rand(DIM), requires_grad=False)
        self.register_buffer("position_bias", torch.randn(DIM))
        self.register_buffer("seen_batches", torch.zeros((), dtype=torch.long))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        # Buffers keep their own dtype under bf16/fp16 training, so follow the weights' dtype.
        hidden = hidden + self.position_bias.to(hidden.dtype)
        hidden = self.norm(torch.relu(self.proj(hidden)) * self.frozen_scale.to(hidden.dtype))
        return self.head(hidden)


def build_config(stage: int, dtype: str) -> dict:
    """A DeepSpeed config that trains on the CPU accelerator."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return config


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups (no weight decay on norms and biases) so checkpoints hold several flat groups."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith("bias") or name.startswith("norm.") else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_and_save(stage: int, dtype: str, save_dir: str, reference: str, steps: int) -> None:
    """Train a fresh TinyLM for STEPS steps, save a checkpoint and the live reference weights."""
    torch.manual_seed(0)
    model = TinyLM()
    config = build_config(stage, dtype)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)

    # Each rank sees different data, so the gradients really are reduced across ranks.
    generator = torch.Generator().manual_seed(100 + engine.global_rank)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 5), generator=generator).to(engine.device)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens.reshape(-1))
        engine.backward(loss)
        engine.step()
        engine.module.seen_batches += 1

    engine.save_checkpoint(save_dir)

    module = engine.module
    fp32, params = {}, {}
    # remove_duplicate=False lists the tied head.weight under its own name too.
    for name, param in module.named_parameters(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters([param]):
            params[name] = param.detach().cpu().clone()
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        # Frozen weights, and all weights without a ZeRO/mixed-precision wrapper, have no
        # separate master copy: the parameter itself is what training left behind.
        fp32[name] = (master if master is not None else params[name]).detach().cpu().float().clone()
    for name, buffer in module.named_buffers():
        if name != "scratch":  # not persistent: not part of the state_dict
            fp32[name] = buffer.detach().cpu().clone()
    if engine.global_rank == 0:
        keys = list(TinyLM().state_dict().keys())
        torch.save({"fp32": fp32, "params": params, "state_dict_keys": keys}, reference)
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="STAGE:DTYPE:SAVE_DIR:REFERENCE",
        help="one checkpoint to produce; repeat to produce several in one launch (the launch is the slow part)",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the launcher
    args = parser.parse_args()

    skip_shared_memory_all_reduce_op()  # an op only AutoTP's inference_all_reduce calls: not built for this
    deepspeed.init_distributed()
    for run in args.run:
        stage, dtype, save_dir, reference = run.split(":", 3)
        train_and_save(int(stage), dtype, save_dir, reference, args.steps)
    # Left to the interpreter's teardown, about one two-rank launch of this script in ten aborted after
    # all its work was written (dstrain.rank.runtime.exit_without_teardown says why).
    end_rank()


if __name__ == "__main__":
    main()
