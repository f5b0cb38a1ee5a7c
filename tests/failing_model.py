"""A model entry point for launcher tests of a failed run: the built-in GPT, whose forward raises on
rank 1 at its second call, as a user's model bug would (nothing dstrain checks before the ranks start).

Config: model.name=failing_model:build, with tests/ on PYTHONPATH.
"""

from __future__ import annotations

import os

from dstrain.models.gpt import GPT


class FailingGPT(GPT):
    calls = 0

    def forward(self, *args, **kwargs):
        FailingGPT.calls += 1
        if os.environ.get("RANK") == "1" and FailingGPT.calls == 2:
            raise ValueError("shapes (4, 32) and (16, 32) do not align: the user's model has a bug")
        return super().forward(*args, **kwargs)


def build(**gpt_kwargs) -> GPT:
    return FailingGPT(**gpt_kwargs)
