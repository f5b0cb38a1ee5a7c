"""`convert-checkpoint --format hf` and `train.export_final: hf`: a folder that transformers'
`AutoModelForCausalLM.from_pretrained` loads (a reward model's: `AutoModelForSequenceClassification`, as
the config.json in hf_source/ names it).

The checkpoint is first consolidated to one fp32 safetensors file by the ordinary streaming converter
(bounded RAM), inside a temporary folder next to OUTPUT. Its keys are then renamed to the model's own
(dstrain's `model.` wrapper and peft's `base_model.model.` removed), LoRA adapters are merged into
their base weights (W + scaling * B @ A), tied copies are dropped as save_pretrained drops them, and
the tensors are written block by block, cast to the asked dtype, into safetensors shards with
model.safetensors.index.json (DoRA's magnitude applied; a modules_to_save module's trained copy
written as the module's weights). The names and layout are the source checkpoint's: where transformers
converted its keys on load (a mixture-of-experts layer's per-expert tensors fused into 3-D parameters,
renamed keys), the reverse of those conversions is applied, as save_pretrained does
(dstrain.models.conversion; the source's keys are in hf_source/, recorded at launch). config.json (its
dtype set), generation_config.json and the tokenizer files come from the run directory's hf_source/,
which `dstrain run` copied from the model at launch. The folder is renamed into place at the end, so a
failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from dstrain.errors import UserError
from dstrain.rundir import HF_LORA, HF_SOURCE, HF_SOURCE_KEYS
from dstrain.tools.convert.formats import BLOCK_ELEMENTS, DTYPES, SAFETENSORS_DTYPES, parse_size
from dstrain.tools.convert.plan import Tensor, split_into_shards
from dstrain.tools.convert.writer import safetensors_header

DEFAULT_SHARD_SIZE = "5GB"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
WRAPPER_PREFIXES = ("model.", "base_model.model.")  # dstrain's CausalLM, then peft's PeftModel/LoraModel
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "vocab.txt", "spiece.model")


@dataclass
class HfExport:
    """What `export_hf_folder` wrote."""

    folder: Path
    files: list[str]
    num_tensors: int
    merged_lora: int  # base weights with an adapter merged in
    dtype: str
    tag: str
    notes: list[str] = field(default_factory=list)
    auto_class: str = "AutoModelForCausalLM"

    def summary(self) -> str:
        lines = [f"wrote {self.folder} ({self.num_tensors} tensors in {self.dtype}, {len(self.files)} weight file(s), "
                 f"from {self.tag}" + (f", {self.merged_lora} LoRA adapters merged" if self.merged_lora else "") + ")",
                 f"load it with: {self.auto_class}.from_pretrained({str(self.folder)!r})"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def auto_class_name(config: dict) -> str:
    """The Auto class that loads the export: a reward model's config.json (train.objective reward) names a
    sequence classifier, every other one a causal LM."""
    architecture = (config.get("architectures") or [""])[0]
    return ("AutoModelForSequenceClassification" if architecture.endswith("ForSequenceClassification")
            else "AutoModelForCausalLM")


@dataclass
class _Out:
    """One output tensor and how to compute it from the consolidated file."""

    tensor: Tensor
    base: str  # key in the consolidated file
    lora: dict | None = None  # {"a": key, "b": key, "scaling": float, "fan_in_fan_out": bool}
    group: object = None  # a converted tensor: the dstrain.models.conversion.Group of model tensors it comes from
    model: object = None  # with a group: the model (on the meta device) whose config the conversion may read
    sources: dict | None = None  # with a group: the model tensors' _Outs by name


def find_source(checkpoint_dir: Path, source: Path | None, option: str = "--format hf") -> Path:
    """The folder holding config.json and the tokenizer: SOURCE, or the run directory's hf_source/."""
    if source is not None:
        candidates = [Path(source)]
    else:
        start = Path(checkpoint_dir).resolve()
        candidates = [parent / HF_SOURCE for parent in (start, start.parent, start.parent.parent)]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise UserError.single(f"no config.json for {option} (looked in {', '.join(str(c) for c in candidates)})",
                           str(checkpoint_dir), f"{option} needs a run of an \"hf:\" model (its run directory "
                           "holds hf_source/), or pass --hf-source DIR with the model's config.json and tokenizer")


def export_hf_folder(checkpoint_dir: Path, output: Path, *, tag: str | None = None, dtype: str = "fp32",
                     max_shard_size: str | int | None = None, force: bool = False,
                     source: Path | None = None) -> HfExport:
    """Write CHECKPOINT_DIR's weights as a Hugging Face model folder OUTPUT (see the module docstring)."""
    from dstrain.tools.convert import convert_checkpoint

    source_dir = find_source(checkpoint_dir, source)
    with staging(output, dtype, force) as temp:
        consolidated = temp / "consolidated.safetensors"
        report = convert_checkpoint(checkpoint_dir, consolidated, tag=tag, dtype="fp32")
        export = write_folder(consolidated, source_dir, temp, dtype, max_shard_size)
        consolidated.unlink()
    export.folder, export.tag, export.notes = Path(output), report.tag, report.notes + export.notes
    return export


def folder_from_weights(weights: Path, source_dir: Path, output: Path, *, dtype: str = "fp32",
                        max_shard_size: str | int | None = None, force: bool = False) -> HfExport:
    """The same from a consolidated .safetensors (as convert-checkpoint writes it: the model's state_dict keys)."""
    with staging(output, dtype, force) as temp:
        export = write_folder(Path(weights), Path(source_dir), temp, dtype, max_shard_size)
    export.folder = Path(output)
    return export


@contextmanager
def staging(output: Path, dtype: str, force: bool) -> Iterator[Path]:
    """A temporary folder next to OUTPUT, renamed to OUTPUT when the block succeeds, removed in any case."""
    if dtype not in DTYPES:
        raise UserError.single(f"unknown dtype {dtype!r}", "--dtype", f"use one of: {', '.join(DTYPES)}")
    output = Path(output)
    if output.exists() and not (force and output.is_dir()):
        raise UserError.single("already exists", str(output), "choose another OUTPUT folder, or pass --force "
                               "to replace a folder" if output.is_dir() else "choose another OUTPUT folder")
    output.parent.mkdir(parents=True, exist_ok=True)
    temp = output.with_name(f".{output.name}.{secrets.token_hex(4)}.tmp")
    temp.mkdir()
    try:
        yield temp
        _replace(temp, output)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def write_folder(weights: Path, source_dir: Path, folder: Path, dtype: str,
                 max_shard_size: str | int | None) -> HfExport:
    """Fill FOLDER from the consolidated WEIGHTS and SOURCE_DIR's config, tokenizer and LoRA layers."""
    limit = parse_size(max_shard_size or DEFAULT_SHARD_SIZE)
    lora = json.loads((source_dir / HF_LORA).read_text()) if (source_dir / HF_LORA).is_file() else {}
    outs, merged, notes = _plan(weights, lora, DTYPES[dtype], source_dir)
    files = _write_shards(weights, outs, split_into_shards([o.tensor for o in outs], limit), folder)
    _copy_model_files(source_dir, folder, dtype)
    auto = auto_class_name(json.loads((source_dir / "config.json").read_text()))
    return HfExport(folder, files, len(outs), merged, dtype, weights.name, notes, auto)


def own_key(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def _plan(consolidated: Path, lora: dict[str, dict], dtype: torch.dtype,
          source_dir: Path) -> tuple[list[_Out], int, list[str]]:
    """The output tensors: model names, LoRA merged, tied copies dropped; checked against config.json's model.
    With them, how many base weights get an adapter merged (counted before fused experts are split)."""
    from safetensors import safe_open

    stored_dtypes = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    with safe_open(str(consolidated), framework="pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
        stored = {key: stored_dtypes[handle.get_slice(key).get_dtype()] for key in handle.keys()}
    by_name = {own_key(k): k for k in shapes}
    quantized = sorted(n for n in by_name if ".quant_state." in n or n.endswith((".absmax", ".quant_map")))
    if quantized:
        raise UserError.single(f"the checkpoint's base weights are 4-bit (bitsandbytes: {quantized[0]}, ...): "
                               "merging adapters into them would not give the trained model's weights",
                               "--format hf", "export the adapters alone with --format peft (train.export_final: "
                               "peft) and load them on the base model with peft")
    # adapters on parameters (target_parameters): peft nests one wrapper per parameter of a module, each one
    # base_layer deeper, so they are found by the module's plain name and the parameter's
    on_parameters = {(_unwrapped(module), layer["parameter"]): module
                     for module, layer in lora.items() if "parameter" in layer}
    outs = []
    for name, key in by_name.items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters: merged into their base weight below; a modules_to_save module's frozen original
        entry = None
        name = name.replace(".modules_to_save.default.", ".")  # modules_to_save: the trained copy is the weight
        module, _, leaf = name.rpartition(".base_layer.")
        if module and module in lora and "parameter" not in lora[module]:
            if leaf == "weight":
                entry = {"a": by_name[f"{module}.lora_A.default.weight"], "b": by_name[f"{module}.lora_B.default.weight"],
                         "magnitude": by_name.get(f"{module}.lora_magnitude_vector.default.weight"), **lora[module]}
            name = f"{module}.{leaf}"
        elif module and on_parameters:
            name = _unwrapped(name)
            owner, _, parameter = name.rpartition(".")
            wrapper = on_parameters.get((owner, parameter))
            if wrapper is not None:
                entry = {"a": by_name[f"{wrapper}.lora_A.default.weight"],
                         "b": by_name[f"{wrapper}.lora_B.default.weight"], **lora[wrapper]}
        out_dtype = dtype if stored[key].is_floating_point else stored[key]  # integer buffers keep theirs
        outs.append(_Out(Tensor(name, name, shapes[key], out_dtype, True), key, entry))
    merged = sum(1 for o in outs if o.lora)
    notes, model = _match_model(outs, source_dir)
    if model is not None:
        outs = _source_layout(outs, model, source_dir)
    return outs, merged, notes


def _unwrapped(name: str) -> str:
    """A name inside a peft model without its wrappers' base_layer levels."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name)


def _match_model(outs: list[_Out], source_dir: Path) -> list[str]:
    """Drop tied copies and check the names against the model config.json describes (built on the meta
    device), so from_pretrained finds every weight and no stray one."""
    try:
        import transformers
        config = transformers.AutoConfig.from_pretrained(source_dir)
        with torch.device("meta"):
            model = getattr(transformers, auto_class_name(config.to_dict())).from_config(config)
    except Exception as err:  # noqa: BLE001 - e.g. a remote-code model: export by name, unchecked
        return [f"names not checked against the model ({type(err).__name__}: {str(err).splitlines()[0]})"], None
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    tied = {name for names in aliases.values() for name in names[1:]}
    expected = set(model.state_dict().keys())
    have = {o.tensor.name for o in outs}
    outs[:] = [o for o in outs if not (o.tensor.name in tied and any(n in have for n in _aliases_of(o.tensor.name, aliases)))]
    names = {o.tensor.name for o in outs}
    unexpected = sorted(names - expected)
    missing = sorted(n for n in expected - names if n not in tied)
    if unexpected or missing:
        raise UserError.single(f"the checkpoint's weights do not fit {source_dir / 'config.json'}: "
                               f"missing {missing[:8]}, unexpected {unexpected[:8]}", str(source_dir),
                               "export with the hf_source/ of the run that saved this checkpoint (--hf-source)")
    return [], model


def _source_layout(outs: list[_Out], model, source_dir: Path) -> list[_Out]:
    """OUTS under the source checkpoint's names and layout: transformers' load-time conversions reversed
    (dstrain.models.conversion.export_groups), e.g. a fused experts.gate_up_proj [E, 2I, H] written as E
    experts' gate_proj and up_proj [I, H]. A converted group's outputs are computed when the first is written."""
    from dstrain.models.conversion import StoredTensor, export_groups
    keys_file = source_dir / HF_SOURCE_KEYS
    source_keys = json.loads(keys_file.read_text())["keys"] if keys_file.is_file() else None
    by_name = {o.tensor.name: o for o in outs}
    stored = [StoredTensor(o.tensor.name, o.tensor.shape, lambda: None, o.tensor.dtype) for o in outs]
    converted = []
    for group in export_groups(model, stored, source_keys):
        if group.transform is None:
            out = by_name[group.keys[0]]
            out.tensor.name = out.tensor.source = group.target
            converted.append(out)
            continue
        first = by_name[group.keys[0]]
        for name, shape in group.shapes(model).items():
            converted.append(_Out(Tensor(name, name, shape, first.tensor.dtype, True), first.base, group=group,
                                  model=model, sources=by_name))
    return converted


def _aliases_of(name: str, aliases: dict[int, list[str]]) -> list[str]:
    return next(([n for n in names if n != name] for names in aliases.values() if name in names), [])


def _full_value(handle, out: _Out) -> torch.Tensor:
    """A model tensor's whole value: its LoRA adapter merged where it has one."""
    return merged_weight(handle, out.base, out.lora) if out.lora else handle.get_tensor(out.base)


def _value_blocks(handle, out: _Out, converted: dict) -> Iterator[torch.Tensor]:
    """The output tensor's values, flat, in blocks of about BLOCK_ELEMENTS (merged and converted ones whole).
    CONVERTED keeps the outputs of the last converted group, which are written one after another."""
    if out.group is not None:
        if converted.get("group") is not out.group:
            converted.clear()
            converted.update(group=out.group, values=out.group.values(
                out.model, read=lambda stored: _full_value(handle, out.sources[stored.key])))
        yield converted["values"][out.tensor.name].reshape(-1)
        return
    if out.lora:
        yield merged_weight(handle, out.base, out.lora).reshape(-1)
        return
    shape = out.tensor.shape
    if len(shape) == 0:
        yield handle.get_tensor(out.base).reshape(-1)
        return
    row = max(1, out.tensor.numel // max(shape[0], 1))
    step = max(1, BLOCK_ELEMENTS // row)
    sliced = handle.get_slice(out.base)
    for start in range(0, shape[0], step):
        yield sliced[start:start + step].reshape(-1)


def merged_weight(handle, base_key: str, lora: dict) -> torch.Tensor:
    """W + scaling * B @ A, as peft's merge_and_unload computes it; with DoRA (a magnitude vector m) each
    output row of that sum is rescaled to m's length: m * (W + s B A) / ||W + s B A||, rows in (out, in)
    layout (transposed for fan_in_fan_out layers such as GPT-2's Conv1D)."""
    base = handle.get_tensor(base_key)
    if lora.get("experts", 1) > 1:
        return base + lora["scaling"] * expert_delta(handle.get_tensor(lora["a"]), handle.get_tensor(lora["b"]), lora)
    weight = base.T if lora["fan_in_fan_out"] else base
    weight = weight + lora["scaling"] * (handle.get_tensor(lora["b"]) @ handle.get_tensor(lora["a"]))
    if lora.get("magnitude"):
        norm = torch.linalg.norm(weight, dim=1)
        weight = (handle.get_tensor(lora["magnitude"]) / norm).unsqueeze(1) * weight
    return weight.T if lora["fan_in_fan_out"] else weight


def expert_delta(a: torch.Tensor, b: torch.Tensor, lora: dict) -> torch.Tensor:
    """The update of peft's adapter on E stacked experts (target_parameters): A [E * r, in] holds each expert's
    r rows in turn, B [out, r * E] its columns interleaved (rank-major); expert e's update is B_e @ A_e, laid
    out as the parameter is, (E, out, in) or (E, in, out)."""
    experts = lora["experts"]
    a = a.reshape(experts, -1, a.shape[-1])  # e r i
    b = b.reshape(b.shape[0], -1, experts)  # o r e
    return torch.einsum("ore,eri->eoi" if lora["out_in"] else "ore,eri->eio", b, a)


def _write_shards(consolidated: Path, outs: list[_Out], shards: list[list[Tensor]], folder: Path) -> list[str]:
    from safetensors import safe_open

    by_name = {o.tensor.name: o for o in outs}
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                                for i in range(1, len(shards) + 1)]
    converted: dict = {}
    with ExitStack() as stack:
        handle = stack.enter_context(safe_open(str(consolidated), framework="pt"))
        for shard, file_name in zip(shards, names):
            with open(folder / file_name, "wb") as file:
                file.write(safetensors_header(shard, {"format": "pt"}))
                for tensor in shard:
                    for block in _value_blocks(handle, by_name[tensor.name], converted):
                        file.write(block.to(tensor.dtype).contiguous().view(torch.uint8).numpy().tobytes())
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in (o.tensor for o in outs))},
                 "weight_map": {t.name: n for shard, n in zip(shards, names) for t in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _copy_model_files(source_dir: Path, folder: Path, dtype: str) -> None:
    """config.json with the export's dtype, and the generation config, tokenizer and code files as they are."""
    config = json.loads((source_dir / "config.json").read_text())
    config["dtype"] = HF_DTYPE_NAMES[dtype]
    if "torch_dtype" in config:
        config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source_dir.iterdir():
        if path.is_file() and (path.name in COPIED or path.suffix == ".py"):
            shutil.copyfile(path, folder / path.name)


def _replace(temp: Path, output: Path) -> None:
    """Move the finished folder into place; an existing OUTPUT (with --force) goes only after that works."""
    if output.exists():
        old = output.with_name(f".{output.name}.{secrets.token_hex(4)}.old")
        output.rename(old)
        temp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        temp.rename(output)

