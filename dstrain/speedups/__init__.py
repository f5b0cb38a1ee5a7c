"""dstrain's changes to DeepSpeed's internals, quarantined: the only package that replaces DeepSpeed's
methods or reads its private names (tests/test_architecture.py keeps it so).

Each change is registered once in registry.py (name, what it replaces, its switch in the config's
`speedups:` section, its prerequisites, the DeepSpeed versions it was verified on). A rank uses two
entry points: `building_engine(settings)` around deepspeed.initialize and `apply(engine, settings)` after
it; rank 0 prints `apply`'s report. On a DeepSpeed outside the verified versions nothing is changed and
one warning says so. Measurements of what each change gains are in docs/performance.md, by its name.
"""

from dstrain.speedups.registry import REGISTRY, VERIFIED, Report, apply, building_engine
from dstrain.speedups.state import SpeedupState, state_of

__all__ = ["REGISTRY", "VERIFIED", "Report", "SpeedupState", "apply", "building_engine", "state_of"]
