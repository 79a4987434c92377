"""The embedded default model set, shipped inside the package (so a wheel install has it): a small trained Glimmer
target, its DFlash drafter and MTP layer, in `glimmer-tiny`, `glimmer-tiny-dflash`, `glimmer-tiny-mtp` next to this
file (built by `embedded/build_embedded.py` in the source tree). Every command that takes `--model` falls back to it."""

from __future__ import annotations

import sys
from pathlib import Path

EMBEDDED = "glimmer-tiny"
DEFAULT_DFLASH = "dflash2"  # the part a command without --draft-model uses as its DFlash drafter (the best one built)


def models_dir() -> Path:
    """The folder holding the embedded model set (package data)."""
    return Path(__file__).resolve().parent


def embedded_path(part: str = "target") -> Path:
    """part: "target" | "dflash" (v1) | "dflash2" | "mtp"."""
    names = {"target": EMBEDDED, "dflash": f"{EMBEDDED}-dflash", "dflash2": f"{EMBEDDED}-dflash2",
             "mtp": f"{EMBEDDED}-mtp"}
    if part not in names:
        raise ValueError(f"unknown embedded part {part!r}; one of {sorted(names)}")
    path = models_dir() / names[part]
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"the embedded model is missing: {path} has no config.json. It ships in the package (glimmer_mlx/embedded; "
            f"rebuild it with `python embedded/build_embedded.py` in a source checkout); or pass --model.")
    return path


def default_dflash() -> Path:
    """The embedded default DFlash drafter's folder (`DEFAULT_DFLASH`)."""
    return embedded_path(DEFAULT_DFLASH)


_announced: set[str] = set()


def resolve_model(model: str | None, part: str = "target", announce=None) -> str:
    """`model` if given, else the embedded model's folder (announced once per process on stderr)."""
    if model is not None:
        return model
    path = embedded_path(part)
    if part not in _announced:
        _announced.add(part)
        msg = f"no --model given: using the embedded {part} {path}"
        (announce or (lambda m: print(m, file=sys.stderr)))(msg)
    return str(path)
