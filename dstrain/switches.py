"""How a DSTRAIN_* environment switch reads, in the `dstrain` command (never in a rank: the speed-up
switches become the config's `speedups:` keys, dstrain/config/layers.py): 0/off/false/no turns one off,
1/on/true/yes turns one on, anything else (or unset) leaves its default."""

from __future__ import annotations

from collections.abc import Mapping

OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


def switch(env: Mapping[str, str], name: str) -> bool | None:
    """True or False where `name` is set on or off; None where it is unset (or neither)."""
    value = env.get(name, "").strip().lower()
    return True if value in ON else False if value in OFF else None


def switched_off(env: Mapping[str, str], name: str) -> bool:
    """A switch that is on by default, set off."""
    return switch(env, name) is False
