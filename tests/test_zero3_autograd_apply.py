"""dstrain/speedups/zero3_autograd_apply.py: DeepSpeed's ZeRO-3 autograd Functions (its linear, the module
hooks' backward Functions) applied without torch's per-call signature binding train to the same bits as
with torch's apply, the parameters on the device or offloaded (one rank in a subprocess:
tests/scripts/zero3_autograd_apply.py)."""

from __future__ import annotations

import pytest

from one_rank import run_script

pytestmark = pytest.mark.integration


def test_deepspeeds_functions_applied_without_binding_train_as_with_torchs_apply():
    out = run_script("zero3_autograd_apply", {"steps": 3})
    for place in ("device", "offload"):
        ours, theirs = out[f"dstrain-{place}"], out[f"deepspeed-{place}"]
        assert ours["applied"] is True and theirs["applied"] is None, place
        # the linear and each hooked module's two Functions (3 blocks x 4 modules + the head + the model)
        assert ours["calls"]["classes"] == ours["calls"]["lean_classes"] >= 1 + 2 * 14, (place, ours["calls"])
        assert ours["linear_wrapped"] is True, place
        assert ours["calls"]["torch"] == 0, place  # DeepSpeed gives every argument by position
        assert len(ours["losses"]) == 6 and ours["losses"] == theirs["losses"], place
        assert ours["losses"][-1] != ours["losses"][0], place  # it trained
        assert ours["weights"] == theirs["weights"], place
