"""Run as a script (one process, a one-rank gloo group): for each model family, save a tiny random model,
load it through dstrain's ZeRO-3 path (zero.Init + one tensor at a time) and export it with the hf folder
writer; print one JSON line per family with the largest differences from transformers' from_pretrained.
Used by tests/test_hf.py (a subprocess keeps the process group out of the test session)."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from dstrain.config.schema import RunConfig  # noqa: E402
from dstrain.models import hf  # noqa: E402
from dstrain.rank.runtime import end_rank  # noqa: E402
from dstrain.tools.convert.hf_folder import folder_from_weights  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),  # biases on q/k/v
    "gemma": lambda: transformers.GemmaConfig(**SHAPE, head_dim=8),  # tied head
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=64),  # saved as embed_out
}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    inputs = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    for name, make in FAMILIES.items():
        folder = Path(tempfile.mkdtemp())
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(make()).save_pretrained(folder)
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        config = RunConfig.model_validate({"model": {"name": f"hf:{folder}"}})
        model = hf.build_pretrained(config, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
                                    torch.device("cpu")).eval()
        with torch.no_grad(), deepspeed.zero.GatheredParameters(list(model.parameters())):
            loaded = (model.model(input_ids=inputs).logits - reference(input_ids=inputs).logits).abs().max().item()
            save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, folder / "trained.safetensors")
        source = folder / "hf_source"
        source.mkdir()
        shutil.copy(folder / "config.json", source)
        folder_from_weights(folder / "trained.safetensors", source, folder / "exported")
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(folder / "exported", output_loading_info=True)
        with torch.no_grad():
            round_trip = (exported(input_ids=inputs).logits - reference(input_ids=inputs).logits).abs().max().item()
        print(json.dumps({"family": name, "loaded": loaded, "exported": round_trip,
                          "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}))


if __name__ == "__main__":
    main()
    end_rank()  # as dstrain's ranks end: the test reads the exit code
