"""The rank side: what runs inside each process the deepspeed launcher starts.

worker.py (the entry point: `python -m dstrain.rank.worker RUN_DIR`) -> runtime.py (process group,
device, seeds) -> loop.py (the train loop) with evaluation.py (held-out loss), checkpointing.py
(saving) and metrics.py (metrics.jsonl and the console), which feeds trackers.py (train.log_to:
TensorBoard, W&B, CSV). Everything a rank knows comes from the run
directory (dstrain/rundir.py); nothing here parses flags or starts processes.
"""
