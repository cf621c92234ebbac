"""Drafter heads shipped inside the package (peagle/heads/<name>) and how a speculative config names one."""
from __future__ import annotations

from pathlib import Path

from peagle.model.loading import is_embedded

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# The bundled heads for the embedded SmolLM2-135M-Instruct target.
DEFAULT_HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
# K for the bundled P-EAGLE head: the fastest at concurrency 1 in docs/benchmarks.md (the bundled heads' drafts are
# rarely accepted past the second position, so verifying more of them only costs time).
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


def default_speculative_config(target: str | None):
    """The speculative config used when none is given: the bundled P-EAGLE head for the embedded target, or None
    (no speculation) when the target is another model or the head is not installed."""
    from peagle.config import SpeculativeConfig

    if not is_embedded(target) or DEFAULT_HEADS["peagle"] not in bundled_heads():
        return None
    return SpeculativeConfig(model=DEFAULT_HEADS["peagle"], method="eagle3",
                             num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS, parallel_drafting=True)


def bundled_heads() -> list[str]:
    return sorted(p.name for p in HEADS_DIR.glob("*") if (p / "config.json").exists()) if HEADS_DIR.exists() else []


def resolve_head(name: str | None, target: str | None = None, method: str = "peagle") -> Path:
    """A head folder: a path, a bundled head name, or None for the bundled default of the embedded target."""
    if name is None:
        if not is_embedded(target):
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
