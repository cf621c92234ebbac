"""Which speculation a command runs, decided once. `resolve_speculation` takes the first of: a flag's JSON ("none"
turns speculation off), the SM_VLLM_SPECULATIVE_CONFIG environment variable, a preset's config, the default for the
model; it resolves the target's path and the head's folder (a path, a bundled name, or a SageMaker channel) and
returns one `Speculation` (peagle.config). `peagle serve`, `generate`, `deploy` and `bench` pass that object down, and
the engine loads what it names without resolving anything again.

The default, when no config is given, for every model:
  - the embedded weights in any format (peagle.model.identity: a GGUF quantized from them is the same model): the
    hybrid of the bundled P-EAGLE head and suffix trees;
  - with --sagemaker, a head in a data channel: the hybrid of that head and suffix trees;
  - any other model: suffix trees alone (model-free drafts from the request's own text and earlier answers).
Every one of them runs under the command's policy (adaptive unless asked otherwise), which verifies drafts only where
they are expected to pay, so a model whose text never repeats decodes at about plain speed. Greedy output equals
plain decoding token for token, whatever runs."""
from __future__ import annotations

import os
from pathlib import Path

from peagle.config import (DEFAULT_SPECULATION_POLICY, NO_SPECULATION, SPECULATIVE_CONFIG_ENV, Speculation,
                           SpeculativeConfig, SpeculativeConfigError)
from peagle.model.heads import DEFAULT_HEADS, bundled_heads, drafts_in_parallel, embedded_speculative_config, \
    resolve_head
from peagle.model.identity import is_embedded_model
from peagle.model.loading import resolve_model

ConfigText = str | dict | SpeculativeConfig | None


def resolve_speculation(model: str | None = None, config: ConfigText = None, *, source: str = "--speculative-config",
                        preset: dict | None = None, channels: Path | None = None,
                        policy: str = DEFAULT_SPECULATION_POLICY, local: bool = True) -> Speculation:
    """The speculation that serves `model` (None: the embedded model). `config`: the flag's JSON (or a dict, or a
    parsed config); `source`: what to name when its text is bad. `channels`: SageMaker's data-channel folder, where a
    head may be named by its channel and where the only head there is the default. `local`: False when another engine
    (vLLM) fetches the model and head, so either may be a hub id that is not on this disk. Raises
    SpeculativeConfigError naming the problem (bad JSON or fields, a head that is not there) and FileNotFoundError
    for a model that is not on this disk."""
    model_path = _model_path(model, local)
    spec, origin = _given(config, source, preset)
    note = None
    if origin == "default":
        spec, note = _default(model, model_path, channels)
    head_path = None
    if spec is not None and spec.uses_head:
        spec, head_path = _with_head(spec, model, channels, local)
    return Speculation(model, model_path, spec, head_path, policy, origin, note)


def _model_path(model: str | None, local: bool) -> Path | None:
    try:
        return resolve_model(model)
    except FileNotFoundError:
        if local:
            raise
        return None  # a hub id another engine fetches


def _given(config: ConfigText, source: str, preset: dict | None) -> tuple[SpeculativeConfig | None, str]:
    """The config given by the flag, the environment or the preset, with its origin; (None, "default") if none."""
    origin = "environment" if source == SPECULATIVE_CONFIG_ENV else "flag" if source.startswith("-") else "argument"
    if config is None and os.environ.get(SPECULATIVE_CONFIG_ENV) is not None:
        config, source, origin = os.environ[SPECULATIVE_CONFIG_ENV], SPECULATIVE_CONFIG_ENV, "environment"
    if config is None:
        return (SpeculativeConfig.parse(preset), "preset") if preset is not None else (None, "default")
    if isinstance(config, SpeculativeConfig):
        return config, origin
    if isinstance(config, str) and config.strip().lower() in NO_SPECULATION:
        return None, origin
    try:
        return SpeculativeConfig.parse(config), origin
    except SpeculativeConfigError as e:
        raise SpeculativeConfigError(f"{e}\n  (from {source})") from None


def _default(model: str | None, model_path: Path | None, channels: Path | None
             ) -> tuple[SpeculativeConfig, str | None]:
    """The default for this model, and a note when it is less than the model could have (a missing bundled head)."""
    channel = _only_channel(channels)
    if channel is not None:
        return SpeculativeConfig(model=str(channel), method="hybrid", parallel_drafting=drafts_in_parallel(channel)), None
    if is_embedded_model(model, model_path):
        if DEFAULT_HEADS["peagle"] in bundled_heads():
            return embedded_speculative_config(), None
        return SpeculativeConfig(method="suffix"), (
            f"the bundled P-EAGLE head for the embedded model is not installed (bundled heads: "
            f"{', '.join(bundled_heads()) or 'none'}): suffix drafts only")
    return SpeculativeConfig(method="suffix"), None


def _with_head(spec: SpeculativeConfig, model: str | None, channels: Path | None, local: bool) -> tuple[SpeculativeConfig, Path | None]:
    """The config naming its head by the folder found (a hub id stays as it is where `local` is False)."""
    name = _channel_head(spec.model, channels)
    if name is None and _only_channel(channels) is not None:
        name = str(_only_channel(channels))
    try:
        head = resolve_head(name, model, method=spec.head_method)
    except FileNotFoundError as e:
        if local:
            raise SpeculativeConfigError(f"speculative config: {e}") from None
        return spec.model_copy(update={"model": name}), None
    return spec.model_copy(update={"model": str(head)}), head


def _channel_head(head: str | None, channels: Path | None) -> str | None:
    """A head named by its SageMaker channel (a folder under `channels`), or the name as it is."""
    if head is None or channels is None or Path(head).expanduser().exists() or head in bundled_heads():
        return head
    channel = channels / head.strip("/").split("/")[-1]
    return str(channel) if (channel / "config.json").exists() else head


def _only_channel(channels: Path | None) -> Path | None:
    """The one head under SageMaker's data channels; several are refused (the config must name one)."""
    if channels is None:
        return None
    found = sorted(p for p in channels.glob("*") if (p / "config.json").exists())
    if len(found) > 1:
        raise SpeculativeConfigError(f"several heads under {channels} ({', '.join(c.name for c in found)}): name one "
                                     "in the speculative config's \"model\"")
    return found[0] if found else None
