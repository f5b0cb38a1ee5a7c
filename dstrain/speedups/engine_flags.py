"""DeepSpeed engine settings dstrain changes after the engine is built, where DeepSpeed has no public
setter. Not a speed-up (nothing here is in the registry), but a write to a private name, so it lives in
the quarantine with the rest."""

from __future__ import annotations


def stop_loading_universal_checkpoints(engine) -> None:
    """Load the engine's next checkpoints as its own, not as universal ones: a run that started from a
    universal checkpoint (another world size) saves ordinary ones, which a rollback then loads."""
    engine._config.load_universal_checkpoint = False
