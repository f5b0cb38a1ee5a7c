"""Which models keep packed examples apart, and so whether data.packing is on: `decide_packing`,
called by `dstrain run` before any rank starts (its answer is written into the run's frozen config,
which the ranks obey) and by `dstrain data preview`.

A packed row holds several examples, each with position ids restarting at 0 and no attention
across them. The built-in GPT builds that mask itself (dstrain.models.gpt.document_mask). An "hf:"
model does when transformers derives the mask from the position ids: in transformers 5, the
modeling code passes position_ids to masking_utils.create_causal_mask (or its sliding-window and
chunked siblings), which, with no attention_mask and no cache, finds the examples
(find_packed_sequence_indices) and masks across them for eager, sdpa and flex attention; the flash
attention kernels take the examples' lengths from the position ids (varlen) for a batch of one row,
which dstrain.models.hf.CausalLM arranges. Models whose code builds its mask otherwise (older or
remote-code modeling files) would attend across examples, so they train with padding instead.
Verified on Llama, Qwen2 and GPT-2 (transformers 5.24, eager and sdpa: tests/test_packing.py); other
families are judged by their modeling file, read as text (nothing imported: no torch here).
"""

from __future__ import annotations

import importlib.util
import re

from dstrain.config.schema import RunConfig
from dstrain.errors import UserError

# attn_implementation values whose masks transformers builds from the position ids of packed rows
PACKING_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
ALIAS = re.compile(r"(\w+) = create_(?:sliding_window_|chunked_)?causal_mask\b")
CALL_SPAN = 600  # characters after the call's name in which its position_ids argument must appear


def hf_packing_problem(hf_config, attn_implementation: str | None) -> str | None:
    """Why this Hugging Face model cannot keep packed examples apart, or None when it can."""
    if getattr(hf_config, "auto_map", None):
        return "its modeling code is the model's own (trust_remote_code), which dstrain cannot check"
    attention = attn_implementation or getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in PACKING_ATTENTION:
        return (f"attn_implementation {attention!r} is not one whose masks transformers builds from position "
                f"ids ({', '.join(PACKING_ATTENTION)})")
    model_type = str(getattr(hf_config, "model_type", ""))
    spec = None
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
    except (ImportError, ValueError, AttributeError):
        pass
    if spec is None or spec.origin is None:
        return f"transformers has no modeling file for model_type {model_type!r} to check"
    with open(spec.origin, encoding="utf-8") as handle:
        code = handle.read()
    # The helpers are called by name, or through a variable chosen between them (Mistral's mask_function).
    names = ["create_(?:sliding_window_|chunked_)?causal_mask", *ALIAS.findall(code)]
    call = re.compile(rf"\b(?:{'|'.join(names)})\(")
    calls = [code[m.end():m.end() + CALL_SPAN] for m in call.finditer(code)]
    # position_ids passed by name, or in the shared keyword dict (`**mask_kwargs`) that holds them
    passed = [("position_ids" in span.split(")", 1)[0] or span.split(")", 1)[0].lstrip().startswith("**"))
              for span in calls]
    if not calls or not all(passed) or ("**" in code and '"position_ids": position_ids' not in code
                                        and "position_ids=position_ids" not in code):
        return (f"transformers' {model_type} code does not build its attention mask from position ids, so "
                "packed examples would attend to each other")
    return None


def decide_packing(config: RunConfig) -> tuple[bool, str | None]:
    """Whether examples are packed several to a row, and the note that says why not when "auto" falls
    back to padding. data.packing true on a model that cannot keep examples apart is an error naming
    the reason. Token streams ("text" format, token sources) are windows of a stream: never packed
    examples."""
    from dstrain.data.records import ROW_SOURCES
    data = config.data
    if data.packing is False or data.format == "text" or data.source not in ROW_SOURCES:
        return False, None
    if config.train.sequence_parallel > 1:  # data.packing true is refused in resolution
        return False, "data.packing auto: one padded example per row, since train.sequence_parallel is on"
    problem = model_packing_problem(config)
    if problem is None:
        return True, None
    if data.packing is True and _is_hf_or_builtin(config):
        raise UserError.single(f"data.packing is true, but model {config.model.name!r} cannot keep packed examples "
                               f"apart: {problem}", "data.packing",
                               "set data.packing: auto (or false) to train with one padded example per row")
    if data.packing is True:  # a user's model: its forward must honour position_ids (docs/data.md)
        return True, None
    return False, f"data.packing auto: one padded example per row, since {problem}"


def _is_hf_or_builtin(config: RunConfig) -> bool:
    from dstrain.data import HF_PREFIX
    return config.model.name == "gpt" or config.model.name.startswith(HF_PREFIX)


def model_packing_problem(config: RunConfig) -> str | None:
    """Why the configured model cannot keep packed examples apart, or None."""
    from dstrain.data import HF_PREFIX
    name = config.model.name
    if name == "gpt":
        return None  # dstrain.models.gpt.document_mask
    if not name.startswith(HF_PREFIX):
        return (f"model {name!r} is an entry point, whose forward dstrain cannot check for position_ids "
                "(set data.packing: true once it keeps examples apart by them)")
    from dstrain.models.hf import load_config
    problem = hf_packing_problem(load_config(config), config.model.kwargs.get("attn_implementation"))
    return None if problem is None else f"model {name!r}: {problem}"
