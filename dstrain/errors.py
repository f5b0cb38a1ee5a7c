"""User-facing errors: bad input is reported, never raised as a traceback.

`UserError` carries one or more problems. The CLI prints them and exits with code 2
(`EXIT_BAD_INPUT`). Internal invariants use `assert`; everything a user can get wrong
raises `UserError` with what is wrong, where (file and key path) and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXIT_BAD_INPUT = 2


@dataclass
class Problem:
    """One thing wrong with the user's input."""

    message: str
    where: str = ""  # file and/or dotted key path, e.g. "run.yaml: train.lr"
    fix: str = ""

    def render(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


@dataclass
class UserError(Exception):
    """Bad user input: one or more problems, reported together."""

    problems: list[Problem] = field(default_factory=list)

    @classmethod
    def single(cls, message: str, where: str = "", fix: str = "") -> "UserError":
        return cls([Problem(message, where, fix)])

    def __str__(self) -> str:
        count = len(self.problems)
        head = "1 problem" if count == 1 else f"{count} problems"
        return head + ":\n" + "\n".join("  - " + p.render() for p in self.problems)


def require_package(module: str, where: str, extra: str):
    """Import an optional dependency, or a UserError naming it and the dstrain extra that installs it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UserError.single(f"{package} is not installed", where,
                               f"pip install 'dstrain[{extra}]' (or {package})") from None
