"""`dstrain generate`: a quick look at a trained model, a completion printed by transformers' own `generate`.

What it loads (`find_model`): a Hugging Face model folder (config.json and weights: `final_hf`, or what
`convert-checkpoint --format hf` wrote), a peft adapter folder (adapter_config.json: its base model,
named there, with the adapters on top), or a run directory: its newest export (final_hf or
final_adapter) unless a checkpoint was saved after it, else the latest complete checkpoint converted
into a temporary folder (merged, as `--format hf`; adapters alone for a 4-bit QLoRA base), removed at the end.

Greedy decoding unless --temperature is above 0 (then sampling, with --top-p). `--chat` renders the
turns with the tokenizer's chat template: one turn with --prompt, else turns read from stdin until an
empty line or end of input. On CUDA when a GPU is there (the folder's dtype), else on CPU in fp32.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from dstrain.console_text import outside
from dstrain.errors import UserError
from dstrain.rundir import CHECKPOINTS, CONFIG, HF_SOURCE

ADAPTER_CONFIG = "adapter_config.json"  # as peft names it (also dstrain.tools.convert.peft_folder's)
EXPORTS = ("final_hf", "final_adapter")  # train.export_final's folders: hf, peft


@dataclass
class Found:
    """The folder to load (a model, or an adapter folder on its base), and what to say about it."""

    folder: Path
    adapter: bool
    note: str
    temporary: Path | None = None  # a conversion to remove afterwards


def find_model(target: Path) -> Found:
    """What `dstrain generate TARGET` loads (see the module docstring)."""
    target = Path(target)
    if not target.is_dir():
        raise UserError.single("not a folder", str(target), "give a model folder (config.json and weights), a peft "
                               "adapter folder (adapter_config.json) or a run directory of `dstrain run`")
    if (target / ADAPTER_CONFIG).is_file():
        return Found(target, True, f"adapters {target} on their base model")
    if (target / "config.json").is_file():
        return Found(target, False, f"model {target}")
    if (target / CONFIG).is_file() or (target / CHECKPOINTS).is_dir():
        return _from_run(target)
    raise UserError.single("holds no config.json, adapter_config.json or run files", str(target),
                           "give a model folder, an adapter folder or a run directory of `dstrain run`")


def _from_run(run_dir: Path) -> Found:
    """A run directory: the newest export, or the latest checkpoint converted when it is newer."""
    from dstrain.checkpoints import complete_checkpoints
    saved = complete_checkpoints(run_dir / CHECKPOINTS)
    newest_save = saved[-1].path.stat().st_mtime if saved else 0.0
    exports = sorted((p for p in (run_dir / name for name in EXPORTS) if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if exports and exports[-1].stat().st_mtime >= newest_save:
        found = find_model(exports[-1])
        found.note += f" (the newest export of {run_dir})"
        return found
    if not saved:
        raise UserError.single("no export (final_hf, final_adapter) and no complete checkpoint", str(run_dir),
                               "let the run save a checkpoint, or give an exported folder")
    if not (run_dir / HF_SOURCE / "config.json").is_file():
        raise UserError.single(f"not a run of an \"hf:\" model (no {HF_SOURCE}/config.json)", str(run_dir),
                               "generate works on Hugging Face models: train one with model.name: hf:<folder>")
    checkpoint = saved[-1]
    temporary = Path(tempfile.mkdtemp(prefix="dstrain-generate-"))
    out = temporary / "model"
    try:
        if _quantized(run_dir):  # a 4-bit base is not merged: the adapters go on the base model
            from dstrain.tools.convert.peft_folder import export_peft_folder
            export_peft_folder(run_dir / CHECKPOINTS, out, tag=checkpoint.tag)
        else:
            from dstrain.tools.convert.hf_folder import export_hf_folder
            export_hf_folder(run_dir / CHECKPOINTS, out, tag=checkpoint.tag)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    found = find_model(out)
    found.note = f"checkpoint {checkpoint.tag} of {run_dir} (converted for this command, newer than any export)"
    found.temporary = temporary
    return found


def _quantized(run_dir: Path) -> bool:
    import yaml
    config = yaml.safe_load((run_dir / CONFIG).read_text()) if (run_dir / CONFIG).is_file() else {}
    return bool(((config.get("model") or {}).get("lora") or {}).get("quantize"))


def load(found: Found, device: str):
    """(model, tokenizer) with transformers (and peft for an adapter folder), in eval mode on DEVICE."""
    from dstrain.errors import require_package
    transformers = require_package("transformers", "dstrain generate", "hf")
    import torch
    transformers.utils.logging.disable_progress_bar()  # a loading bar says nothing before one completion
    dtype = "auto" if device == "cuda" else torch.float32
    folder = found.folder
    base = folder
    if found.adapter:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise UserError.single("names no base model (base_model_name_or_path)", str(folder / ADAPTER_CONFIG),
                                   "write the base model's folder or hub id there")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
        if found.adapter:
            peft = require_package("peft", "dstrain generate", "hf")
            model = peft.PeftModel.from_pretrained(model, str(folder))
    except (OSError, ValueError) as err:
        raise UserError.single(f"transformers cannot load it: {str(err).strip().splitlines()[0]}", str(folder),
                               "give a folder written by save_pretrained, convert-checkpoint --format hf/peft "
                               "or train.export_final") from None
    tokenizer = _tokenizer(transformers, folder, base)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise UserError.single(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows}",
                               str(folder), "put the tokenizer the model was trained with into the folder")
    return model.eval(), tokenizer


def _tokenizer(transformers, folder: Path, base):
    from dstrain.models.hf import TOKENIZER_FILES
    for candidate in dict.fromkeys([str(folder), str(base)]):
        if Path(candidate).is_dir() and not any((Path(candidate) / name).is_file() for name in TOKENIZER_FILES):
            continue  # transformers would build an empty tokenizer from config.json's model type alone
        try:
            return transformers.AutoTokenizer.from_pretrained(candidate)
        except (OSError, ValueError, TypeError):
            continue
    raise UserError.single("no tokenizer files (tokenizer.json, ...) here or in the base model", str(folder),
                           "copy the model's tokenizer files into the folder (save_pretrained of its tokenizer)")


def complete(model, tokenizer, input_ids, max_new_tokens: int, temperature: float, top_p: float) -> str:
    """The text transformers' generate continues INPUT_IDS with (special tokens left out)."""
    import torch
    if input_ids.shape[1] == 0:
        raise UserError.single("the prompt encodes to no tokens", "--prompt", "give a prompt with some text")
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=torch.ones_like(input_ids).to(model.device),
                             max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def chat_ids(tokenizer, messages: list[dict]):
    """The conversation rendered by the tokenizer's chat template, ready for the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError.single("the tokenizer has no chat template", "--chat",
                               "leave out --chat (plain completion of --prompt), or add a chat_template to the "
                               "model folder's tokenizer_config.json (or chat_template.jinja)")
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)
    return rendered["input_ids"]


def generate(target: Path, prompt: str | None, chat: bool, max_new_tokens: int, temperature: float,
             top_p: float) -> int:
    """`dstrain generate`: prints the completion(s) on stdout, what was loaded on stderr."""
    if prompt is None and not chat:
        raise UserError.single("nothing to complete", "--prompt", "give --prompt TEXT, or --chat for turns from stdin")
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise UserError.single("out of range", "--max-new-tokens / --temperature / --top-p",
                               "--max-new-tokens >= 1, --temperature >= 0 (0: greedy), 0 < --top-p <= 1")
    err = Console(stderr=True, highlight=False)
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Converting a checkpoint imports DeepSpeed, whose accelerator guess would print a warning on stdout.
    os.environ.setdefault("DS_ACCELERATOR", device)
    found = find_model(target)
    try:
        model, tokenizer = load(found, device)
        err.print(f"[dim]{outside(found.note)}, on {device}[/]", soft_wrap=True)  # names the user's folder
        if not chat:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            print(complete(model, tokenizer, ids, max_new_tokens, temperature, top_p), flush=True)
            return 0
        messages: list[dict] = []
        turns = [prompt] if prompt is not None else _stdin_turns(err)
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            answer = complete(model, tokenizer, chat_ids(tokenizer, messages), max_new_tokens, temperature, top_p)
            messages.append({"role": "assistant", "content": answer})
            print(answer, flush=True)
        return 0
    finally:
        if found.temporary is not None:
            shutil.rmtree(found.temporary, ignore_errors=True)


def _stdin_turns(err: Console):
    """User turns, one line each, until an empty line or end of input."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            err.print("[bold]you>[/] ", end="")
        line = sys.stdin.readline()
        if not line.strip():
            return
        yield line.rstrip("\n")
