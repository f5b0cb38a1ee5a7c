"""`dstrain estimate`: memory.py models GPU, host and NVMe bytes per preset (pure arithmetic, no torch
at import); planner.py resolves every preset for one run config and picks the fastest that fits
(also behind `dstrain run --preset auto`)."""
