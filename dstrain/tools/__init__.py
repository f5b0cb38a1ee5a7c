"""Offline tools, each its own command and process: convert/ (`dstrain convert-checkpoint`), estimate/
(`dstrain estimate` and the `--preset auto` planner), doctor.py (`dstrain doctor`),
report.py (`dstrain report`: curves and a summary from metrics.jsonl). They read run
directories and checkpoints from disk; they never start ranks.
"""
