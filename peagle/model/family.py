"""What each decoder family the engine runs chooses where it departs from Llama: plain data that the target's
modules are built from, so the forward has no per-architecture branches.

A Llama block is x += attn(norm(x)); x += mlp(norm(x)) with RMSNorm(x) * w rounded like transformers' Llama, SiLU
gating, one RoPE base for every layer and 1 / sqrt(head_dim) attention scale. Gemma 3 departs in every row of
`Family` below: RMSNorm scales by (1 + w) before rounding, the embeddings are multiplied by sqrt(hidden), queries
and keys are normalised per head, the attention and MLP outputs are normalised too ("sandwich" norms), the MLP gates
with tanh-approximated GELU, and five of every six layers attend to a sliding window with a RoPE base of their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Gemma's turn format, for a GGUF file that carries no chat template of its own (the 270M file ships none). Gemma
# has no system role: a system message opens the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    description: str
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # queries and keys RMS-normalised per head before RoPE (Qwen3, Gemma 3)
    norm_unit_offset: bool = False  # RMSNorm multiplies by (1 + w) in fp32, then rounds (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs normalised before their residual adds (Gemma 2/3)
    scaled_embeddings: bool = False  # token embeddings multiplied by sqrt(hidden), rounded to the model's dtype
    activation: str = "silu"  # the MLP's gate: "silu" or "gelu_tanh"
    # llama.cpp's layer tensor names whose Hugging Face name differs from Llama's mapping (gguf_model.py)
    gguf_layer_names: dict = field(default_factory=dict)
    gguf_norm_shift: float = 0.0  # llama.cpp stores every norm weight plus this
    # llama.cpp scales a GGUF's attention scores by 1 / sqrt(head_dim) where transformers reads query_pre_attn_scalar
    # (equal on every Gemma 3 but the 27B, whose 168 no GGUF field records)
    gguf_query_scalar_is_head_dim: bool = False
    chat_template: str | None = None  # for a GGUF file without one
    end_of_turn: tuple[str, ...] = ()  # tokens that end a reply besides the tokenizer's EOS

    @property
    def llama_block(self) -> bool:
        """Whether a layer is exactly kernels.NativeDecoderLayer's Llama block (then it runs in one native call)."""
        return self == Family(self.description)


GEMMA3 = Family(
    "Gemma 3", qk_norm=True, norm_unit_offset=True, sandwich_norms=True, scaled_embeddings=True,
    activation="gelu_tanh",
    gguf_layer_names={"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    gguf_norm_shift=1.0, gguf_query_scalar_is_head_dim=True, chat_template=GEMMA_CHAT_TEMPLATE, end_of_turn=("<end_of_turn>",))

# Hugging Face model_type -> family
FAMILIES = {"llama": Family("Llama 2/3, SmolLM2"), "mistral": Family("Mistral"),
            "qwen2": Family("Qwen2/2.5", attention_bias=True), "qwen3": Family("Qwen3", qk_norm=True),
            "gemma3_text": GEMMA3}
# llama.cpp's general.architecture -> Hugging Face model_type, where they differ
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}


def family_of(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        names = ", ".join(f"{k} ({v.description})" for k, v in FAMILIES.items())
        raise ValueError(f"model_type {model_type!r} is not supported by peagle's engine; supported: {names}. "
                         "Training (`peagle train`) accepts any transformers causal LM.")
    return FAMILIES[model_type]
