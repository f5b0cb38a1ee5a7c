"""preference.reference precomputed (DPO, dstrain.rank.precomputed): each pair's reference log-prob sums
computed once by the run's ranks with the starting weights, cached under data.cache_dir, carried by the batch.
One rank with a real deepspeed.initialize (both parameter sets in one process): the precomputed sums equal
transformers' own log-probs of the starting model, the DPO loss after a step equals the one against a live
frozen copy, and a second attach reads the cache file instead of computing again."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

TESTS = Path(__file__).parent


# Padded rows at ZeRO-2; packed rows at ZeRO-3.
CASES = [("false", "stage2"), ("true", "stage3")]


@pytest.fixture(scope="module")
def precomputed_runs(tmp_path_factory) -> dict:
    """Both CASES on one rank, one start-up: for each, in turn, its own engine and its own cache folder
    (so that each computes its reference first and then reads it back). Keyed by "packing-preset"."""
    from hf_models import save_tiny_llama
    from one_rank import run_one_rank
    from preference_data import write_zen_pairs
    tmp_path = tmp_path_factory.mktemp("precomputed")
    llama = save_tiny_llama(tmp_path / "llama")
    pairs = write_zen_pairs(tmp_path / "pairs.jsonl")
    cases = [{"packing": packing, "preset": preset, "cache": str(tmp_path / f"cache-{packing}-{preset}")}
             for packing, preset in CASES]
    return run_one_rank(f"""
        sys.path.insert(0, {str(TESTS)!r})
        import numpy as np
        import transformers
        from dstrain.config.resolve import resolve
        from dstrain.data import build_samplers
        from dstrain.models import build_model
        from dstrain.models import preference_loss as pl
        from dstrain.rank.precomputed import attach_reference, cache_path
        from dstrain.rank.preference import build_reference, rng_state
        from dstrain.rank.runtime import initialize_engine, seed_everything
        from dstrain import speedups

        def run(packing, preset, cache):
            sets = ["train.objective=dpo", "data.format=preference", "data.source=jsonl", "data.paths=[{pairs}]",
                    "data.tokenizer=byte", f"data.cache_dir={{cache}}", "data.seq_len=96", f"data.packing={{packing}}",
                    "model.name=hf:{llama}", "train.micro_batch_size=2", "train.lr=0.05", "train.warmup_steps=0",
                    "train.schedule=constant", "train.activation_checkpointing=false", "preference.beta=0.5",
                    "preference.reference=precomputed"]
            resolved = resolve(preset, None, sets, world_size=1, accelerator="cpu", env={{}})
            config, ds_config = resolved.config, resolved.ds_config
            seed_everything(config.train.seed)
            train, held_out = build_samplers(config)
            policy_rng = rng_state()
            model = build_model(config, ds_config, torch.device("cpu"))
            engine = initialize_engine(model, ds_config, config.speedups)
            speedups.apply(engine, config.speedups)  # as the worker: at stage 3 some module hooks are gone after it
            said = attach_reference(engine, config, ds_config, (train, held_out), torch.device("cpu"))
            path = cache_path(config, ds_config)
            mtime = path.stat().st_mtime_ns

            # the sums against transformers' own whole logits of the starting model (one example a row)
            causal = transformers.AutoModelForCausalLM.from_pretrained("{llama}", dtype=torch.float32).eval()
            batch = train.batch(0, 2)
            targets, segments = model.preference.targets_of(batch)
            with torch.no_grad():
                logits = causal(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            logps = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            sums, _ = pl.segment_logps(torch.where(targets != -100, logps, 0.0), segments, len(batch["desirable"]))
            P = len(batch["margin"])
            sums_gap = max((batch["ref_chosen"] - sums[:P]).abs().max().item(),
                           (batch["ref_rejected"] - sums[P:]).abs().max().item())

            engine.train()
            first = engine(batch)
            engine.backward(first)
            engine.step()
            later = train.batch(2, 2)
            with torch.no_grad():
                precomputed_loss = engine(later).item()
                model.preference.mode = "model"  # the same batch against a live frozen copy of the start
                model.preference.reference = build_reference(config, ds_config, torch.device("cpu"), policy_rng)
                live_loss = engine(later).item()
                model.preference.mode = "precomputed"

            # a later run (new samplers): the cache is read, not computed again
            train2, held2 = build_samplers(config)
            said2 = attach_reference(engine, config, ds_config, (train2, held2), torch.device("cpu"))
            return {{"said": said, "said2": said2, "same_mtime": path.stat().st_mtime_ns == mtime,
                     "same_values": bool(np.array_equal(train2.layout.reference, train.layout.reference)),
                     "pairs": int(len(train.layout.reference)), "eval_pairs": int(held_out.layout.count),
                     "sums_gap": sums_gap, "first": first.item(), "precomputed": precomputed_loss,
                     "live": live_loss, "eval_has_ref": "ref_chosen" in held_out.batch(0, 1)}}

        result({{case["packing"] + "-" + case["preset"]: run(**case) for case in {cases!r}}})
    """, timeout=600)


@pytest.mark.integration
@pytest.mark.parametrize("packing, preset", CASES)
def test_precomputed_reference_matches_the_live_one_and_is_read_back_from_its_cache(precomputed_runs, packing, preset):
    """Reads `precomputed_runs`' case for these parameters (both cases share its one-rank process).
    Padded rows: the sums also against transformers' plain forward (packed rows need dstrain's masks).
    Stage 3: the pass gathers the partitions as it goes (through the model's forward, as dstrain's module-hook
    speed-up leaves it; a direct call found the embedding partitioned on 2026-11-28's GPU run); the live copy
    is a second engine."""
    out = precomputed_runs[f"{packing}-{preset}"]
    assert "computed with the starting weights" in out["said"] and "read from" in out["said2"]
    assert out["same_mtime"] and out["same_values"] and out["eval_has_ref"]
    if packing == "false":
        assert out["sums_gap"] < 1e-4
    assert out["first"] == pytest.approx(0.6931472, abs=1e-5)  # policy == its precomputed reference
    assert out["precomputed"] == pytest.approx(out["live"], rel=1e-5)
    assert out["precomputed"] != pytest.approx(out["first"], abs=1e-4)  # the step moved the policy
