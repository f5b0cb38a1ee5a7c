"""DeepSpeed's universal checkpoint (`ds_to_universal`), used to resume with another number of ranks.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


from dstrain.errors import UserError
from dstrain.tools.convert.reader import open_checkpoint
from dstrain.tools.convert.writer import write_text_atomically


def to_universal(checkpoint_dir: Path, output_dir: Path, *, tag: str | None = None, force: bool = False) -> Path:
    """Convert a ZeRO checkpoint into a DeepSpeed universal checkpoint; return OUTPUT_DIR.

    Writes OUTPUT_DIR/<tag>/ (through DeepSpeed's `ds_to_universal`) and
    OUTPUT_DIR/latest_universal. A run with any number of ranks resumes from it with
    `{"checkpoint": {"load_universal": true}}` in the DeepSpeed config and
    `engine.load_checkpoint(OUTPUT_DIR)`. Needs ZeRO stage 1, 2 or 3.

    DeepSpeed (0.19) restores only the optimizer's parameters from a universal checkpoint:
    buffers and frozen parameters keep the values the new model was built with.
    """
    from deepspeed.checkpoint import ds_to_universal

    checkpoint = open_checkpoint(Path(checkpoint_dir), tag)
    if checkpoint.stage == 0:
        raise UserError.single(
            "universal checkpoints are made from ZeRO optimizer shards, and this is a stage 0 checkpoint",
            where=str(checkpoint.tag_dir),
            fix="stage 0 weights need no reshaping: load the checkpoint with any number of ranks, "
            "or export the weights with convert_checkpoint",
        )
    output_dir = Path(output_dir)
    target = output_dir / checkpoint.tag
    if target.exists() and not force:
        raise UserError.single(f"{target} already exists", where=str(target), fix="pass force=True to replace it")

    output_dir.mkdir(parents=True, exist_ok=True)
    # DeepSpeed writes the tag directory plus `latest_universal` next to it: let it do so in
    # a staging directory, then move the finished result in place.
    staging = Path(tempfile.mkdtemp(dir=output_dir, prefix=f".{checkpoint.tag}.", suffix=".tmp"))
    try:
        args = _universal_args(checkpoint.tag_dir, staging / checkpoint.tag)
        try:
            ds_to_universal.main(args)
        except Exception as error:  # DeepSpeed signals unsupported layouts with assorted exceptions
            raise UserError.single(
                f"DeepSpeed's ds_to_universal failed: {type(error).__name__}: {error}",
                where=str(checkpoint.tag_dir),
                fix="check that the checkpoint was saved by a plain ZeRO run (no pipeline/tensor parallelism)",
            ) from error
        if target.exists():
            shutil.rmtree(target)
        (staging / checkpoint.tag).rename(target)
        write_text_atomically(output_dir / "latest_universal", checkpoint.tag)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output_dir


def _universal_args(input_folder: Path, output_folder: Path):
    """The arguments ds_to_universal's command line would build."""
    import argparse

    return argparse.Namespace(
        input_folder=str(input_folder),
        output_folder=str(output_folder),
        num_extract_workers=1,  # in-process and serial: no worker processes to outlive a failure
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # Plain models carry no universal_checkpoint_info; DeepSpeed then needs it injected.
        inject_missing_state=True,
    )
