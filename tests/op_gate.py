"""The session's op build gate: a test that starts ranks waits here until the background op build
(scripts/build_ops.py, started by tests/conftest.py) has built what its ranks load, instead of building an op
itself. On 2 busy cores one op takes minutes; a rank killed by a test's timeout in the middle of a build leaves
torch's lock file behind, and every later rank waits on that lock forever. With the gate, only the build
script builds, and nothing ever kills it."""

from __future__ import annotations

import os
import time
from pathlib import Path

# Set by tests/conftest.py when the session starts a build: the path prefix of its gate files.
GATE_ENV = "DSTRAIN_TESTS_OPS_GATE"
BASE = ".base"   # the comm op and the Adams: every CPU rank
NVME = ".nvme"   # async_io, after the rest: the NVMe offload tests
_WAITED = {"seconds": 0.0}


def open_gate(prefix: str, part: str, said: str) -> None:
    """Written by the build script when `part` is built (or could not be)."""
    Path(prefix + part).write_text(said)


def wait_for_ops(nvme: bool = False, timeout: float = 3600) -> None:
    """Block until this session's build has the ops ready (nothing to wait for without a build)."""
    prefix = os.environ.get(GATE_ENV)
    if not prefix:
        return
    gate = Path(prefix + (NVME if nvme else BASE))
    started = time.monotonic()
    while not gate.exists() and time.monotonic() - started < timeout:
        time.sleep(0.5)
    _WAITED["seconds"] += time.monotonic() - started


def waited_seconds() -> float:
    return _WAITED["seconds"]
