"""Pretrained Hugging Face causal LMs: `model.name: "hf:<local directory or hub id>"`; with train.objective
reward the same folder as AutoModelForSequenceClassification with one label (a reward model: the score head
new, the LM head unused, see REWARD_NEW_KEYS).

Owns: reading the model's config.json through transformers' Auto classes (with the model.kwargs
options), building the model (stage 3: inside deepspeed.zero.Init, weights copied into the partitions
one tensor at a time by dstrain.models.weights, so no rank holds the whole model, through transformers'
own load-time conversions (dstrain.models.conversion: e.g. a MoE layer's per-expert tensors fused); stages 0-2:
transformers' own from_pretrained; with model.lora.quantize the base in 4 bits through bitsandbytes),
LoRA adapters through peft (model.lora's options and their checks), the `CausalLM` wrapper whose
forward(batch) returns the loss (dstrain's model protocol; a MoE router's balancing loss in it as transformers
adds it, dstrain.models.moe), the checks `--dry-run` makes (config.json
present, architecture known, tokenizer fits the embedding, QLoRA's hardware), and the copy of
config/tokenizer files (and peft's adapter_config.json) into the run directory that `convert-checkpoint
--format hf / peft` reads.

transformers and peft are optional (the `hf` extra): without them a clear UserError says so.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dstrain.config.schema import PEFT_ARGUMENTS, LoraConfig, RunConfig
from dstrain.models import preference_loss
from dstrain.models.preference import LogpsHead, LogpsRequest
from dstrain.rundir import HF_SOURCE, HF_SOURCE_KEYS
from dstrain.errors import UserError, require_package

PREFIX = "hf:"
WRAPPER_PREFIX = "model."  # CausalLM keeps the Hugging Face model as `self.model`
PEFT_PREFIX = "base_model.model."  # peft's PeftModel -> LoraModel -> the Hugging Face model
# Passed to the model's construction; every other model.kwargs key goes to its config.
MODEL_KWARGS = ("dtype", "attn_implementation")
LOAD_KWARGS = ("trust_remote_code", "revision")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.txt",
                   "spiece.model")


def is_hf(name: str) -> bool:
    return name.startswith(PREFIX)


def is_reward(config: RunConfig) -> bool:
    """train.objective reward: the model is a sequence classifier with one label (a scalar score head)."""
    return config.train.objective == "reward"


def auto_class(config: RunConfig):
    """transformers' Auto class the run builds: AutoModelForSequenceClassification for a reward model,
    AutoModelForCausalLM otherwise."""
    transformers = require("transformers", where(config))
    return (transformers.AutoModelForSequenceClassification if is_reward(config)
            else transformers.AutoModelForCausalLM)


# A reward model built from a causal LM's weights: its score head is new (initialised as transformers does)
# and the LM head is not used; every other key must match.
REWARD_NEW_KEYS = (r"^score\.",)
REWARD_DROPPED_KEYS = (r"^lm_head\.",)


def source_of(config: RunConfig) -> str:
    return config.model.name[len(PREFIX):]


def where(config: RunConfig) -> str:
    return f"model.name: {config.model.name}"


def require(package: str, key: str):
    """Import transformers or peft, or a UserError saying how to install them."""
    return require_package(package, key, "hf")


class CausalLM(nn.Module):
    """A Hugging Face causal LM under dstrain's protocol: forward(batch) returns the mean LM loss.

    A batch is (inputs, targets) with targets already shifted by one (dstrain's samplers) and -100
    where no loss is taken, or a dict of the model's own keyword arguments (input_ids, attention_mask,
    labels in Hugging Face's unshifted convention; position_ids for packed examples, see
    dstrain.models.packing), whose `loss` is returned.

    With train.loss_chunking (`chunking` True, or "auto" with a vocabulary of at least
    LOSS_CHUNKING_MIN_VOCAB) and a forward dstrain can split (`split_problem`), the decoder body runs
    alone and its last hidden states go through `lm_loss` (dstrain.models.chunked_loss.LMHeadLoss):
    the same loss as transformers' (mean over the shifted labels that are not -100), never the whole
    logits. Otherwise the model's own forward runs, and `loss_note` says why where chunking was asked.
    """

    def __init__(self, model: nn.Module, chunking: bool | str = False, chunk_tokens: int = 1024):
        super().__init__()
        self.model = model
        self.sequence_group = None
        """The sequence-parallel process group (train.sequence_parallel > 1; set by the rank): batches then
        hold this rank's share of each sample (dstrain.data.sequence.shard) and the loss is the group's."""
        self.sequence_grad_scale = 1.0
        """What this rank's share of the gradient is multiplied by, so that DeepSpeed's reduction makes the
        whole samples' gradient (dstrain.rank.sequence_parallel.gradient_scale)."""
        self.lm_loss: nn.Module | None = None
        self.loss_note: str | None = None
        self.loss_why = "train.loss_chunking=false"  # why the loss is chunked or not, for the plan's sources
        self._body: tuple[nn.Module, ...] = ()  # the decoder body, held outside the module tree
        self.logps_head: nn.Module | None = None  # preference objectives (dstrain.models.preference.attach)
        self._logps_body: tuple[nn.Module, ...] = ()
        self.preference = None
        from dstrain.models.moe import RouterStats
        router = RouterStats(_unwrapped(model))
        self.router_stats = router if router else None
        """A mixture-of-experts model's balancing loss and experts' load since the last log line (else None)."""
        if chunking is False:
            return
        from dstrain.config.schema import LOSS_CHUNKING_MIN_VOCAB
        from dstrain.models.chunked_loss import LMHeadLoss
        problem = split_problem(model)
        if problem is not None:
            self.loss_why = f"{_architecture(model)}: {problem}"
            self.loss_note = f"train.loss_chunking: {self.loss_why}; its own loss runs (whole logits)"
            return
        inner = _unwrapped(model)
        head = inner.get_output_embeddings()
        vocab = head.out_features
        if chunking == "auto" and vocab < LOSS_CHUNKING_MIN_VOCAB:
            self.loss_why = f"vocabulary {vocab:,} < {LOSS_CHUNKING_MIN_VOCAB:,}: small logits"
            return
        self.loss_why = (f"vocabulary {vocab:,} >= {LOSS_CHUNKING_MIN_VOCAB:,}" if chunking == "auto" else
                         "train.loss_chunking=true") + f", {_architecture(model)} splits into body and head"
        self._body = (getattr(inner, inner.base_model_prefix),)
        self.lm_loss = LMHeadLoss(head, chunk_tokens)

    def forward(self, batch) -> torch.Tensor:
        if isinstance(batch, LogpsRequest):  # a preference reference copy: per-token log-probs
            return self.token_logps(*batch)
        if self.preference is not None and isinstance(batch, dict) and "example_ids" in batch:
            return self.preference(self, batch)
        if self.sequence_group is not None:
            return self._sequence_parallel_loss(batch)
        if isinstance(batch, dict):
            attention = getattr(self.model.config, "_attn_implementation", None) or ""
            if "position_ids" in batch and attention.startswith("flash"):
                # transformers' flash path finds packed examples in the position ids only for a
                # batch of one row; every row starts an example (label -100), so rows join end to end.
                batch = {key: value.reshape(1, -1) for key, value in batch.items()}
            if self.lm_loss is not None:
                inputs = {key: value for key, value in batch.items() if key != "labels"}
                # transformers' shift: position t predicts label t + 1, the last position nothing
                return self._chunked_loss(inputs, F.pad(batch["labels"][:, 1:], (0, 1), value=-100))
            # No cache: transformers looks for packed examples in the position ids only without one.
            out = self.model(**batch, use_cache=False)
            if self.router_stats is not None:  # transformers' loss holds the balancing loss where it counts
                self.router_stats.add_losses(out.loss, getattr(out, "aux_loss", None), self.training)
            return out.loss
        inputs, targets = batch
        if self.lm_loss is not None:
            return self._chunked_loss({"input_ids": inputs}, targets)
        out = self.model(input_ids=inputs, use_cache=False)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        if self.router_stats is not None:
            aux = getattr(out, "aux_loss", None)
            if aux is not None and self.router_stats.coef is not None:  # as transformers adds it to its loss
                loss = loss + self.router_stats.coef * aux.to(loss.device)
            self.router_stats.add_losses(loss, aux, self.training)
        return loss

    def enable_logps(self, chunk: int) -> None:
        """Preference objectives: per-token log-probs from the decoder body's hidden states through a
        LogpsHead (`chunk` tokens at a time), where the model's forward splits into body and head
        (split_problem); otherwise from the model's own logits."""
        if split_problem(self.model) is None:
            inner = _unwrapped(self.model)
            self._logps_body = (getattr(inner, inner.base_model_prefix),)
            self.logps_head = LogpsHead(inner.get_output_embeddings(), chunk)
        self.logps_chunk = chunk

    def token_logps(self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) per position [rows, T] (0 where the target is -100): rows of packed examples told
        apart by their position ids, as packed SFT rows (dstrain.models.packing)."""
        shape = input_ids.shape
        attention = getattr(self.model.config, "_attn_implementation", None) or ""
        if attention.startswith("flash"):  # the flash path finds packed examples in one row only
            input_ids, position_ids, targets = (t.reshape(1, -1) for t in (input_ids, position_ids, targets))
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
        if self.logps_head is not None:
            logps = self.logps_head(self._logps_body[0](**inputs)[0], targets)
        else:
            logps = preference_loss.token_logps(self.model(**inputs).logits, targets, self.logps_chunk)
        return logps.reshape(shape)

    def scores(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """A reward model's score at every position [rows, T], fp32: the decoder body's hidden states through
        the score head (rows of packed examples told apart by their position ids, as token_logps). The
        model's own forward would keep only each row's last score."""
        inner = _unwrapped(self.model)
        if not hasattr(inner, "score"):
            raise RuntimeError(f"{type(inner).__name__} has no score head: train.objective reward builds "
                               "AutoModelForSequenceClassification")
        shape = input_ids.shape
        attention = getattr(self.model.config, "_attn_implementation", None) or ""
        if attention.startswith("flash"):  # the flash path finds packed examples in one row only
            input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
        body = getattr(inner, inner.base_model_prefix)
        hidden = body(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
        return inner.score(hidden).squeeze(-1).float().reshape(shape)

    def adapters_disabled(self):
        """The context in which the model is its base model (peft's disable_adapter): the reference of
        preference.reference adapters_off."""
        if not hasattr(self.model, "disable_adapter"):
            raise UserError.single("preference.reference adapters_off needs LoRA adapters (model.lora)",
                                   "preference.reference", "set model.lora, or preference.reference: model")
        return self.model.disable_adapter()

    def _chunked_loss(self, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
        hidden = self._body[0](**inputs, use_cache=False)[0]  # the last hidden state, after the final norm
        return self.lm_loss(hidden, targets)

    def _sequence_parallel_loss(self, batch: dict) -> torch.Tensor:
        """The mean loss over the loss-taking tokens of the whole samples, each counted once, from this rank's
        share of their tokens: the same value as without sequence parallelism. Its gradient is this rank's
        tokens' part (times sequence_grad_scale): DeepSpeed adds up the ranks' gradients."""
        import torch.distributed as dist
        labels = batch["shift_labels"]
        inputs = {key: value for key, value in batch.items() if key != "shift_labels"}
        if self.lm_loss is not None:  # train.loss_chunking: this rank's share of the logits, chunk by chunk
            local = self.lm_loss(self._body[0](**inputs, use_cache=False)[0], labels, reduction="sum")
        else:
            logits = self.model(**inputs, use_cache=False).logits
            local = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        totals = torch.stack([local.detach(), (labels != -100).sum().to(local.dtype)])
        dist.all_reduce(totals, group=self.sequence_group)
        group_sum, tokens = totals[0], totals[1]
        mine = local * self.sequence_grad_scale
        return (mine + (group_sum - mine.detach())) / tokens  # the group's value, this rank's gradient

    def enable_checkpointing(self, _checkpoint_fn: Callable) -> None:
        """Activation checkpointing through transformers' own per-layer mechanism."""
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside peft's wrapper (its LoRA layers in place), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _architecture(model: nn.Module) -> str:
    return type(_unwrapped(model)).__name__


def _code(fn) -> str:
    """A function's source without comments and whitespace, for matching its statements."""
    import inspect
    import re
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", source))


def split_problem(model: nn.Module) -> str | None:
    """Why dstrain cannot compute this model's loss as its decoder body + chunked head, or None.

    The model's forward must be transformers' plain causal-LM form, read from its code: the body
    (`self.<base_model_prefix>(...)`), its last hidden state, `logits = self.lm_head(hidden_states)`,
    then at once `self.loss_function(...)` (the standard ForCausalLMLoss) and return: no logit soft-capping
    or scaling (Gemma 2, Cohere, Granite), no auxiliary loss (mixture-of-experts models), a head that is
    a plain nn.Linear (not a LoRA layer or peft's modules_to_save copy)."""
    import re
    inner = _unwrapped(model)
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if get_head else None
    if type(head) is not nn.Linear:
        return (f"its output layer is {type(head).__name__ if head is not None else 'not known'}, not a plain "
                "Linear (a LoRA target or modules_to_save?)")
    prefix = getattr(inner, "base_model_prefix", "")
    body = getattr(inner, prefix, None) if prefix else None
    if not isinstance(body, nn.Module) or body is inner:
        return "it has no decoder body to call alone (base_model_prefix)"
    code = _code(type(inner).forward)
    head_name = next((name for name, module in inner.named_children() if module is head), None)
    call = rf"(\w+)(?::\w+)?=self\.{re.escape(prefix)}\("
    # transformers 5.2x slices with slice_logits_to_keep(...); 5.1x with slice_indices in the head's call
    plain = (rf"hidden_states=(\w+)(?:\.last_hidden_state|\[0\])(?:hidden_states=slice_logits_to_keep\([^)]*\))?"
             r"(?:slice_indices=slice\(-logits_to_keep,None\)ifisinstance\(logits_to_keep,int\)elselogits_to_keep)?"
             rf"logits=self\.{re.escape(head_name or '-')}\(hidden_states(?:\[:,slice_indices,:\])?\)"
             r"loss=NoneiflabelsisnotNone:loss=self\.loss_function\((?:[^()]|\([^()]*\))*\)return")
    found_call, found_plain = re.search(call, code), re.search(plain, code)
    if not found_call or not found_plain or found_call.group(1) != found_plain.group(1):
        return "its forward does more than body -> head -> transformers' loss (logit scaling or an extra loss?)"
    loss_name = getattr(getattr(inner, "loss_function", None), "__name__", "")
    if loss_name != "ForCausalLMLoss":
        return f"its loss function is {loss_name or 'unknown'}, not transformers' ForCausalLMLoss"

def sequence_parallel_problem(hf_config, sp: int) -> str | None:
    """Why DeepSpeed's Ulysses attention cannot split this model's heads over `sp` ranks, or None: each rank
    takes heads / sp query heads, and the key-value heads must divide among the ranks or be copied to them."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads is None:
        return "its config names no num_attention_heads"
    if heads % sp:
        return f"its {heads} attention heads are not divisible by {sp}"
    if kv_heads % sp and sp % kv_heads:
        return f"its {kv_heads} key-value heads neither divide by {sp} nor divide {sp}"
    return None


def flops_per_token(model: CausalLM, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token, as for the built-in GPT: 6 x the parameters used in matrix products
    (the input embedding is a lookup; a tied output head is a product) + 12 x layers x width x sequence
    for attention. Frozen weights (LoRA) are counted as trained: an upper bound of the work done. A
    mixture-of-experts model counts its active parameters: each token runs top-k of each layer's experts."""
    from dstrain.models.moe import inactive_parameters
    n_params -= inactive_parameters(_unwrapped(model.model))
    config = model.model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    embedding = model.model.get_input_embeddings().weight
    lookup = 0 if getattr(config, "tie_word_embeddings", False) else getattr(embedding, "ds_numel", embedding.numel())
    return 6.0 * (n_params - lookup) + 12.0 * layers * width * seq_len


def own_name(name: str) -> str:
    """A parameter's name inside the Hugging Face model (dstrain's and peft's wrappers removed)."""
    return name.removeprefix(WRAPPER_PREFIX).removeprefix(PEFT_PREFIX)


# ------------------------------------------------------------------ config


def _split_kwargs(config: RunConfig) -> tuple[dict, dict, dict]:
    """model.kwargs as (construction kwargs, loading kwargs, config overrides)."""
    kwargs = dict(config.model.kwargs)
    dtype = kwargs.pop("dtype", "float32")
    if dtype != "auto" and dtype not in DTYPES:
        raise UserError.single(f"unknown dtype {dtype!r}", "model.kwargs.dtype",
                               "use float32, bfloat16, float16 or auto (the dtype config.json names)")
    build = {"dtype": dtype if dtype == "auto" else DTYPES[dtype]}
    if "attn_implementation" in kwargs:
        build["attn_implementation"] = kwargs.pop("attn_implementation")
    load = {"trust_remote_code": bool(kwargs.pop("trust_remote_code", False))}
    if "revision" in kwargs:
        load["revision"] = kwargs.pop("revision")
    return build, load, kwargs


def load_config(config: RunConfig):
    """The model's transformers config (config.json), with model.kwargs overrides applied."""
    transformers = require("transformers", where(config))
    source = source_of(config)
    _, load, overrides = _split_kwargs(config)
    local = Path(source)
    if local.is_dir() and not (local / "config.json").is_file():
        raise UserError.single(f"{local} has no config.json", where(config),
                               "name a directory written by save_pretrained (config.json and *.safetensors)")
    if not local.is_dir() and (source.startswith((".", "/", "~")) or local.exists()):
        raise UserError.single(f"{source} is not a directory", where(config),
                               "name a local model directory or a Hugging Face hub id such as 'gpt2'")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(source, **load)
    except Exception as err:  # noqa: BLE001 - a config that does not load is the user's input
        raise UserError.single(f"transformers cannot read the model's config: {type(err).__name__}: "
                               f"{str(err).splitlines()[0]}", f"{_config_file(source)}: model_type",
                               "use a model type this transformers version knows (upgrade transformers), "
                               "or set model.kwargs.trust_remote_code=true for a model with its own code") from None
    unknown = [key for key in overrides if not hasattr(hf_config, key)]
    if unknown:
        raise UserError.single(f"{', '.join(unknown)}: not an option dstrain knows nor a key of config.json",
                               "model.kwargs", f"use dtype, attn_implementation, trust_remote_code, revision or "
                               f"a key of {_config_file(source)}")
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    if is_reward(config):
        _as_reward_config(config, hf_config)
    return hf_config


def _as_reward_config(config: RunConfig, hf_config) -> None:
    """A reward model's config: one label (the scalar score), its architecture the sequence classifier, and
    pad_token_id set (from the tokenizer: its pad token, else its eos), as transformers' sequence classifiers
    need it to find a row's last token and TRL sets it."""
    hf_config.num_labels = 1
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch and arch.endswith("ForCausalLM"):
        hf_config.architectures = [arch[:-len("ForCausalLM")] + "ForSequenceClassification"]
    if getattr(hf_config, "pad_token_id", None) is None:
        hf_config.pad_token_id = _tokenizer_pad_id(config, hf_config)


def _tokenizer_pad_id(config: RunConfig, hf_config) -> int | None:
    from dstrain.data import data_config
    name = data_config(config).tokenizer or source_of(config)
    if name == "byte":
        return getattr(hf_config, "eos_token_id", None)
    try:
        from dstrain.data.sources import load_tokenizer
        tokenizer = load_tokenizer(name)
    except Exception:  # noqa: BLE001 - no tokenizer to read: the model's eos, as below
        return getattr(hf_config, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if pad is not None else getattr(tokenizer, "eos_token_id", getattr(hf_config, "eos_token_id", None))


def _config_file(source: str) -> str:
    return str(Path(source) / "config.json") if Path(source).is_dir() else f"{source} (hub): config.json"


def _from_config(config: RunConfig, hf_config, attention: str | None = None) -> nn.Module:
    transformers = require("transformers", where(config))
    build, load, _ = _split_kwargs(config)
    if attention:
        build["attn_implementation"] = attention
    if build["dtype"] == "auto":
        build["dtype"] = getattr(hf_config, "dtype", None) or torch.float32
    try:
        return auto_class(config).from_config(hf_config, trust_remote_code=load["trust_remote_code"], **build)
    except ValueError as err:
        raise UserError.single(f"not a causal language model transformers can build: {str(err).splitlines()[0]}",
                               f"{_config_file(source_of(config))}: architectures",
                               "name a causal LM (Llama, Qwen, Mistral, GPT-2, ...) in model.name") from None


# ------------------------------------------------------------------ building


def _block_names(model: nn.Module) -> set[str]:
    """The class names transformers never splits across devices (`_no_split_modules`, e.g. LlamaDecoderLayer)."""
    return {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}


def block_class(model: nn.Module) -> str | None:
    """The qualified class name of the model's repeated block: the module transformers never splits
    across devices (`_no_split_modules`, e.g. LlamaDecoderLayer); None when the model names none."""
    names = _block_names(model)
    block = next((type(m) for m in model.modules() if type(m).__name__ in names), None)
    return f"{block.__module__}.{block.__qualname__}" if block else None


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, in order: the modules of its `_no_split_modules` classes that sit in
    a ModuleList (`model.layers`, `transformer.h`); a LoRA-wrapped model's too (peft keeps the classes).
    Empty when the model names no such class. What regional compilation compiles one by one."""
    names = _block_names(model)
    return [child for m in model.modules() if isinstance(m, nn.ModuleList)
            for child in m if type(child).__name__ in names]


def skeleton_builder(config: RunConfig) -> Callable[[], nn.Module]:
    """Builds the model with random weights (and its adapters): for counting on the meta device."""
    hf_config = load_config(config)
    return lambda: _wrap(config, _from_config(config, hf_config))


def _wrap(config: RunConfig, model: nn.Module) -> "CausalLM":
    """dstrain's wrapper around the built model and its adapters; a reward model's loss is no LM loss, so
    no chunked LM head."""
    chunking = False if is_reward(config) else config.train.loss_chunking
    return CausalLM(apply_lora(model, config.model.lora, reward=is_reward(config)), chunking,
                    config.train.loss_chunk_tokens)


def build_pretrained(config: RunConfig, ds_config: dict, device: torch.device) -> CausalLM:
    """The model with its pretrained weights, where it will train (see the module docstring)."""
    hf_config = load_config(config)
    attention = auto_attention(config, hf_config, device)
    if (ds_config.get("zero_optimization") or {}).get("stage", 0) == 3:
        model = _build_zero3(config, ds_config, hf_config, attention)
    else:
        transformers = require("transformers", where(config))
        transformers.utils.logging.disable_progress_bar()  # one bar per rank says nothing
        build, load, _ = _split_kwargs(config)
        if attention:
            build["attn_implementation"] = attention
        quantized = config.model.lora is not None and config.model.lora.quantize is not None
        if quantized:  # bitsandbytes quantizes while loading, onto this rank's GPU
            build.update(quantization_config=_bnb_config(transformers), device_map={"": device})
        # a reward model's load report (score new, lm_head unused) is expected: checked below, not printed per rank
        quiet = _quiet_transformers(transformers) if is_reward(config) else contextlib.nullcontext()
        try:
            with torch.device(device) if not quantized else contextlib.nullcontext(), quiet:
                model, info = auto_class(config).from_pretrained(
                    source_of(config), config=hf_config, output_loading_info=True, **build, **load)
        except (OSError, RuntimeError, ValueError) as err:  # unreadable or mismatched weight files
            raise UserError.single(f"transformers cannot load the weights: {type(err).__name__}: "
                                   f"{str(err).strip().splitlines()[0]}", where(config),
                                   "check that the folder holds the weights of the model its config.json "
                                   "describes (save_pretrained writes both)") from None
        info = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if is_reward(config):  # the new score head (transformers initialised it) and the unused LM head
            info["missing_keys"] = _unmatched(info.get("missing_keys", []), REWARD_NEW_KEYS)
            info["unexpected_keys"] = _unmatched(info.get("unexpected_keys", []), REWARD_DROPPED_KEYS)
        _raise_if_not_loaded(config, info)
        if quantized:
            # peft's preparation for a quantized base: every base weight frozen, norms and other small
            # float weights in fp32; activation checkpointing stays dstrain's choice (train.activation_checkpointing).
            model = require("peft", "model.lora").prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return _wrap(config, model)


@contextlib.contextmanager
def _quiet_transformers(transformers):
    """transformers' warnings off for the moment of a load, its verbosity restored after."""
    before = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(before)


def _unmatched(keys: list[str], patterns: tuple[str, ...]) -> list[str]:
    import re
    return [key for key in keys if not any(re.search(p, key) for p in patterns)]


def _bnb_config(transformers):
    """model.lora.quantize: nf4: QLoRA's recipe (4-bit NormalFloat, double quantization, bf16 compute)."""
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)


def check_quantize(config: RunConfig, ds_config: dict, accelerator: str) -> list:
    """Where QLoRA cannot run, before any rank starts: bitsandbytes' 4-bit kernels are CUDA only, ZeRO-3
    would partition the packed 4-bit weights (dstrain builds no quantized zero.Init model), and the
    package must be installed. Returns Problems."""
    import importlib.util

    from dstrain.errors import Problem
    lora = config.model.lora
    if lora is None or lora.quantize is None:
        return []
    where = "model.lora.quantize"
    problems = []
    if accelerator != "cuda":
        problems.append(Problem(f"{lora.quantize} quantization runs on CUDA GPUs only (bitsandbytes' 4-bit kernels), "
                                "and these ranks are CPU ranks", where,
                                "run on GPUs (--accelerator cuda), or drop model.lora.quantize to train LoRA on CPU"))
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        problems.append(Problem("a 4-bit base model is not supported at ZeRO stage 3 (its packed weights would be "
                                "partitioned)", where,
                                "use a stage 0-2 preset (e.g. --preset stage2: the frozen 4-bit base is small), "
                                "or drop model.lora.quantize"))
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append(Problem("bitsandbytes is not installed", where, "pip install 'dstrain[qlora]'"))
    return problems


def _build_zero3(config: RunConfig, ds_config: dict, hf_config, attention: str | None) -> nn.Module:
    import deepspeed
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    from dstrain.models.conversion import load_router
    from dstrain.models.weights import load_into, raise_if_incomplete
    # Some architectures (GPT-2) make transformers import torch._dynamo lazily while the model is built;
    # dynamo's first import checks torch.Tensor.__new__, which zero.Init replaces, and fails
    # ("Signature mismatch ... tensor_pynew"). Imported before, it finds the original.
    import torch._dynamo  # noqa: F401
    _import_model_classes(config, hf_config)
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():  # every weight is loaded next
        model = _from_config(config, hf_config, attention)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # skipped with the initialisation; tied models need it (Gemma, OPT)
    reward = is_reward(config)
    # transformers' own load-time conversions (renamed keys; MoE experts fused from per-expert tensors)
    report = load_into(model, weight_files(config), load_router(model), zero3=True,
                       ignore_missing=[*(getattr(model, "_keys_to_ignore_on_load_missing", None) or []),
                                       *(REWARD_NEW_KEYS if reward else ())],
                       ignore_unexpected=[*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []),
                                          *(REWARD_DROPPED_KEYS if reward else ())])
    raise_if_incomplete(report, where(config), "the weights do not fit config.json's architecture: check that "
                        "config.json and the weight files come from the same model")
    if reward and not any(name.startswith("score.") for name in report.loaded):
        init_new_module(model, model.score)
    return model


def auto_attention(config: RunConfig, hf_config, device: torch.device | str) -> str | None:
    """The attention a model built on `device` gets where model.kwargs names none: FlexAttention for packed rows
    on a GPU, where the architecture offers it. transformers builds a packed row's mask from the position ids
    (dstrain.models.packing); as a FlexAttention block mask it skips the blocks across examples, which sdpa's
    dense masked kernel computes and masks out. Measured on one H200 (a TinyLlama-1.1B shape, packed
    Alpaca-length examples, seq 4096 x 4; benchmarks/results/2026-11-29-h200-packed-flex/): 1.52x sdpa's
    real tokens/s at ZeRO-2 and 1.56x at ZeRO-3, 5 GiB less peak memory, the same losses. None: transformers'
    default (sdpa). CPU ranks keep it: FlexAttention has no backward on CPU."""
    if (torch.device(device).type != "cuda" or not config.data.packing
            or "attn_implementation" in config.model.kwargs):
        return None
    try:
        model_class = auto_class(config)._model_mapping[type(hf_config)]
    except (KeyError, AttributeError, ImportError):  # remote code: its own attention
        return None
    return "flex_attention" if getattr(model_class, "_supports_flex_attn", False) else None


def _import_model_classes(config: RunConfig, hf_config) -> None:
    """Import the architecture's modeling module before zero.Init. A class defined inside zero.Init has its
    __init__ wrapped by DeepSpeed as it is created, before transformers' class decorators run, and DeepSpeed
    puts that first __init__ back when the context ends: the decorators' __init__ is lost for every model
    built later in the process (transformers 5's MoE experts then lack `config`, and a second model of the
    architecture, a preference reference or transformers' own, fails in its forward)."""
    try:
        auto_class(config)._model_mapping[type(hf_config)]  # transformers' lazy mapping imports the module
    except (KeyError, AttributeError, ImportError):  # remote code: its module is imported by from_config
        pass


def init_new_module(model: nn.Module, module: nn.Module) -> None:
    """Initialise `module` (a head the weight files lack) as transformers initialises a missing key: the
    model's own _init_weights. At ZeRO-3 its partitions are gathered and rank 0's values handed out."""
    import deepspeed
    import torch.distributed as dist
    params = list(module.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if rank == 0:
            model._init_weights(module)


def _raise_if_not_loaded(config: RunConfig, info: dict[str, list]) -> None:
    from dstrain.models.weights import LoadReport, raise_if_incomplete
    report = LoadReport(missing=list(info.get("missing_keys", [])), unexpected=list(info.get("unexpected_keys", [])),
                        mismatched=[str(m) for m in info.get("mismatched_keys", [])])
    raise_if_incomplete(report, where(config), "the weights do not fit config.json's architecture: check that "
                        "config.json and the weight files come from the same model")


def weight_files(config: RunConfig) -> list[Path]:
    """The model's weight files, safetensors preferred (shards in index order), downloaded for a hub id."""
    source = source_of(config)
    directory = Path(source)
    if not directory.is_dir():
        hub = require("huggingface_hub", where(config))
        _, load, _ = _split_kwargs(config)
        directory = Path(hub.snapshot_download(source, revision=load.get("revision"),
                                               allow_patterns=["*.json", "*.safetensors"]))
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = directory / index_name
        if index.is_file():
            shards = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
            return [directory / name for name in shards]
        if (directory / single).is_file():
            return [directory / single]
    raise UserError.single(f"no weights in {directory} (model.safetensors, its shards with "
                           "model.safetensors.index.json, or pytorch_model.bin)", where(config),
                           "save the model with save_pretrained into that directory")


# ------------------------------------------------------------------ LoRA


def peft_config(lora: LoraConfig, reward: bool = False):
    """The peft.LoraConfig of model.lora: each option passed under its peft name (schema.PEFT_ARGUMENTS).
    A reward model's is peft's SEQ_CLS task, which keeps the new score head trainable (modules_to_save)."""
    peft = require("peft", "model.lora")
    options = {PEFT_ARGUMENTS[key]: getattr(lora, key) for key in PEFT_ARGUMENTS}
    options["modules_to_save"] = options["modules_to_save"] or None
    options["target_parameters"] = options["target_parameters"] or None
    return peft.LoraConfig(task_type="SEQ_CLS" if reward else "CAUSAL_LM", **options)


def linear_layers(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what target_modules usually names)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if type(module).__name__ in ("Linear", "Conv1D", "Linear4bit")})


def _check_module_names(model: nn.Module, lora: LoraConfig) -> None:
    """Every name in target_modules and modules_to_save must match a module, as peft matches them (the
    full name or its last dotted parts): peft places adapters on the names that match and silently
    drops the rest as long as one matched."""
    from dstrain.errors import Problem
    names = [name for name, _ in model.named_modules() if name]

    def matches(target: str) -> bool:
        return any(name == target or name.endswith("." + target) for name in names)

    linear = ", ".join(linear_layers(model))
    problems = []
    if isinstance(lora.target_modules, list):
        unknown = [t for t in lora.target_modules if not matches(t)]
        if unknown:
            problems.append(Problem(f"{', '.join(unknown)}: no module of the model has this name",
                                    "model.lora.target_modules",
                                    f"name the model's linear layers ({linear}) or write all-linear"))
    params = [name for name, _ in model.named_parameters()]
    unknown = [t for t in lora.target_parameters if not any(n == t or n.endswith("." + t) for n in params)]
    if unknown:
        stacked = sorted({".".join(n.split(".")[-3:]) for n, p in model.named_parameters() if p.dim() == 3})
        problems.append(Problem(f"{', '.join(unknown)}: no parameter of the model has this name",
                                "model.lora.target_parameters",
                                f"name parameters the model has, e.g. its fused experts ({', '.join(stacked)})"
                                if stacked else "this model has no fused expert weights: use target_modules"))
    unknown = [t for t in lora.modules_to_save if not matches(t)]
    if unknown:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not list(m.children())})
        problems.append(Problem(f"{', '.join(unknown)}: no module of the model has this name",
                                "model.lora.modules_to_save", f"name modules the model has, e.g. {', '.join(leaves)}"))
    if problems:
        raise UserError(problems)


def apply_lora(model: nn.Module, lora: LoraConfig | None, reward: bool = False) -> nn.Module:
    """The model with LoRA adapters (peft), base weights frozen; unchanged without model.lora."""
    if lora is None:
        return model
    peft = require("peft", "model.lora")
    config = peft_config(lora, reward)
    _check_module_names(model, lora)
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        raise UserError.single(f"peft cannot place the adapters: {str(err).splitlines()[0]}",
                               "model.lora", f"target the model's linear layers ({', '.join(linear_layers(model))}), "
                               "or drop the option peft refuses for them") from None


def lora_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """For every LoRA layer: its name inside the Hugging Face model, scaling and weight layout, which
    merging on export needs (written to the run directory by rank 0); for an adapter on a parameter
    (target_parameters), also the parameter's name, its experts and whether it is stored (experts, out, in)."""
    layers = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "scaling") and "default" in module.scaling:
            layers[own_name(name)] = {"scaling": float(module.scaling["default"]),
                                      "fan_in_fan_out": bool(getattr(module, "fan_in_fan_out", False))}
            if hasattr(module, "parameter_name"):  # peft's ParamWrapper (target_parameters): one per parameter
                layers[own_name(name)].update(parameter=module.parameter_name, experts=int(module.num_experts),
                                              out_in=bool(module._did_swap_in_out_features))
    return layers


# ------------------------------------------------------------------ checks and run directory


def check_vocab(config: RunConfig, hf_config) -> None:
    """The tokenizer's ids must fit the model's embedding; checked before any rank starts."""
    from dstrain.data import data_config
    vocab = getattr(hf_config, "vocab_size", None)
    name = data_config(config).tokenizer  # unset: the model's own
    if vocab is None or config.data.source in ("synthetic", "tokens") or ":" in config.data.source:
        return
    if name == "byte":
        size = 256
    else:
        from dstrain.data.sources import load_tokenizer
        size = len(load_tokenizer(name))
    if size > vocab:
        raise UserError.single(f"the tokenizer has {size} tokens but the model's embedding only {vocab}",
                               f"data.tokenizer: {name}",
                               f"use the model's own tokenizer (data.tokenizer: {source_of(config)}) or a model "
                               f"with vocab_size >= {size} in {_config_file(source_of(config))}")


def save_source(config: RunConfig, run_dir: Path) -> None:
    """Copy config.json, generation_config.json, tokenizer files (and a remote-code model's .py files)
    into <run_dir>/hf_source, plus model.lora as peft's adapter_config.json, for `convert-checkpoint
    --format hf / peft` (rank 0 adds each LoRA layer's scaling and layout)."""
    target = run_dir / HF_SOURCE
    target.mkdir(parents=True, exist_ok=True)
    source = Path(source_of(config))
    if source.is_dir():
        for path in source.iterdir():
            if path.is_file() and (path.name in ("config.json", "generation_config.json", *TOKENIZER_FILES)
                                   or path.suffix == ".py"):
                shutil.copyfile(path, target / path.name)
    else:  # a hub id: the same files, through transformers (cached by huggingface_hub)
        _save_from_hub(config, target)
    keys = source_weight_keys(config)
    if keys is not None:  # the export writes the layout these keys have (dstrain.models.conversion)
        (target / HF_SOURCE_KEYS).write_text(json.dumps({"keys": keys}) + "\n")
    from dstrain.data.templates import named_or_file, uses_template
    if config.data.chat_template is not None and uses_template(config.data):
        # the template the run trained in goes with the exports, so `generate --chat` talks in it
        (target / "chat_template.jinja").write_text(named_or_file(config.data.chat_template), encoding="utf-8")
    if is_reward(config):  # the export is a sequence classifier: one label, its architecture, pad_token_id
        load_config(config).save_pretrained(target)
    if config.model.lora is not None:  # for `--format peft`: the adapters' peft config, naming the base model
        adapter = peft_config(config.model.lora, is_reward(config))
        adapter.base_model_name_or_path = str(source.resolve()) if source.is_dir() else source_of(config)
        adapter.save_pretrained(str(target))


def source_weight_keys(config: RunConfig) -> list[str] | None:
    """The keys of the model's weight files as published (read from the index or the safetensors headers, no
    values), or None where they cannot be read without downloading the weights (torch .bin files; a hub id
    whose safetensors metadata is out of reach): the export then writes the layout save_pretrained writes."""
    source = Path(source_of(config))
    try:
        if not source.is_dir():
            hub = require("huggingface_hub", where(config))
            _, load, _ = _split_kwargs(config)
            return sorted(hub.get_safetensors_metadata(source_of(config), revision=load.get("revision")).weight_map)
        index = source / "model.safetensors.index.json"
        if index.is_file():
            return sorted(json.loads(index.read_text())["weight_map"])
        if (source / "model.safetensors").is_file():
            from safetensors import safe_open
            with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
                return sorted(handle.keys())
    except Exception:  # noqa: BLE001 - offline, gated or unreadable: the export falls back to save_pretrained's layout
        return None
    return None


def _save_from_hub(config: RunConfig, target: Path) -> None:
    transformers = require("transformers", where(config))
    load_config(config).save_pretrained(target)
    _, load, _ = _split_kwargs(config)
    for cls in (transformers.GenerationConfig, transformers.AutoTokenizer):
        try:
            cls.from_pretrained(source_of(config), **load).save_pretrained(target)
        except Exception:  # noqa: BLE001 - a model without a generation config or tokenizer exports without it
            pass
