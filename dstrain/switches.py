"""The DSTRAIN_* environment switches, read one way by the launcher and the ranks: 0/off/false/no
turns one off, 1/on/true/yes turns one on, anything else (or unset) leaves its default."""

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


def number_or_switch(env: Mapping[str, str], name: str, default: int) -> int:
    """A DSTRAIN_* switch that also takes a number (for tuning): 0 where it is off (0/off/false/no), the
    number where one larger than 1 is given, `default` where it is unset or on."""
    if switched_off(env, name):
        return 0
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 1 else default
