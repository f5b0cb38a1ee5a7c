"""`convert-checkpoint --format peft` and `train.export_final: peft`: the LoRA adapters alone, as the folder
`peft.PeftModel.from_pretrained(base_model, OUTPUT)` loads on the untouched base model.

OUTPUT holds adapter_config.json (the run's model.lora as peft.LoraConfig, written to the run's hf_source/
by `dstrain run`, target_modules made explicit where peft chose them), adapter_model.safetensors (each adapter under
peft's saved names: `base_model.model.<layer>.lora_A.weight`, `.lora_B.weight`, DoRA's
`.lora_magnitude_vector`, and a modules_to_save module's trained copy as `base_model.model.<module>.weight`)
and the tokenizer files. The checkpoint is consolidated by the ordinary converter into a temporary
folder next to OUTPUT first (room for the fp32 model is needed while it runs), and only the adapters are
kept; the folder is renamed into place at the end, so a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dstrain.errors import UserError
from dstrain.rundir import HF_LORA
from dstrain.tools.convert.formats import DTYPES
from dstrain.tools.convert.hf_folder import COPIED, find_source, own_key, staging

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's names start where its LoraModel wraps the model


@dataclass
class PeftExport:
    """What `export_peft_folder` wrote."""

    folder: Path
    num_tensors: int
    dtype: str
    tag: str
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"wrote {self.folder} ({self.num_tensors} adapter tensors in {self.dtype}, from {self.tag})",
                 f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "
                 f"{str(self.folder)!r})"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def adapter_name(own: str) -> str | None:
    """The name peft saves a trained tensor under (own: the name inside the Hugging Face model, peft's
    adapter-name level still in it), or None for a tensor that is not part of the adapter."""
    if ".original_module." in own:
        return None  # modules_to_save: the frozen original stays in the base model
    if ".modules_to_save.default." in own:
        return PEFT_PREFIX + own.replace(".modules_to_save.default.", ".")
    if ".lora_" not in own:
        return None
    name = re.sub(r"\.(lora_[A-Za-z_]+)\.default\b", r".\1", own)
    return PEFT_PREFIX + name.removesuffix(".lora_magnitude_vector.weight") + (
        ".lora_magnitude_vector" if name.endswith(".lora_magnitude_vector.weight") else "")


def export_peft_folder(checkpoint_dir: Path, output: Path, *, tag: str | None = None, dtype: str = "fp32",
                       force: bool = False, source: Path | None = None) -> PeftExport:
    """Write the adapters of CHECKPOINT_DIR's LoRA run as a peft adapter folder OUTPUT (module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dstrain.tools.convert import convert_checkpoint
    from dstrain.tools.convert.reader import open_checkpoint

    source_dir = find_source(checkpoint_dir, source, "--format peft")
    if not (source_dir / ADAPTER_CONFIG).is_file():
        raise UserError.single(f"no {ADAPTER_CONFIG} in {source_dir}: this run trained no LoRA adapters",
                               "--format peft", "use --format hf (the whole model) for a run without model.lora")
    _refuse_base_weights_trained(open_checkpoint(Path(checkpoint_dir), tag).states.get("param_shapes") or [])
    with staging(output, dtype, force) as temp:
        consolidated = temp / "consolidated.safetensors"
        report = convert_checkpoint(checkpoint_dir, consolidated, tag=tag, dtype="fp32")
        with safe_open(str(consolidated), framework="pt") as handle:
            tensors = {name: handle.get_tensor(key).to(DTYPES[dtype]).contiguous()
                       for key in handle.keys() if (name := adapter_name(own_key(key)))}
        consolidated.unlink()
        if not tensors:
            raise UserError.single("the checkpoint holds no LoRA adapter weights", str(checkpoint_dir),
                                   "export a checkpoint of the run whose hf_source/ this is (--hf-source)")
        save_file(tensors, str(temp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (temp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(source_dir), indent=2) + "\n")
        for path in source_dir.iterdir():
            if path.is_file() and path.name in COPIED and path.name != "generation_config.json":
                shutil.copyfile(path, temp / path.name)  # the tokenizer, so the folder alone can generate
    return PeftExport(Path(output), len(tensors), dtype, report.tag, report.notes)


def adapter_config(source_dir: Path) -> dict:
    """hf_source/adapter_config.json, completed from the layers that got adapters (rank 0 recorded them
    in dstrain_lora.json): target_modules left to peft's choice (unset, all-linear) become the last names
    of those layers, and a GPT-2-style Conv1D layout is recorded as trained."""
    config = json.loads((source_dir / ADAPTER_CONFIG).read_text())
    layers_file = source_dir / HF_LORA
    if layers_file.is_file():
        layers = json.loads(layers_file.read_text())
        if layers:
            linear = {name.rsplit(".", 1)[-1] for name, layer in layers.items() if "parameter" not in layer}
            if not isinstance(config.get("target_modules"), list) and linear:
                config["target_modules"] = sorted(linear)
            config["fan_in_fan_out"] = any(layer["fan_in_fan_out"] for layer in layers.values())
    config["inference_mode"] = True
    return config


def _refuse_base_weights_trained(param_shapes: list[dict]) -> None:
    """The optimizer's parameters (the checkpoint's param_shapes) must all belong to the adapter: a base
    weight trained too (train.trainable) would be lost from an adapter folder."""
    trained = [own_key(name) for group in param_shapes for name in group]
    outside = [name for name in trained if adapter_name(name) is None]
    if outside:
        raise UserError.single(f"{len(outside)} trained parameters are not part of the adapters "
                               f"(e.g. {', '.join(outside[:3])}): an adapter folder would lose them",
                               "--format peft", "export the whole model with --format hf, or train only the "
                               "adapters and model.lora.modules_to_save")
