"""Drafter heads shipped inside the package (peagle/heads/<name>), the speculative config that serves the embedded
target with one, and how a speculative config names a head."""
from __future__ import annotations

import json
from pathlib import Path

from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from peagle.model.identity import is_embedded_model

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# The bundled heads for the embedded SmolLM2-135M-Instruct target.
DEFAULT_HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
# config.json key of a head with random weights (checkpoint.random_head sets it), so reports can say so.
UNTRAINED_KEY = "peagle_untrained"


def embedded_speculative_config() -> SpeculativeConfig:
    """The hybrid of the bundled P-EAGLE head at the default K and suffix trees (docs/design.md, "Decoding step"):
    the embedded preset of `peagle models`, and every command's default for the embedded weights in any format."""
    return SpeculativeConfig.hybrid(DEFAULT_HEADS["peagle"], DEFAULT_NUM_SPECULATIVE_TOKENS)


def bundled_heads() -> list[str]:
    return sorted(p.name for p in HEADS_DIR.glob("*") if (p / "config.json").exists()) if HEADS_DIR.exists() else []


def drafts_in_parallel(head_dir: str | Path) -> bool:
    """Whether a head folder holds a P-EAGLE head (its config names a mask token), read without loading it."""
    try:
        return json.loads((Path(head_dir) / "config.json").read_text()).get("mask_token_id") is not None
    except (OSError, ValueError):
        return False


def is_untrained(head_dir: str | Path) -> bool:
    """Whether a head folder holds random weights (`peagle export --random-init`, `peagle bench --random-heads`)."""
    try:
        return bool(json.loads((Path(head_dir) / "config.json").read_text()).get(UNTRAINED_KEY))
    except (OSError, ValueError):
        return False


def resolve_head(name: str | None, target: str | None = None, method: str = "peagle") -> Path:
    """A head folder: a path, a bundled head name, or None for the bundled default of the embedded target (in any of
    its formats: peagle.model.identity)."""
    if name is None:
        if not is_embedded_model(target):
            raise FileNotFoundError("the speculative config names no head (\"model\"): give the folder of a head "
                                    "trained for this target (`peagle train`, or `peagle export --random-init`)")
        name = DEFAULT_HEADS[method]
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if (HEADS_DIR / name / "config.json").exists():
        return HEADS_DIR / name
    have = ", ".join(bundled_heads()) or "none"
    raise FileNotFoundError(f"drafter head {name!r} is neither a folder nor a bundled head (bundled: {have})")

