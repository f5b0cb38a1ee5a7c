"""train.loss_chunking through dstrain's models: the built-in GPT and `hf:` models (tiny Qwen2 with tied and
untied embeddings, Llama, GPT-2, with LoRA) give the same loss and gradients with chunking on and off, for
window batches, dict batches with labels and packed rows; architectures whose forward cannot be split
keep their own loss with a note; the config switch and its checks. fp32, tolerance 1e-5 relative."""

import pytest
import torch
import torch.nn.functional as F

from dstrain.config.resolve import resolve
from dstrain.models.gpt import GPT
from dstrain.models.hf import CausalLM, split_problem

pytest.importorskip("transformers")

VOCAB = 300  # not a multiple of the chunk


def _tiny(config_class, **settings):
    """A two-layer model of the given transformers config class, its weights seeded."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", **settings)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _qwen2(tied: bool, vocab: int = VOCAB):
    from transformers import Qwen2Config
    return _tiny(Qwen2Config, vocab_size=vocab, tie_word_embeddings=tied)


def _llama():
    from transformers import LlamaConfig
    return _tiny(LlamaConfig, vocab_size=VOCAB, tie_word_embeddings=False)


def _gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _batches():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, 20:] = -100  # padding
    packed_positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    packed_labels = labels.clone()
    packed_labels[:, 10] = -100  # each packed example's first label
    return {"window": (ids[:, :-1], ids[:, 1:]), "dict": {"input_ids": ids, "labels": labels},
            "packed": {"input_ids": ids, "labels": packed_labels, "position_ids": packed_positions}}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(model_off, model_on, batch):
    loss_off, grads_off = _loss_and_grads(model_off, batch)
    loss_on, grads_on = _loss_and_grads(model_on, batch)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, grad in grads_off.items():
        scale = grad.abs().max().clamp_min(1e-12)
        assert (grads_on[name] - grad).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("build", [lambda: _qwen2(tied=True), lambda: _qwen2(tied=False), _llama, _gpt2],
                         ids=["qwen2-tied", "qwen2-untied", "llama", "gpt2"])
def test_hf_models_give_the_same_loss_and_gradients_chunked(build):
    off = CausalLM(build(), chunking=False)
    on = CausalLM(build(), chunking=True, chunk_tokens=7)
    assert off.lm_loss is None and on.lm_loss is not None
    assert list(on.state_dict()) == list(off.state_dict())  # the same names: checkpoints and exports unchanged
    for name, batch in _batches().items():
        _same(off, on, batch)


def test_transformers_activation_checkpointing_still_applies_to_the_body():
    """train.activation_checkpointing on an hf: model is transformers' per-layer checkpointing: the body
    called alone recomputes its layers as the whole model would."""
    off = CausalLM(_qwen2(tied=True), chunking=False)
    on = CausalLM(_qwen2(tied=True), chunking=True, chunk_tokens=7)
    on.enable_checkpointing(None)
    assert on.model.is_gradient_checkpointing
    _same(off, on, _batches()["packed"])


def test_the_chunked_loss_is_transformers_own_loss():
    """A dict batch's loss is what the model's own forward with labels returns (ForCausalLMLoss)."""
    model = _qwen2(tied=True)
    batch = _batches()["dict"]
    want = model(**batch, use_cache=False).loss
    torch.testing.assert_close(CausalLM(model, chunking=True, chunk_tokens=5)(batch), want, rtol=1e-5, atol=0)


def test_lora_models_give_the_same_loss_and_adapter_gradients():
    from dstrain.config.schema import LoraConfig
    from dstrain.models.hf import apply_lora
    lora = LoraConfig(r=4, target_modules="all-linear")
    off = CausalLM(apply_lora(_qwen2(tied=True), lora), chunking=False)
    on = CausalLM(apply_lora(_qwen2(tied=True), lora), chunking=True, chunk_tokens=9)
    assert on.lm_loss is not None and not on.lm_loss.head.weight.requires_grad  # the frozen, tied head
    _same(off, on, _batches()["dict"])


def test_a_lora_head_or_an_unsplittable_forward_keeps_the_models_own_loss():
    from transformers import AutoModelForCausalLM, Gemma2Config

    from dstrain.config.schema import LoraConfig
    from dstrain.models.hf import apply_lora
    lora_head = CausalLM(apply_lora(_qwen2(tied=False), LoraConfig(r=4, target_modules=["q_proj", "lm_head"])),
                         chunking=True)
    assert lora_head.lm_loss is None and "not a plain Linear" in lora_head.loss_note
    gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    assert "does more than" in split_problem(gemma2)  # its logit soft-capping
    model = CausalLM(gemma2, chunking=True)
    assert model.lm_loss is None and model.loss_note.startswith("train.loss_chunking: Gemma2ForCausalLM:")
    assert torch.isfinite(model(_batches()["dict"]))  # trains on with the whole logits


def test_auto_chunks_large_vocabularies_only():
    assert CausalLM(_qwen2(tied=True), chunking="auto").lm_loss is None  # 300 tokens
    assert CausalLM(_qwen2(tied=True, vocab=40_000), chunking="auto").lm_loss is not None


def test_the_built_in_gpt_gives_the_same_loss_and_gradients_chunked():
    torch.manual_seed(0)
    off = GPT(VOCAB, 24, 32, 2, 4)
    torch.manual_seed(0)
    on = GPT(VOCAB, 24, 32, 2, 4, loss_chunk=5)
    assert list(on.state_dict()) == list(off.state_dict())
    batches = _batches()
    _same(off, on, batches["window"])
    _same(off, on, {"input_ids": batches["dict"]["input_ids"], "labels": batches["dict"]["labels"]})
    _same(off, on, batches["packed"])


@pytest.mark.parametrize("sets, expected, note", [
    # auto is off below 16,384 tokens a sequence: on one H100 the chunked loss was 0.93-0.97x as fast for
    # 10-23% less peak memory at 2,048; from there on, the whole logits cost gigabytes a rank
    (["model.vocab_size=50304"], False, "auto: off under 16,384 tokens a sequence (measured 0.93-0.97x"),
    (["model.vocab_size=50304", "data.seq_len=16384"], True, "auto: on (16,384 tokens a sequence >= 16,384"),
    (["model.vocab_size=50304", "data.seq_len=32768", "train.precision=fp16"], False, "fp16"),
    (["model.vocab_size=50304", "data.seq_len=32768", "train.loss_chunking=false"], False, None),
    (["model.vocab_size=50304", "train.loss_chunking=true"], True, None),
    (["model.vocab_size=50304", "train.loss_chunking=false"], False, None),
    (["model.name=hf:/nowhere"], False, "set true where memory binds"),
])
def test_auto_is_decided_and_explained(sets, expected, note):
    resolved = resolve(None, None, sets, world_size=1, accelerator="cpu")
    assert resolved.config.train.loss_chunking == expected
    if note:
        assert note in resolved.sources["train.loss_chunking"]


def test_true_on_your_own_model_is_an_error_naming_the_key():
    from dstrain.errors import UserError
    with pytest.raises(UserError) as err:
        resolve(None, None, ["model.name=my_pkg.models:build", "train.loss_chunking=true"], world_size=1,
                accelerator="cpu")
    problem = err.value.problems[0]
    assert "train.loss_chunking" in problem.where and "chunked_cross_entropy" in problem.fix


def test_dstrain_run_decides_auto_for_an_hf_model_before_the_ranks_start(tmp_path):
    """The pre-launch check builds the model on the meta device: a Llama asked for chunking chunks, and a
    Gemma 2 (soft-capped logits) asked for it keeps its own loss, with one note."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from hf_models import save_tiny_llama
    from dstrain.launcher.preflight import check_runtime

    def checked(model_dir, *sets):
        resolved = resolve(None, None, [f"model.name=hf:{model_dir}", "data.source=synthetic", "data.seq_len=32",
                                        *sets], world_size=1, accelerator="cpu")
        check_runtime(resolved)
        return resolved

    large = checked(save_tiny_llama(tmp_path / "llama", vocab_size=40_000), "train.loss_chunking=true")
    assert large.config.train.loss_chunking is True
    assert "train.loss_chunking" not in " ".join(large.warnings)
    default = checked(save_tiny_llama(tmp_path / "default", vocab_size=40_000))
    assert default.config.train.loss_chunking is False
    gemma_dir = tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16)).save_pretrained(gemma_dir)
    gemma = checked(gemma_dir, "train.loss_chunking=true")
    assert gemma.config.train.loss_chunking is False
    assert [w for w in gemma.warnings if w.startswith("train.loss_chunking: Gemma2ForCausalLM:")]
    # auto's long-sequence rule on a model that cannot split: off for this model, quietly, and said why
    long = checked(gemma_dir, "data.seq_len=16384")
    assert long.config.train.loss_chunking is False
    assert not [w for w in long.warnings if "train.loss_chunking" in w]
    assert long.sources["train.loss_chunking"].startswith("auto: off for this model (Gemma2ForCausalLM:")
    llama_long = checked(save_tiny_llama(tmp_path / "small-vocab"), "data.seq_len=16384")  # any vocabulary
    assert llama_long.config.train.loss_chunking is True


def test_fp16_keeps_the_whole_logits():
    """fp16's loss scale multiplies the gradients in backward, after the chunked loss has formed them in
    the forward: auto is off, and true is an error naming the key and the fix."""
    from dstrain.errors import UserError
    resolved = resolve(None, None, ["model.vocab_size=50304", "train.precision=fp16"], world_size=1, accelerator="cuda")
    assert resolved.config.train.loss_chunking is False and "fp16" in resolved.sources["train.loss_chunking"]
    with pytest.raises(UserError) as err:
        resolve(None, None, ["train.precision=fp16", "train.loss_chunking=true"], world_size=1, accelerator="cuda")
    problem = err.value.problems[0]
    assert "train.loss_chunking" in problem.where and "train.precision=bf16" in problem.fix


def test_the_forward_of_transformers_5_1x_slicing_in_the_heads_call_still_splits():
    """transformers 5.17 (the GPU image's) writes `logits = self.lm_head(hidden_states[:, slice_indices, :])`
    after computing slice_indices, where 5.2x slices the hidden states first; both are the plain form."""
    from transformers import Qwen2ForCausalLM

    class Qwen2Of517(Qwen2ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)

            hidden_states = outputs.last_hidden_state
            # Only compute necessary logits
            slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, slice_indices, :])

            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

            return (loss, logits)

    model = Qwen2Of517(_qwen2(tied=False).config)
    assert split_problem(model) is None



def test_under_sequence_parallelism_the_chunked_loss_gives_the_groups_loss_and_gradients(tmp_path):
    """The sequence-parallel loss sums each rank's share of the tokens over its group: chunked (the sum
    reduction of the chunked loss) and whole logits agree, here in a group of one gloo rank."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        batch = _batches()["dict"]
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        shard = {"input_ids": batch["input_ids"], "shift_labels": labels}
        models = []
        for chunking in (False, True):
            model = CausalLM(_qwen2(tied=True), chunking=chunking, chunk_tokens=5)
            model.sequence_group = dist.group.WORLD
            models.append(model)
        assert models[1].lm_loss is not None
        losses = []
        for model in models:
            loss = model(shard)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
        for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()
