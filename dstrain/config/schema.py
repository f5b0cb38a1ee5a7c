"""The run-config schema: every key dstrain accepts, its type, its default and its meaning.

Defaults live here and nowhere else. Every model forbids unknown keys, so a typo is an error,
never a silently ignored setting. The `deepspeed` section is kept as a raw dict here; it is
checked against DeepSpeed's own key names and models in `deepspeed_keys` / `deepspeed_models`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, NonNegativeFloat, model_validator


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # torch's Adam rejects betas outside [0, 1)


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docstrings become help text."""

    # allow_inf_nan=False: `lr: .inf` or `grad_clip: nan` is a mistake, and JSON cannot hold it.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


class ModelConfig(Section):
    name: str = "gpt"
    """Which model to train: "gpt" (the built-in GPT family) or an entry point "package.module:function"
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
    """Keyword arguments passed to a model entry point (ignored for "gpt")."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        # After all fields: n_head is declared before d_model, so a field validator would not see it.
        if self.name == "gpt" and self.d_model % self.n_head:
            raise ValueError(f"model.n_head={self.n_head} must divide model.d_model={self.d_model}")
        return self


class DataConfig(Section):
    source: str = "corpus"
    """Where tokens come from: "corpus" (the embedded real-text corpus: Python's own standard-library
    sources, byte-level), "synthetic" (random tokens, for benchmarks), "text" (files in `paths`),
    "tokens" (nanoGPT-style token files in `paths`), or an entry point "module:function" returning a Dataset."""
    paths: list[str] = []
    """Files or glob patterns for the "text" and "tokens" sources."""
    seq_len: PositiveInt = 256
    """Tokens per training sequence (also the built-in GPT's context length)."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of "tokens" files (nanoGPT writes uint16)."""
    tokenizer: str = "byte"
    """"byte" (one token per UTF-8 byte, vocab 256) or a Hugging Face tokenizer name for "text" sources."""
    eval_fraction: float = Field(0.05, gt=0.0, lt=1.0)
    """Fraction of the data held out for evaluation (taken from the end)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to a data entry point."""


class TrainConfig(Section):
    max_steps: PositiveInt = 200
    """Optimizer steps to train for."""
    micro_batch_size: PositiveInt = 8
    """Sequences per rank per forward pass (DeepSpeed's train_micro_batch_size_per_gpu)."""
    grad_accum_steps: PositiveInt = 1
    """Micro batches accumulated per optimizer step (DeepSpeed's gradient_accumulation_steps)."""
    global_batch_size: PositiveInt | None = None
    """Sequences per optimizer step over all ranks (DeepSpeed's train_batch_size);
    left unset it is micro_batch_size x grad_accum_steps x world size."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Training precision: "auto" is bf16 on a GPU that supports it, fp16 on older GPUs, fp32 on CPU."""
    mixed_precision: Literal["deepspeed", "autocast"] = "deepspeed"
    """How bf16/fp16 training runs: "deepspeed" (DeepSpeed's bf16/fp16 optimizer: low-precision weights,
    an fp32 master copy inside the optimizer) or "autocast" (fp32 weights, torch.autocast compute:
    DeepSpeed's torch_autocast section; 4 more bytes per parameter). Ignored for fp32. See docs/benchmarks.md."""
    optimizer: Literal["adamw", "adam", "lamb", "onebitadam", "onebitlamb", "zerooneadam"] = "adamw"
    """Optimizer when the deepspeed section names none; Adam/AdamW become FusedAdam on GPU
    and DeepSpeedCPUAdam when the optimizer is offloaded."""
    lr: PositiveFloat = 1e-3
    """Peak learning rate (DeepSpeed's optimizer.params.lr)."""
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
    eps: PositiveFloat = 1e-8
    """Adam epsilon."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value; 0 disables (DeepSpeed's gradient_clipping)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of storing its activations, through
    DeepSpeed's checkpointing (see deepspeed.activation_checkpointing for partition/cpu options)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the model with torch.compile (DeepSpeed's engine.compile) before training. "auto" is on
    where it was measured to help (docs/benchmarks.md): the built-in GPT in bf16 on CUDA with ZeRO
    stage 0-2, no offload and no activation checkpointing (+15% to +37% tokens/s, 40-50% less GPU
    memory, 30-50 s more to the first step until torch's compile cache is warm); off otherwise
    (ZeRO-3 measured slower compiled; set true to compile your own model)."""
    seed: int = 1234
    """Seed for model init, data order and dropout; the same seed gives the same run."""
    log_every: PositiveInt = 10
    """Log loss, lr and throughput every this many steps (console and metrics.jsonl)."""
    eval_every: PositiveInt = 100
    """Evaluate on the held-out split every this many steps, and at the end."""
    eval_batches: PositiveInt = 8
    """Global batches of held-out samples in one evaluation (the same samples whatever the world size)."""
    save_every: PositiveInt = 100
    """Save a checkpoint every this many steps, and at the end."""
    save_checkpoints: bool = True
    """false: save no checkpoint at all (not at save_every, the end or a stop signal), for throwaway
    runs such as benchmarks and memory probes, where writing the optimizer state costs minutes."""
    keep_last: PositiveInt = 2
    """Complete checkpoints to keep; older ones are deleted (never the only complete one)."""
    export_final: bool = False
    """At the end, also write consolidated weights to <run_dir>/final.safetensors."""


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
    deepspeed: dict[str, Any] = {}
    """The DeepSpeed config (as in a DeepSpeed JSON); batch, precision, lr and clipping keys are
    linked to their train.* counterparts and "auto" values are filled in from the run config."""


def field_help(model: type[BaseModel], name: str) -> str:
    """The docstring of one field, for help text and error fixes."""
    info = model.model_fields[name]
    return (info.description or "").strip()
