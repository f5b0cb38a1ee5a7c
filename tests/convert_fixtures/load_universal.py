"""Load a universal checkpoint into a fresh ZeRO stage-2 engine and save what it holds.

Run through the launcher with any number of ranks, for example:

    deepspeed --num_gpus 1 tests/convert_fixtures/load_universal.py \
        --load-dir /tmp/universal --reference /tmp/loaded.pt

REFERENCE gets the same "fp32" / "params" dicts as train_tiny.py writes, taken from the
engine right after `engine.load_checkpoint(LOAD_DIR)`.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
from train_tiny import TinyLM, build_config, param_groups  # same directory: on sys.path
from deepspeed.utils import safe_get_full_fp32_param
from dstrain.rank.runtime import end_rank, skip_shared_memory_all_reduce_op


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--reference", required=True)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the launcher
    args = parser.parse_args()

    skip_shared_memory_all_reduce_op()  # as in train_tiny.py
    deepspeed.init_distributed()
    torch.manual_seed(1)  # not the training seed: the weights must come from the checkpoint
    model = TinyLM()
    config = build_config(args.stage, "fp32")
    config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    load_path, _ = engine.load_checkpoint(args.load_dir)
    assert load_path is not None, f"nothing loaded from {args.load_dir}"

    fp32, params = {}, {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters([param]):
            params[name] = param.detach().cpu().clone()
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        fp32[name] = (master if master is not None else params[name]).detach().cpu().float().clone()
    for name, buffer in engine.module.state_dict().items():
        if name not in fp32:
            fp32[name] = buffer.detach().cpu().clone()
    if engine.global_rank == 0:
        torch.save({"fp32": fp32, "params": params, "global_steps": engine.global_steps}, args.reference)
    end_rank()


if __name__ == "__main__":
    main()
