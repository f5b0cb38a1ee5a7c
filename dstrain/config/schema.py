"""The run-config schema: every key dstrain accepts, its type, its default and its meaning.

Defaults live here and nowhere else. Every model forbids unknown keys, so a typo is an error,
never a silently ignored setting. The `deepspeed` section is kept as a raw dict here; it is
checked against DeepSpeed's own key names and models in `deepspeed_keys` / `deepspeed_models`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator,
                      model_validator)

from dstrain.config.preference import OBJECTIVES, REFERENCE_MODES


BUILTIN_TRACKERS = ("tensorboard", "wandb", "csv")  # train.log_to names besides a user's "module:Class"
# train.tiled_mlp "auto" is on from this many tokens of one sequence on a rank (seq_len / sequence_parallel;
# on CUDA). Not counted per micro batch: at 4 x 2,048 tokens the recompute cost 18-22% of tokens/s (Llama and
# Qwen2 shapes, 1-4 H200s, 2026-11-27), where a smaller micro batch saves the same memory for free.
TILED_MLP_MIN_SEQ_TOKENS = 16_384
# From this vocabulary size the estimate says what micro batch train.loss_chunking lets fit (and a model's
# own "auto" chunking starts: CausalLM(chunking="auto"), GPT(loss_chunk=...)); smaller logits cost little.
LOSS_CHUNKING_MIN_VOCAB = 32_768
# train.loss_chunking "auto" is on from this many tokens a sequence (data.seq_len): there the whole logits
# are gigabytes a rank and attention, not the head, sets the step's time.
LOSS_CHUNKING_MIN_SEQ_LEN = 16_384
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # torch's Adam rejects betas outside [0, 1)


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docstrings become help text."""

    # allow_inf_nan=False: `lr: .inf` or `grad_clip: nan` is a mistake, and JSON cannot hold it.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


class LoraConfig(Section):
    """LoRA adapters through the peft package (docs/fine-tuning.md): the base weights are frozen, only
    the adapters (and modules_to_save) train. This class is the one table of LoRA options: each field
    is passed to the peft.LoraConfig argument PEFT_ARGUMENTS names, and docs/fine-tuning.md shows the
    same table (tests/test_lora_options.py keeps the two equal)."""

    r: PositiveInt = 8
    """Rank of the adapter matrices."""
    alpha: PositiveFloat = 16.0
    """Scaling numerator: the adapter's update is multiplied by alpha / r, or alpha / sqrt(r) with
    use_rslora."""
    target_modules: list[str] | Literal["all-linear"] | None = None
    """Names (or name suffixes) of the modules that get adapters, e.g. [q_proj, v_proj], or "all-linear"
    (every linear layer but the output head); unset: peft's default for the architecture (q_proj and
    v_proj for Llama, c_attn for GPT-2). A name that matches no module is an error listing the model's
    linear layers."""
    target_parameters: list[str] = []
    """Names (or name suffixes) of parameters that get adapters themselves, for weights that are no linear
    layer: a mixture-of-experts layer's fused experts, e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]
    (peft's target_parameters: a rank-r adapter for each expert). With or without target_modules; not with
    dropout or DoRA (peft cannot factor them out of a parameter's adapter); any ZeRO stage."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input."""
    modules_to_save: list[str] = []
    """Modules trained whole beside the adapters and saved with them, e.g. [lm_head, embed_tokens] after
    adding tokens."""
    use_dora: bool = False
    """DoRA: the low-rank update goes to the weight's direction, and a per-output magnitude vector trains
    too (slower steps than LoRA)."""
    use_rslora: bool = False
    """rsLoRA: scale by alpha / sqrt(r) instead of alpha / r, steadier at high ranks."""
    quantize: Literal["nf4"] | None = None
    """QLoRA: "nf4" loads the frozen base weights in 4-bit NormalFloat through bitsandbytes (bf16 compute,
    double quantization), about a quarter of their bf16 memory. GPU ranks and ZeRO stages 0-2 only;
    needs `pip install 'dstrain[qlora]'`. The adapters train in the run's precision; export them with
    the "peft" format (a merged "hf" export of a 4-bit base is refused). Unset: the base is loaded in
    model.kwargs.dtype."""

    @model_validator(mode="after")
    def _parameter_adapters_take_no_dropout_or_dora(self) -> "LoraConfig":
        # peft's parameter adapter adds its update to the weight itself, where the input's dropout and DoRA's
        # per-row norm cannot be factored in; say so here rather than in every rank.
        if self.target_parameters and (self.dropout or self.use_dora):
            option = "model.lora.dropout" if self.dropout else "model.lora.use_dora"
            raise ValueError(f"{option} does not work with model.lora.target_parameters (peft adds a parameter's "
                             f"adapter to the weight itself): unset {option} or adapt linear layers only "
                             "(target_modules)")
        return self


# LoraConfig field -> the peft.LoraConfig argument it is passed to (quantize is dstrain's own: it picks
# how the base model is loaded, not an adapter option).
PEFT_ARGUMENTS = {"r": "r", "alpha": "lora_alpha", "target_modules": "target_modules",
                  "target_parameters": "target_parameters", "dropout": "lora_dropout",
                  "modules_to_save": "modules_to_save", "use_dora": "use_dora", "use_rslora": "use_rslora"}


class ModelConfig(Section):
    name: str = "gpt"
    """Which model to train: "gpt" (the built-in GPT family), "hf:<local directory or hub id>" (a pretrained
    Hugging Face causal LM, weights loaded; docs/fine-tuning.md) or an entry point "package.module:function"
    returning an nn.Module whose forward(batch) returns the loss (see README, "Your own model")."""
    n_layer: PositiveInt = 4
    """Transformer blocks of the built-in GPT."""
    n_head: PositiveInt = 4
    """Attention heads of the built-in GPT; must divide d_model."""
    d_model: PositiveInt = 128
    """Width (hidden size) of the built-in GPT."""
    vocab_size: PositiveInt = 256
    """Vocabulary size; 256 for byte-level text."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability inside the built-in GPT."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to a model entry point (ignored for "gpt"). For "hf:" models: dtype
    (float32 unless set; bfloat16, float16, auto), attn_implementation (eager, sdpa, ...),
    trust_remote_code (false unless set: true runs the model's own code), revision, and any
    config.json key to override (e.g. use_cache: false)."""
    lora: LoraConfig | None = None
    """LoRA adapters for an "hf:" model (needs the peft package); unset: the whole model trains."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        # After all fields: n_head is declared before d_model, so a field validator would not see it.
        if self.name == "gpt" and self.d_model % self.n_head:
            raise ValueError(f"model.n_head={self.n_head} must divide model.d_model={self.d_model}")
        if self.lora is not None and not self.name.startswith("hf:"):
            raise ValueError("model.lora needs an \"hf:\" model (peft wraps Hugging Face models)")
        return self


class DataFields(Section):
    text: str = "text"
    """The document, for format "text"."""
    prompt: str = "prompt"
    """The prompt, for format "prompt_response" (no loss on it)."""
    response: str = "response"
    """The response, for format "prompt_response" (the loss is on it and on the end-of-text after it)."""
    messages: str = "messages"
    """The conversation, for format "chat": a list of {"role": ..., "content": ...} messages."""
    instruction: str = "instruction"
    """The instruction, for format "alpaca" (no loss on it)."""
    input: str = "input"
    """The optional input (context) of format "alpaca"; a row without it, or with it empty, has none."""
    output: str = "output"
    """The answer, for format "alpaca" (the loss is on it and on the end-of-text after it)."""
    conversations: str = "conversations"
    """The conversation, for format "sharegpt": a list of {"from": ..., "value": ...} turns."""
    role: str = "from"
    """The key of a turn's speaker, for format "sharegpt"."""
    content: str = "value"
    """The key of a turn's text, for format "sharegpt"."""
    roles: dict[str, str] = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                             "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                             "system": "system", "tool": "tool", "function_call": "assistant",
                             "observation": "tool"}
    """Speaker names of format "sharegpt" -> chat roles (user, assistant, system, tool); a turn whose
    speaker is not listed is an error naming it. Setting this replaces the whole mapping."""
    chosen: str = "chosen"
    """The preferred completion, for format "preference": a string, or a list of messages (with the prompt's
    turns in front when the row has no prompt field), or one {from, value} turn beside "conversations"."""
    rejected: str = "rejected"
    """The dispreferred completion, for format "preference"; written as the chosen one is."""
    completion: str = "completion"
    """The completion of an unpaired (KTO) row of format "preference": a string or a list of messages."""
    label: str = "label"
    """Whether an unpaired (KTO) row's completion is desirable: true or false."""
    margin: str = "margin"
    """An optional number per pair of format "preference": how much better the chosen completion is, read by
    the reward model's loss (-log sigmoid(r_chosen - r_rejected - margin)); rows without it have none."""


class DataConfig(Section):
    source: str = "corpus"
    """Where tokens come from: "corpus" (the embedded real-text corpus: Python's own standard-library
    sources, byte-level), "synthetic" (random tokens, for benchmarks), "text" (files in `paths`),
    "tokens" (nanoGPT-style token files in `paths`), rows of "jsonl", "json" (an array of objects),
    "parquet" files or "datasets" directories (written by datasets' save_to_disk) in `paths`, read as
    `format` says (docs/data.md), or an entry point "module:function" returning a Dataset."""
    paths: list[str] = []
    """Files or glob patterns for the "text" and "tokens" sources."""
    seq_len: PositiveInt = 256
    """Tokens per training sequence (also the built-in GPT's context length)."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of "tokens" files (nanoGPT writes uint16)."""
    tokenizer: str | None = None
    """"byte" (one token per UTF-8 byte, vocab 256) or a Hugging Face tokenizer name or directory; unset:
    the model's own tokenizer for "hf:" models, else "byte"."""
    format: Literal["text", "prompt_response", "chat", "alpaca", "sharegpt", "preference"] = "text"
    """How rows of the jsonl/json/parquet/datasets sources become tokens: "text" (documents packed into
    seq_len windows, end-of-text between them), "prompt_response" (loss on the response only), "chat"
    (OpenAI-style messages rendered by the chat template, loss on assistant turns only), "alpaca"
    (instruction/input/output; loss on the output), "sharegpt" (conversations of {from, value}
    turns, read as chat) or "preference" (chosen and rejected completions of a prompt, or KTO's
    prompt/completion/label, for train.objective dpo, simpo, orpo, kto and reward; the layouts are
    told apart by their fields, see dstrain/data/layouts.py); see docs/data.md."""
    packing: bool | Literal["auto"] = "auto"
    """Several whole examples per seq_len row (formats other than "text"), each with its own position
    ids and no attention across examples, instead of one example padded to seq_len. "auto": on where
    the model keeps packed examples apart (the built-in GPT; "hf:" models whose attention transformers
    masks per example), else padding, with a note; true: on, or an error where the model cannot;
    false: one padded example per row."""
    fields: DataFields = DataFields()
    """Names of the fields each row is read from (format "text": fields.text, ...)."""
    chat_template: str | None = None
    """For formats "chat" and "sharegpt" (and "alpaca", which otherwise uses the Alpaca prompt): the name
    of a template of dstrain/data/templates.py (e.g. chatml, llama3) or a Jinja template file, replacing
    the tokenizer's own; unset: the tokenizer's own template."""
    split: str = "train"
    """The split to read from a "datasets" directory that holds several (a DatasetDict)."""
    cache_dir: str | None = None
    """Where tokenized rows are cached, keyed by the files' contents, tokenizer, format, fields and
    seq_len; unset: $XDG_CACHE_HOME/dstrain/tokenized (~/.cache/dstrain/tokenized)."""
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Fraction of the data held out for evaluation (taken from the end)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to a data entry point."""


STREAM_EVAL_BATCHES = 8  # train.eval_batches left unset, for a token-stream source


class TrainConfig(Section):
    max_steps: PositiveInt = 200
    """Optimizer steps to train for."""
    objective: Literal[OBJECTIVES] = "lm"
    """What the loss is: "lm" (next-token cross-entropy), or a preference objective on data.format
    "preference" (the preference section sets it up): "dpo" (DPO and its variants, preference.loss),
    "simpo" (SimPO / CPO, no reference model), "orpo" (ORPO, no reference model), "kto" (KTO on
    completions labelled desirable or not) or "reward" (a reward model: an "hf:" model with a scalar
    head, Bradley-Terry loss: AutoModelForSequenceClassification). The losses are TRL 1.16's
    (dstrain/models/preference_loss.py); docs/preference.md."""
    micro_batch_size: PositiveInt = 8
    """Sequences per rank per forward pass (DeepSpeed's train_micro_batch_size_per_gpu)."""
    grad_accum_steps: PositiveInt = 1
    """Micro batches accumulated per optimizer step (DeepSpeed's gradient_accumulation_steps)."""
    global_batch_size: PositiveInt | None = None
    """Sequences per optimizer step over all ranks (DeepSpeed's train_batch_size);
    left unset it is micro_batch_size x grad_accum_steps x world size (/ train.sequence_parallel)."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """Training precision: "auto" is bf16 on a GPU that supports it, fp16 on older GPUs, fp32 on CPU.
    "fp8": bf16 training (DeepSpeed's bf16 section: bf16 weights, fp32 master weights and optimizer states,
    checkpoints as in bf16) whose nn.Linear matmuls run in FP8 through torchao's float8 training
    (train.fp8_recipe), the first and last decoder layers and the LM head kept in bf16; GPUs of compute
    capability 8.9 or more (Ada, Hopper, Blackwell), the built-in GPT and "hf:" models, full fine-tuning;
    needs `pip install 'dstrain[fp8]'`. See docs/fp8.md."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao's float8 recipe for train.precision=fp8: "tensorwise" (one scale per tensor; the faster) or
    "rowwise" (one scale per row; more accurate, slower). Ignored for other precisions."""
    fp8_fast_accum: bool = True
    """The forward matmul of train.precision=fp8 accumulates in the FP8 tensor cores' fast, lower-precision
    mode (torchao's default for both recipes; the backward matmuls never do); false accumulates in full
    precision. Ignored for other precisions. See docs/fp8.md."""
    mixed_precision: Literal["deepspeed", "autocast"] = "deepspeed"
    """How bf16/fp16 training runs: "deepspeed" (DeepSpeed's bf16/fp16 optimizer: low-precision weights,
    an fp32 master copy inside the optimizer) or "autocast" (fp32 weights, torch.autocast compute:
    DeepSpeed's torch_autocast section; 4 more bytes per parameter). Ignored for fp32. See docs/benchmarks.md."""
    optimizer: Literal["adamw", "adam", "lamb", "onebitadam", "onebitlamb", "zerooneadam"] = "adamw"
    """Optimizer when the deepspeed section names none; Adam/AdamW become FusedAdam on GPU
    and DeepSpeedCPUAdam when the optimizer is offloaded. The 1-bit ones need a DeepSpeed that still has
    them (0.19 has not): `dstrain run` checks the installed DeepSpeed's list before any rank starts."""
    lr: NonNegativeFloat = 1e-3
    """Peak learning rate (DeepSpeed's optimizer.params.lr; 0, as in torch, trains nothing)."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of lr, for decaying schedules."""
    warmup_steps: int = Field(20, ge=0)
    """Steps of linear warmup from 0 to lr."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate schedule after warmup when the deepspeed section names no scheduler:
    cosine (WarmupCosineLR), linear (WarmupDecayLR) or constant (WarmupLR)."""
    weight_decay: NonNegativeFloat = 0.1
    """Decoupled weight decay (AdamW)."""
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    """Adam betas, each in [0, 1)."""
    eps: NonNegativeFloat = 1e-8
    """Adam epsilon (0 is allowed, as in torch's Adam)."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value; 0 disables (DeepSpeed's gradient_clipping)."""
    sequence_parallel: PositiveInt = 1
    """Ranks that split each sample's sequence between them, for sequences too long for one GPU: each
    holds seq_len / N tokens and attention exchanges heads for tokens (DeepSpeed's Ulysses, "hf:" models
    with sdpa or flash attention). N must divide the world size, data.seq_len and the model's attention
    and key-value heads; data parallelism runs over world / N groups, so the global batch is
    micro x accum x world / N samples. 1: off. See docs/long-context.md."""
    activation_checkpointing: bool | Literal["auto"] = False
    """Recompute each transformer block in backward instead of storing its activations, through
    DeepSpeed's checkpointing (see deepspeed.activation_checkpointing for partition/cpu options).
    "auto" (the offload presets) decides on each rank: off where dstrain's memory estimate of the run
    without it needs at most half of the GPU, on otherwise (and always on for a model other than the
    built-in GPT, whose activations the estimate does not know); rank 0 says which and why."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with torch.compile (DeepSpeed's engine.compile) before training. "auto" is on
    where it was measured to help (docs/benchmarks.md): the built-in GPT in bf16 on CUDA with ZeRO
    stage 0-2, no offload and no activation checkpointing (+15% to +37% tokens/s, 40-50% less GPU
    memory, 30-50 s more to the first step until torch's compile cache is warm), and wherever
    deepspeed.compile.deepcompile is on (set it true to have it; dstrain leaves it off: eager ZeRO-3 with
    dstrain's step ran as fast); off otherwise (ZeRO-3 without DeepCompile measured no faster compiled;
    set true to compile your own model). An "hf:" model is compiled region by region, each decoder layer
    on its own (the rest eager); "auto" turns that on in bf16 on CUDA without offload or activation
    checkpointing at ZeRO 0-2 (1.25x torch eager at stage 2 on a 1.5B) and at ZeRO-3 where dstrain keeps
    the decoder layers whole (1.06-1.18x DDP on two GPUs; sharded layers measured no faster;
    docs/performance.md)."""
    loss_chunking: bool | Literal["auto"] = "auto"
    """The LM head and its cross-entropy computed train.loss_chunk_tokens tokens at a time
    (dstrain/models/chunked_loss.py), never holding the whole [tokens x vocabulary] logits in fp32: less GPU
    memory for large vocabularies, the same loss and gradients as torch's lm_head + cross_entropy up to
    rounding. For the built-in GPT and "hf:" models whose forward dstrain can split into the decoder body and
    the head (Llama, Qwen2, Mistral, GPT-2, ...; others keep their own loss, with a note); your own model
    computes its loss itself. "auto": on for sequences of LOSS_CHUNKING_MIN_SEQ_LEN (16,384) tokens or more,
    off for shorter ones (on one H100 it saved 10-23% of the peak memory at a 151,936-token vocabulary for
    3-7% of the speed at 2,048 tokens: set true where memory binds; `dstrain estimate` shows the larger
    micro batch it fits). Not in fp16 (the gradients are formed before the loss scale applies; true there
    is an error); false: the whole logits."""
    loss_chunk_tokens: PositiveInt = 1024
    """Tokens per chunk of train.loss_chunking: one chunk's logits (compute dtype, fp32 and the gradient:
    about 8-12 bytes x chunk x vocabulary, 1.9 GB at 1,024 x 151,936) exist at a time. Smaller saves
    memory, larger makes fewer, bigger matrix products."""
    tiled_mlp: bool | Literal["auto"] = "auto"
    """Run each decoder layer's MLP of an "hf:" model over the sequence in train.tiled_mlp_shards shards,
    recomputing each shard in backward (DeepSpeed's TiledMLP, from ALST): one shard's MLP intermediate
    activations are live instead of the whole sequence's, for one more MLP forward per step. "auto": on
    for an "hf:" model on CUDA when a rank holds at least TILED_MLP_MIN_SEQ_TOKENS (16,384) tokens of one
    sequence (seq_len / sequence_parallel), off otherwise (shorter sequences: a smaller micro batch saves
    the memory without the recompute, which cost 18-22% of tokens/s at 4 x 2,048 tokens; CPU ranks).
    true: always (an error for other models, or at ZeRO-3 with frozen weights such as LoRA). See
    docs/long-context.md."""
    tiled_mlp_shards: PositiveInt | None = None
    """Shards of train.tiled_mlp. Unset: ceil(tokens per rank per sample / hidden_size), ALST's rule (each
    shard's intermediate activations about as large as the layer's hidden states)."""
    activation_checkpointing_offload: bool = False
    """With train.activation_checkpointing on an "hf:" model: keep each checkpointed layer's input (the
    hidden states, micro x seq_len / sequence_parallel x hidden per layer) in pinned host memory instead
    of on the GPU, copied out and back on a side stream (DeepSpeed's
    get_checkpoint_hidden_states_offloading_ctx_manager around each micro batch's forward and backward).
    Helps where those inputs dominate: many layers at long sequences. CUDA only (an error on CPU ranks, where
    there is nothing to offload to); an error without activation checkpointing or for other models."""
    seed: int = 1234
    """Seed for model init, data order and dropout; the same seed gives the same run."""
    log_every: PositiveInt = 10
    """Log loss, lr and throughput every this many steps (console and metrics.jsonl)."""
    log_to: list[str] = []
    """Trackers that also get every logged metric, event and (tensorboard, wandb) the resolved config as
    hyper-parameters, next to metrics.jsonl: "tensorboard" (RUN_DIR/tensorboard; pip install
    'dstrain[tensorboard]'), "wandb" (RUN_DIR/wandb; WANDB_PROJECT, WANDB_MODE=offline are honoured;
    pip install 'dstrain[wandb]'), "csv" (RUN_DIR/metrics.csv), or your own class as "module:Class",
    imported like model.name: Class(run_dir, hparams, start_step) with log_metrics(step, values),
    log_event(step, kind, fields), close() and optionally rewind(step) (see dstrain/rank/trackers.py).
    Several at once: [tensorboard, csv]."""

    @field_validator("log_to")
    @classmethod
    def _known_trackers(cls, names: list[str]) -> list[str]:
        for name in names:
            if name not in BUILTIN_TRACKERS and not re.fullmatch(r"[\w.]+:\w+", name):
                raise ValueError(f"unknown tracker {name!r}: use {', '.join(BUILTIN_TRACKERS)}, or your own "
                                 "class as 'module:Class'")
        return names
    eval_every: PositiveInt = 100
    """Evaluate on the held-out split every this many steps, and at the end."""
    eval_batches: PositiveInt | None = None
    """Global batches of held-out samples in one evaluation, each sample at most once (fewer when the
    held-out split holds fewer). Unset: every held-out sample once for rows (jsonl, json, parquet,
    datasets) and entry-point datasets; 8 global batches (STREAM_EVAL_BATCHES) for the token streams
    (corpus, synthetic, text, tokens), whose held-out split may be large. The same samples whatever
    the world size."""
    save_every: PositiveInt = 100
    """Save a checkpoint every this many steps, and at the end."""
    save_checkpoints: bool = True
    """false: save no checkpoint at all (not at save_every, the end or a stop signal), for throwaway
    runs such as benchmarks and memory probes, where writing the optimizer state costs minutes."""
    keep_last: PositiveInt = 2
    """Complete checkpoints to keep; older ones are deleted (never the only complete one)."""
    checkpoint_hashes: bool = True
    """Record each checkpoint file's SHA-256 in its completion mark (sizes are always recorded). Each
    rank hashes its own files right after saving, in parallel: about 0.6 s per GB per rank on a CPU
    core with SHA instructions (docs/benchmarks.md). `dstrain checkpoint verify` checks them."""
    verify_hashes_on_resume: bool = False
    """--resume also compares every file's SHA-256 with the mark, reading the whole checkpoint once more
    before the ranks start (sizes are always compared)."""
    save_every_minutes: PositiveFloat | None = None
    """Also save a checkpoint whenever this many minutes have passed since the last save (all ranks
    agree on the step without a device sync); null: step-based saves only."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks the run health guard may make over the whole run (counted across resumes) before it
    gives up with exit code 1 and a report. A rollback happens when a step's loss or global gradient
    norm is not finite, or its loss spikes (spike_factor): the ranks load the last complete checkpoint
    before that step, skip that step's global batch of samples, and train on. 0: give up at once."""
    spike_factor: float | None = Field(None, gt=1.0)
    """A step whose loss exceeds this factor times the median of the last spike_window healthy steps
    is treated like a non-finite one (rollback). null (default): off, since a model whose loss nears
    zero (e.g. regression) can exceed any factor by noise; 2-3 suits language models."""
    spike_window: int = Field(50, ge=2)
    """Healthy steps whose median loss is the reference for spike_factor; the check starts once this
    many steps have been seen since the run (or the resume) started."""
    early_stop_patience: PositiveInt | None = None
    """Stop (with a checkpoint) after this many evaluations in a row without the eval loss improving
    on its best by more than early_stop_min_delta; null: never stop early."""
    early_stop_min_delta: NonNegativeFloat = 0.0
    """How much lower than the best so far an eval loss must be to count as an improvement."""
    hang_timeout_s: NonNegativeFloat | Literal["auto"] = "auto"
    """Seconds a rank may make no progress (no new phase or step in its heartbeat) before `dstrain run`
    calls the job hung: it names the stuck rank, its phase and Python stack, and ends the job (the last
    complete checkpoint stays `latest`). Start-up, the first step and checkpoint saves get three times
    this. "auto": 600 on GPU, 1800 on CPU; 0 turns hang detection off. NCCL/gloo collectives time out
    at three times this plus 60 s, so a hang ends even without the watchdog."""
    join_timeout_s: NonNegativeFloat = 300.0
    """Several nodes: seconds every node's `dstrain run` waits for the ranks of all nodes to start (it says
    whom it waits for after 5 s, then every 30 s) before it ends the job, naming the nodes that never
    came. `dstrain run --join-timeout` sets it for one launch. 0: wait as long as it takes."""
    liveness_timeout_s: NonNegativeFloat = 60.0
    """Several nodes: seconds a rank may give no sign of life before every node's `dstrain run` ends the
    job, naming its node and its last sign of life. The sign is its heartbeat thread's write, every 2 s
    whatever the rank is doing, so a long compile or a slow step never trips it (hang_timeout_s judges
    those); a stopped process, a frozen host or a lost network does. 0 turns it off; else at least 10."""

    @field_validator("liveness_timeout_s")
    @classmethod
    def _several_beats(cls, seconds: float) -> float:
        if 0 < seconds < 10:  # five beats (hangs.ALIVE_EVERY_S): one late write on a busy node is no verdict
            raise ValueError("must be 0 (off) or at least 10 seconds")
        return seconds
    export_final: bool | Literal["safetensors", "hf", "peft"] = False
    """At the end, also write consolidated weights: true or "safetensors" to <run_dir>/final.safetensors,
    "hf" (for "hf:" models) a folder AutoModelForCausalLM.from_pretrained loads, <run_dir>/final_hf,
    "peft" (for model.lora) the adapters alone, a folder peft.PeftModel.from_pretrained loads on the
    base model, <run_dir>/final_adapter."""
    export_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Floating-point dtype of the train.export_final weights."""
    init_from: str | None = None
    """A consolidated .safetensors (dstrain's own export) to start the model from, keys checked strictly
    against the model's state_dict (any model; a resumed run loads its checkpoint instead)."""
    trainable: list[str] = []
    """Name patterns (fnmatch, e.g. "blocks.3.*") of the parameters that train; empty: all of them.
    Names are the model's own (for "hf:" models as in its state_dict, e.g. "model.layers.0.mlp.up_proj.weight")."""
    frozen: list[str] = []
    """Name patterns of parameters to freeze (applied after train.trainable). Frozen parameters stay in
    checkpoints and exports but never reach the optimizer."""


class PreferenceConfig(Section):
    """Preference training (train.objective dpo, simpo, orpo, kto, reward): the loss, its strength and where
    the reference log-probs come from. Names and checks: dstrain/config/preference.py (TRL 1.16's names)."""

    loss: str | list[str] | None = None
    """The loss type, or a list summed with loss_weights (objective dpo: sigmoid, hinge, ipo, robust,
    apo_zero, sft, ...; simpo: simpo, sigmoid, hinge, ipo; kto: kto, apo_zero_unpaired). Unset: sigmoid
    for dpo, simpo for simpo, kto for kto. ORPO and the reward model have one loss and ignore it."""
    loss_weights: list[float] | None = None
    """One weight per entry of preference.loss, in its order; unset: 1 each."""
    beta: float = 0.1
    """The preference strength (> 0): DPO's KL coefficient (higher stays closer to the reference), SimPO's
    reward scale, ORPO's odds-ratio weight (TRL's lambda), KTO's beta."""
    label_smoothing: float = Field(0.0, ge=0.0, le=1.0)
    """The probability that a pair's labels are flipped, read by the DPO losses robust, exo_pair, aot and
    aot_unpaired (robust needs < 0.5, exo_pair > 0) and by SimPO; the others ignore it, as in TRL."""
    reference: Literal[REFERENCE_MODES] = "auto"
    """Where the reference log-probs come from (dpo, kto): "adapters_off" (the same model with its LoRA
    adapters switched off: no second copy), "model" (a frozen copy of the starting weights), "precomputed"
    (DPO: the reference's log-probs computed once before training and cached, dstrain/rank/precomputed.py; refused for kto), "none" (simpo, orpo and reward read no
    reference). "auto": none where the objective reads none, adapters_off with model.lora, else model."""
    sft_weight: NonNegativeFloat = 0.0
    """Weight of the chosen completions' NLL added to the loss (RPO / MPO): for dpo TRL 1.16's extra "sft"
    loss type with this weight, for simpo its cpo_alpha (the SimPO paper uses 0, CPO 1). 0: none."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (the loss is -log sigmoid(beta * margin - gamma))."""
    kto_desirable_weight: PositiveFloat = 1.0
    """KTO: the weight of the desirable completions' losses (raise it when they are rarer)."""
    kto_undesirable_weight: PositiveFloat = 1.0
    """KTO: the weight of the undesirable completions' losses."""
    center_rewards_coefficient: NonNegativeFloat | None = None
    """Reward model: the weight of mean((r_chosen + r_rejected)^2), which keeps rewards centred on 0
    (TRL's center_rewards_coefficient; 0.01 is its suggestion); unset: no such term."""


class SpeedupsConfig(Section):
    """dstrain's changes to DeepSpeed's internals (dstrain/speedups/), each on unless switched off here;
    a change that does not cover the run's set-up is skipped and rank 0 says why. The DSTRAIN_<KEY>
    environment variables (e.g. DSTRAIN_ZERO3_STEP=off) set these keys as a layer above the config
    files. Switching one off gives DeepSpeed's own code path, for measuring or for a suspected bug."""

    zero3_step: bool = True
    """ZeRO-3 without offload: the optimizer step's release, gradient norm and persistent gather batched."""
    zero3_gather: bool = True
    """ZeRO-3 on several ranks: the persistent parameters' gather after the step regrouped in one copy
    (off: DeepSpeed's coalesced gather, a parameter at a time). Needs zero3_step."""
    zero3_hooks: bool = True
    """ZeRO-3: no module hooks on modules whose parameters all stay gathered. Needs zero3_step."""
    zero3_grads: bool = True
    """ZeRO-3: the backward's per-gradient bucket and partition copies made lean. Needs zero3_step."""
    flatten_on_device: bool = True
    """ZeRO-3: the parameter partitions flattened on the device at engine start, where it has room for a
    second copy (off: through host memory, as DeepSpeed does)."""
    cuda_stream: bool = True
    """CUDA: DeepSpeed's accelerator looks the current stream up by device index."""
    muon_lazy_compile: bool = True
    """DeepSpeed's Muon module (imported at every engine build, whatever the optimizer) imported with its
    kernels compiled at their first call: no TorchInductor import in a run that does not use Muon."""
    dynamo_lazy_import: bool = True
    """torch's compiler (torch._dynamo) imported when something compiles, not at the first optimizer's
    construction (torch marks its optimizer methods "not compiled" and imports it to do so): about 1.5 s of
    CPU less in every rank's start."""
    cpu_adam_nogil: bool = True
    """CPU offload: build DeepSpeed's CPU Adam kernel with dstrain's GIL-free binding (JIT, once per
    machine), which offload_overlap, offload_host_rounding and bf16 offload_grads need."""
    offload_syncs: bool = True
    """ZeRO-1/2 CPU offload: no per-parameter GPU waits in the backward (overflow tracker, gradient norm)."""
    offload_chunks: bool = True
    """CPU offload: the optimizer step in chunks of offload_chunk_elements (off: DeepSpeed's step)."""
    offload_chunk_elements: int = Field(1 << 23, ge=1024)
    """Elements per chunk of the chunked offload step (rounded down to a multiple of 1,024)."""
    offload_grads: Literal["bf16", "fp32", "off"] = "bf16"
    """CPU offload: how gradients reach the host. bf16: dstrain's copies, in bf16 where the weights are bf16
    (needs offload_chunks); fp32: ZeRO-3's single copy in fp32, DeepSpeed's copies for ZeRO-1/2;
    off (or false): DeepSpeed's copies."""
    offload_accumulate: Literal["auto"] | bool = "auto"
    """ZeRO-2/3 CPU offload with gradient accumulation: each micro step's gradients summed in GPU buffers
    instead of DeepSpeed's host buffers, which it copies to the GPU and back at every micro step (ZeRO-3:
    this rank's partition of the parameters, in grad_accum_dtype; ZeRO-2: the whole of each parameter of
    this rank's partition, in its dtype). auto: on a CUDA GPU where the buffers leave a quarter of its
    memory free once made; true: wherever it applies (a CPU accelerator too); false (or off): DeepSpeed's
    copies. ZeRO-3's needs offload_grads."""
    offload_host_rounding: bool = True
    """ZeRO-3 with parameter offload: the new weights rounded to bf16 in the Adam pass (off: on the GPU)."""
    offload_overlap: bool = True
    """ZeRO-3 CPU offload: the optimizer step on a worker thread beside the next forward (off: before it)."""
    offload_overlap_threads: int = Field(0, ge=0)
    """CPU threads of the overlapped step's worker; 0: one fewer than the rank's."""
    offload_fetch_wait: bool = True
    """ZeRO-3 with the parameters offloaded, one GPU: a fetched parameter's copy waited for by the GPU's
    streams instead of the host (off: DeepSpeed's stream synchronize at every fetch)."""
    offload_keep_weights: Literal["auto"] | bool = "auto"
    """ZeRO-3 with the parameters offloaded and gradient accumulation: the weights fetched at a window's first
    micro step kept on the GPU until its last instead of fetched from the host at every micro step (the
    whole model's weights in their dtype on every GPU between micro steps). auto: on a CUDA GPU where they
    leave a quarter of its memory free; true: wherever it applies (a CPU accelerator too); false (or off):
    DeepSpeed's releases."""
    offload_gil_handoff: bool = True
    """ZeRO-3 CPU offload with offload_overlap: Python's switch interval shortened so that the worker and
    the training thread hand the GIL over quickly (off: Python's 5 ms)."""

    @field_validator("offload_accumulate", "offload_keep_weights", mode="before")
    @classmethod
    def _auto_or_switch(cls, value):
        """auto, or a switch's on/off words (YAML reads `off` as false already; pydantic reads the words)."""
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("offload_grads", mode="before")
    @classmethod
    def _off_as_false(cls, value):
        """YAML reads `off` as false: the same setting."""
        if isinstance(value, bool):
            return "bf16" if value else "off"
        return value.strip().lower() if isinstance(value, str) else value


class ProfileConfig(Section):
    """torch.profiler over a few optimizer steps: a Chrome trace per profiled rank in <run dir>/profile/
    (Perfetto or chrome://tracing open it) and a summary beside it: the device's compute and copy time a
    step, how much of the copies ran under compute, the host's time waiting on the device, the top
    operators. Off unless profile.steps is set: `dstrain run --set profile.steps=2`."""

    steps: int = Field(0, ge=0)
    """Optimizer steps to profile; 0: no profiling."""
    start_after: int = Field(3, ge=0)
    """Optimizer steps this run trains before profiling starts (compilation, DeepSpeed's first fetch
    trace and the caches' warm-up stay out of the window)."""
    ranks: list[Annotated[int, Field(ge=0)]] | Literal["all"] = [0]
    """Ranks that profile: a list of global ranks, or "all"."""
    record_shapes: bool = False
    """Record each operator's input shapes (larger traces)."""
    with_stack: bool = False
    """Record the Python stack of each operator (much larger traces, slower steps)."""


class RunConfig(Section):
    """One training run. Layering (lowest to highest): schema defaults < preset < --config file
    < PL_DEEPSPEED_CONFIG_PATH < --set; see `dstrain.config.layers`."""

    preset: str | None = None
    """Preset this config builds on (a name from `dstrain presets`)."""
    model: ModelConfig = ModelConfig()
    """The model to train."""
    data: DataConfig = DataConfig()
    """The data to train on."""
    train: TrainConfig = TrainConfig()
    """The training loop."""
    preference: PreferenceConfig = PreferenceConfig()
    """Preference training's loss and reference (read when train.objective is not lm)."""
    speedups: SpeedupsConfig = SpeedupsConfig()
    """dstrain's changes to DeepSpeed's internals, each on or off (dstrain/speedups/)."""
    profile: ProfileConfig = ProfileConfig()
    """torch.profiler over a few steps (off by default)."""
    deepspeed: dict[str, Any] = {}
    """The DeepSpeed config (as in a DeepSpeed JSON); batch, precision, lr and clipping keys are
    linked to their train.* counterparts and "auto" values are filled in from the run config."""


def field_help(model: type[BaseModel], name: str) -> str:
    """The docstring of one field, for help text and error fixes."""
    info = model.model_fields[name]
    return (info.description or "").strip()
