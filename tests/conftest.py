"""Shared test setup: tests import their helpers (tests/launcher.py) by module name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
