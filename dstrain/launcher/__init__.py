"""The launcher side: what runs in the `dstrain run` / `dstrain eval` process, before and around the ranks.

options.py (the command line as one value) -> topology.py (nodes, ranks, hosts, port) -> preflight.py
(checks that need torch/DeepSpeed) -> run_directory.py (the files the ranks read) -> runner.py (the
deepspeed runner command and rank environment) -> supervise.py (signals, failures); job.py ties them
together for `dstrain run`, eval_job.py for `dstrain eval`. Nothing here runs inside a rank, and
nothing here builds a DeepSpeed engine: what the ranks need crosses over as files (dstrain/rundir.py).
"""
