"""`dstrain generate` prints exactly what transformers' own greedy `generate` gives on the same folder:
a model folder, a chat turn (the tokenizer's template), turns from stdin, and a peft adapter folder on
its base model; bad input is exit 2 with the fix. (A run directory: tests/test_hf_runs.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hf_models import save_tiny_llama
from tiny_tokenizer import build_tokenizer

from dstrain.cli import app

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with a real BPE tokenizer (vocabulary 320) and a ChatML template."""
    return build_tokenizer(save_tiny_llama(tmp_path_factory.mktemp("llama") / "model", seed=3, vocab_size=320))


def generate(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["generate", *args], input=stdin)
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout, result.output


def greedy(model, tokenizer, input_ids, new: int) -> str:
    """transformers' own greedy decoding, the reference."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)


def reference(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def test_a_prompt_is_completed_as_transformers_greedy_generate_completes_it(model_dir):
    code, stdout, output = generate(str(model_dir), "--prompt", PROMPT, "--max-new-tokens", "12")
    assert code == 0, output
    model, tokenizer = reference(model_dir)
    expected = greedy(model, tokenizer, tokenizer(PROMPT, return_tensors="pt")["input_ids"], 12)
    assert expected and stdout == expected + "\n"


def test_chat_renders_the_turns_with_the_tokenizers_template(model_dir):
    model, tokenizer = reference(model_dir)

    def turn(messages):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        return greedy(model, tokenizer, ids, 6)

    code, stdout, output = generate(str(model_dir), "--chat", "--prompt", "Name three colours.",
                                    "--max-new-tokens", "6")
    assert code == 0, output
    assert stdout == turn([{"role": "user", "content": "Name three colours."}]) + "\n"

    code, stdout, output = generate(str(model_dir), "--chat", "--max-new-tokens", "6",
                                    stdin="What is the capital?\nAnd of France?\n\nnot read\n")
    assert code == 0, output
    first = turn([{"role": "user", "content": "What is the capital?"}])
    second = turn([{"role": "user", "content": "What is the capital?"}, {"role": "assistant", "content": first},
                   {"role": "user", "content": "And of France?"}])
    assert stdout == f"{first}\n{second}\n"


def test_an_adapter_folder_is_loaded_on_its_base_model(model_dir, tmp_path):
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # trained: the adapters change the output
    adapted.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)

    code, stdout, output = generate(str(tmp_path / "adapter"), "--prompt", PROMPT, "--max-new-tokens", "12")
    assert code == 0, output
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert stdout == greedy(adapted.eval(), tokenizer, ids, 12) + "\n"
    assert stdout != greedy(reference(model_dir)[0], tokenizer, ids, 12) + "\n"


def test_bad_input_is_exit_2_with_the_fix(model_dir, tmp_path):
    code, _, output = generate(str(model_dir))
    assert code == 2 and "--prompt: nothing to complete" in output
    code, _, output = generate(str(tmp_path), "--prompt", "x")
    assert code == 2 and "holds no config.json, adapter_config.json or run files" in " ".join(output.split())
    no_template = build_tokenizer(save_tiny_llama(tmp_path / "plain", vocab_size=320), chat_template=None)
    code, _, output = generate(str(no_template), "--chat", "--prompt", "hi")
    assert code == 2 and "--chat: the tokenizer has no chat template" in " ".join(output.split())
