"""Drafter heads shipped inside the package (peagle/heads/<name>), the speculative config that serves the embedded
target with one, how a speculative config names a head, and which speculative config a command runs."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from peagle.config import DEFAULT_NUM_SPECULATIVE_TOKENS, ENV_VAR, SpeculativeConfig, SpeculativeConfigError
from peagle.model.loading import has_embedded_weights

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
# The bundled heads for the embedded SmolLM2-135M-Instruct target.
DEFAULT_HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
# config.json key of a head with random weights (checkpoint.random_head sets it), so reports can say so.
UNTRAINED_KEY = "peagle_untrained"


def embedded_speculative_config() -> SpeculativeConfig:
    """The hybrid of the bundled P-EAGLE head at the default K and suffix trees (docs/design.md, "Decoding step"):
    the embedded preset of `peagle models`, and what `peagle serve` and `peagle generate` use for the embedded target
    when no config is given."""
    return SpeculativeConfig.hybrid(DEFAULT_HEADS["peagle"], DEFAULT_NUM_SPECULATIVE_TOKENS)


def default_speculative_config(target: str | None) -> SpeculativeConfig | None:
    """The speculative config used when none is given: `embedded_speculative_config()` for the embedded target (in
    any of its weight formats), or
    None (no speculation) when the target is another model or the bundled head is not installed."""
    if not has_embedded_weights(target) or DEFAULT_HEADS["peagle"] not in bundled_heads():
        return None
    return embedded_speculative_config()


def bundled_heads() -> list[str]:
    return sorted(p.name for p in HEADS_DIR.glob("*") if (p / "config.json").exists()) if HEADS_DIR.exists() else []


def is_untrained(head_dir: str | Path) -> bool:
    """Whether a head folder holds random weights (`peagle export --random-init`, `peagle bench --random-heads`)."""
    try:
        return bool(json.loads((Path(head_dir) / "config.json").read_text()).get(UNTRAINED_KEY))
    except (OSError, ValueError):
        return False


def resolve_head(name: str | None, target: str | None = None, method: str = "peagle") -> Path:
    """A head folder: a path, a bundled head name, or None for the bundled default of the embedded target."""
    if name is None:
        if not has_embedded_weights(target):
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


# What turns speculation off where a config is expected, as with vLLM.
NO_SPECULATION = ("", "none", "null")


@dataclass(frozen=True)
class Speculation:
    """The speculation a command runs: a config (None: plain decoding), where it came from ("flag", "environment",
    "preset" or "default"), and, when speculation is off only for want of a head, a note saying so."""
    config: SpeculativeConfig | None
    origin: str
    note: str | None = None


def resolve_speculation(text: str | None, target: str | None, *, source: str = "--speculative-config",
                        preset: dict | None = None) -> Speculation:
    """Decide, once per command, which speculative config runs, from the first of: `text` (a flag's JSON; "none"
    turns speculation off), the SM_VLLM_SPECULATIVE_CONFIG environment variable, a preset's config, the bundled head
    of the embedded target. Bad JSON or fields raise SpeculativeConfigError naming where the text came from."""
    origin = "environment" if source == ENV_VAR else "flag"
    if text is None and os.environ.get(ENV_VAR) is not None:
        text, source, origin = os.environ[ENV_VAR], ENV_VAR, "environment"
    if text is not None:
        if text.strip().lower() in NO_SPECULATION:
            return Speculation(None, origin)
        try:
            return Speculation(SpeculativeConfig.parse(text), origin)
        except SpeculativeConfigError as e:
            raise SpeculativeConfigError(f"{e}\n  (from {source})") from None
    if preset is not None:
        return Speculation(SpeculativeConfig.parse(preset), "preset")
    spec = default_speculative_config(target)
    if spec is not None:
        return Speculation(spec, "default")
    if has_embedded_weights(target):
        why = (f"the bundled P-EAGLE head for the embedded model is not installed (bundled heads: "
               f"{', '.join(bundled_heads()) or 'none'})")
    else:
        why = "no --speculative-config given and no bundled head for this model"
    return Speculation(None, "default", f"{why}; decoding WITHOUT speculation (name a head with --speculative-config)")
