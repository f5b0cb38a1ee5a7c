"""tests/test_moe.py's ranks (two, with different tokens each, so they route to different experts): for each
family in params["families"], a tiny model saved as save_pretrained writes it (a mixture of experts in the
published per-expert layout) is built through dstrain's ZeRO-3 path (zero.Init, transformers' conversions
applied group by group), one step is trained with a real deepspeed.initialize at stage 3, the checkpoint is saved and
exported with `convert-checkpoint --format hf`'s writer. Reports the first step's loss beside transformers'
own from_pretrained model's on the same batch, the exported folder's layout beside the source's, and the
export's logits beside the trained model's, and what the loop would log of the router (lm_loss, aux_loss,
expert_load, expert_tokens). params["lora_families"]: the same again with LoRA adapters (params["lora"]: on
attention and, through peft's target_parameters, on the fused experts), exported merged (--format hf) and as
a peft folder (--format peft), each read back beside the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed
import torch
import transformers
from safetensors import safe_open

from dstrain.config.schema import RunConfig
from dstrain.models import hf
from dstrain.rank.runtime import end_rank
from dstrain.rundir import HF_LORA, HF_SOURCE
from dstrain.tools.convert.hf_folder import export_hf_folder
from dstrain.tools.convert.peft_folder import export_peft_folder
from hf_families import config_of, save_family
from scripts.rank_setup import parameters, result, start_rank


def layout(folder: Path) -> dict[str, list[int]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}


def family_case(family: str, root: Path, model_kwargs: dict, lora: dict | None = None) -> dict:
    rank = torch.distributed.get_rank()
    case = f"{family}+lora" if lora else family
    source, run_dir = root / family, root / f"{case}-run"
    model_kwargs = {k: v for k, v in model_kwargs.items() if hasattr(config_of(family), k)}  # MoE options
    config = RunConfig.model_validate({"model": {"name": f"hf:{source}", "kwargs": model_kwargs, "lora": lora}})
    if rank == 0:  # rank 1 meets the architecture first inside zero.Init (hf._import_model_classes)
        if not source.is_dir():
            save_family(family, source)
        hf.save_source(config, run_dir)  # as `dstrain run` does at launch: config, tokenizer, the source's keys
    torch.distributed.barrier()
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    model = hf.build_pretrained(config, ds_config, torch.device("cpu"))
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    if lora and rank == 0:  # as the worker records them, for the merge on export
        (run_dir / HF_SOURCE / HF_LORA).write_text(json.dumps(hf.lora_layers(model)))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    # each rank its own tokens: the ranks route to different experts
    inputs = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1 + rank))
    batch = {"input_ids": inputs, "labels": inputs.clone()}
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    with torch.no_grad():
        expected = reference(**batch).loss.item()
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
    router = engine.module.router_stats  # what the loop logs: the balancing loss apart, the experts' load
    router = router.reduce() if router is not None else None
    engine.save_checkpoint(str(run_dir / "checkpoints"), tag="step1")
    engine.eval()
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = engine.module.model(input_ids=inputs).logits
    if rank == 0:
        export_hf_folder(run_dir / "checkpoints", root / f"{case}-export", tag="step1")
        if lora:
            export_peft_folder(run_dir / "checkpoints", root / f"{case}-adapter", tag="step1")
    torch.distributed.barrier()
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / f"{case}-export")
    with torch.no_grad():
        logits = exported(input_ids=inputs).logits
    adapter = {}
    if lora:  # the peft folder on the source model, as a user loads it
        import peft
        loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(source),
                                                root / f"{case}-adapter")
        with torch.no_grad():
            adapter["peft_vs_trained"] = (loaded(input_ids=inputs).logits - trained).abs().max().item()
        adapter["on_experts"] = sorted({n.split(".mlp.")[-1] for n in trainable if ".mlp.experts" in n})
        experts_b = [p for n, p in engine.module.named_parameters() if ".mlp.experts" in n and "lora_B" in n]
        with torch.no_grad(), deepspeed.zero.GatheredParameters(experts_b):
            adapter["experts_b_moved"] = max(p.abs().max().item() for p in experts_b)  # they start at zero
        adapter["trainable_outside"] = [n for n in trainable if ".lora_" not in n]
    source_layout, export_layout = layout(source), layout(root / f"{case}-export")
    return {"family": family, "lora": bool(lora), **adapter, "loss": loss.item(), "expected": expected,
            "per_expert_keys": sum(".experts.0." in key for key in source_layout),
            "same_layout": source_layout == export_layout,
            "layout_difference": sorted(set(source_layout) ^ set(export_layout))[:6],
            "export_vs_trained": (logits - trained).abs().max().item(),
            "trained_moved": (trained - reference(input_ids=inputs).logits).abs().max().item(),
            "router": router, "coef": getattr(reference.config, "router_aux_loss_coef", None),
            "moe_layers": sum(1 for name, _ in reference.named_modules() if name.endswith("mlp.experts")),
            "top_k": getattr(reference.config, "num_experts_per_tok", None), "tokens": inputs.numel(),
            "ranks": torch.distributed.get_world_size()}


def main() -> None:
    params = parameters()
    start_rank(params)
    root = Path(params["root"])
    kwargs = params.get("model_kwargs", {})
    result([family_case(family, root, kwargs) for family in params["families"]]
           + [family_case(family, root, kwargs, params["lora"]) for family in params.get("lora_families", [])])


if __name__ == "__main__":
    main()
    end_rank()
