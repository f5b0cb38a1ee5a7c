"""The shipped presets: YAML files installed as the package data `dstrain.presets`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dstrain.errors import UserError

# Fastest first, as measured (docs/benchmarks.md): each step down trades speed for memory, and
# `dstrain estimate` / `--preset auto` take the first that fits. stage3 before stage2_offload: where
# stage 1/2 do not fit, stage 3 ran 0.61-0.89 of plain PyTorch on one GPU against stage2_offload's 0.28-0.35.
PRESET_ORDER = ("stage1", "stage2", "stage3", "stage2_offload", "stage3_offload", "stage3_nvme")


def presets_dir() -> Path:
    """Where the preset YAML files are: the installed package data, or presets/ of a source checkout
    (an editable install maps only the top-level package, so `dstrain.presets` is not importable there)."""
    try:
        files = resources.files("dstrain.presets")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "presets"
    # A folder without __init__.py (presets/ linked into a checkout as dstrain/presets) is a namespace
    # package: importlib gives a MultiplexedPath, whose str() is its repr, not a path.
    return files if isinstance(files, Path) else Path(str(files.joinpath(PRESET_ORDER[0] + ".yaml"))).parent


def normalize(name: str) -> str:
    """Preset names accept '-' or '_' and any case: 'Stage3-NVMe' -> 'stage3_nvme'."""
    return name.strip().lower().replace("-", "_")


def available() -> list[str]:
    names = {p.stem for p in presets_dir().glob("*.yaml")}
    return [n for n in PRESET_ORDER if n in names] + sorted(names - set(PRESET_ORDER))


def preset_path(name: str, where: str = "--preset") -> Path:
    """The file of a preset, or a UserError listing the valid names."""
    path = presets_dir() / f"{normalize(name)}.yaml"
    if not path.is_file():
        from dstrain.config.deepspeed_keys import suggest
        hint = suggest(normalize(name), available())
        raise UserError.single(f"unknown preset {name!r}" + (f"; {hint}" if hint else ""), where,
                               "choose one of: " + ", ".join(available()) + " (see `dstrain presets`)")
    return path


def description(name: str) -> str:
    """The preset's first comment line: what it is and what it trades."""
    for line in preset_path(name).read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").split(" — ", 1)[-1].strip()
    return ""
