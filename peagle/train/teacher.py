"""The frozen target as a teacher: any transformers causal LM, run with `output_hidden_states`; or, for the
architectures peagle's engine runs (Llama, Mistral, Qwen2/3) in bf16 on a CPU with peagle's kernels, the engine's
own forward (`TargetModel`), so that the head trains on the very features, bit for bit, that the engine will
serve it (transformers' forward rounds differently: about 3% relative on SmolLM2's features in bf16). It runs at
transformers' speed on long sequences (docs/training.md).

For a sequence it returns the drafter's input features (Hugging Face `hidden_states[i]` for the vLLM ids
(2, L//2, L-3), concatenated), the labels (the target's logits at every position restricted to the draft vocab; the
loss renormalises them, so the label is the target's distribution restricted and renormalised) and the target's
argmax over its full vocab (for accuracy and acceptance).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from peagle.model.drafter import DrafterConfig
from peagle.model.layers import BatchLayout
from peagle.model.target import TargetConfig, TargetModel, default_feature_layer_ids, rope_parameters_of


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def num_layers_of(hf_config) -> int:
    n = _first(hf_config, "num_hidden_layers", "n_layer", "num_layers")
    if n is None:
        raise ValueError(f"cannot tell how many layers {type(hf_config).__name__} has")
    return int(n)


def drafter_config_for(model_dir: str | Path, hf_config, num_layers: int, draft_vocab_size: int,
                       mask_token_id: int | None) -> DrafterConfig:
    """The head's config for a target. Llama-family targets go through TargetConfig (the engine's view of them);
    any other architecture gets a Llama-layout head sized from its config, with the target's RoPE settings when it
    has RoPE and theta 10000 when it does not (the head's positions are its own)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else hf_config.to_dict()
    try:
        tc = TargetConfig.from_hf(raw)
        return DrafterConfig.for_target(tc, num_layers=num_layers, draft_vocab_size=draft_vocab_size,
                                        mask_token_id=mask_token_id)
    except (ValueError, KeyError):
        pass
    hidden = int(_first(hf_config, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(hf_config, "num_attention_heads", "n_head"))
    kv = int(_first(hf_config, "num_key_value_heads", default=heads))
    head_dim = int(_first(hf_config, "head_dim", default=hidden // heads))
    inter = int(_first(hf_config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden)
    eps = float(_first(hf_config, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", default=1e-6))
    L = num_layers_of(hf_config)
    return DrafterConfig(hidden_size=hidden, intermediate_size=inter, num_layers=num_layers, num_heads=heads,
                         num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=eps, vocab_size=int(hf_config.vocab_size),
                         draft_vocab_size=draft_vocab_size, target_hidden_size=hidden,
                         rope_parameters=rope_parameters_of(raw),
                         max_position_embeddings=int(_first(hf_config, "max_position_embeddings", "n_positions",
                                                            default=4096)),
                         feature_layer_ids=tuple(default_feature_layer_ids(L)), mask_token_id=mask_token_id)


class Teacher:
    """A frozen Hugging Face causal LM producing features and labels for the drafter."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 feature_layer_ids: tuple[int, ...] | None = None, logits_chunk: int = 2048,
                 device_map: str | dict | None = None, native: bool = True):
        """`native=False` keeps transformers' forward even where the engine's would run."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from peagle.model.loading import config_dir, transformers_source

        self.model_dir = Path(model_dir)  # a Hugging Face folder, or a .gguf file (its own blocks run natively)
        self.config_dir = config_dir(self.model_dir)
        self.hf_config = AutoConfig.from_pretrained(self.config_dir)
        self.dtype = dtype
        L = num_layers_of(self.hf_config)
        self.feature_layer_ids = tuple(feature_layer_ids or default_feature_layer_ids(L))
        if max(self.feature_layer_ids) > L or min(self.feature_layer_ids) < 0:
            raise ValueError(f"feature layer ids {self.feature_layer_ids} do not fit a {L}-layer target")
        self.model = None
        self.target = self._native_target(device, device_map, L) if native else None
        if self.target is not None:
            self.device = torch.device("cpu")
        else:
            # transformers reads a GGUF by dequantizing it: the teacher then computes on the same weights in float
            where = transformers_source(self.model_dir)
            if device_map is not None:  # a target too big for one device: layers spread over several (accelerate)
                self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype, device_map=device_map)
                self.device = self.model.get_input_embeddings().weight.device
            else:
                self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).to(device)
                self.device = torch.device(device)
        if self.model is not None:
            self.model.eval().requires_grad_(False)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.logits_chunk = logits_chunk
        self.used: torch.Tensor | None = None  # draft vocab (target ids, ascending)
        self._plain_head: bool | None = None

    def _native_target(self, device, device_map, num_layers: int) -> TargetModel | None:
        """The engine's forward for this target, where it runs on peagle's CPU kernels one whole layer per call;
        None elsewhere (another architecture, a GPU, fp32, a device map, a feature taken after the last layer, or a
        machine where the kernels do not run: the loaded target then has no native layers)."""
        if device_map is not None or torch.device(device).type != "cpu" or self.dtype != torch.bfloat16 \
                or max(self.feature_layer_ids) >= num_layers:
            return None
        try:
            TargetConfig.from_hf(json.loads((self.config_dir / "config.json").read_text()))
        except (ValueError, KeyError):
            return None
        target = TargetModel.from_pretrained(self.model_dir, dtype=self.dtype)
        if target.native_layers is None:
            return None
        target.feature_layer_ids = self.feature_layer_ids
        return target

    # -- weights the head starts from ------------------------------------------------------------------------
    def input_embeddings(self) -> torch.Tensor:
        if self.target is not None:
            return self.target.input_embeddings()
        return self.model.get_input_embeddings().weight

    def output_embeddings(self) -> torch.Tensor | None:
        if self.target is not None:
            return self.target.output_embeddings()
        out = self.model.get_output_embeddings()
        return None if out is None else out.weight

    def final_norm_weight(self) -> torch.Tensor | None:
        """The target's final RMSNorm weight, when it has a bias-free one (Llama, Qwen, Mistral...)."""
        if self.target is not None:
            return self.target.norm.weight
        try:
            dec = self.model.get_decoder()
        except Exception:  # noqa: BLE001 - not every model exposes its decoder
            return None
        norm = getattr(dec, "norm", None)
        w = getattr(norm, "weight", None)
        if w is None or getattr(norm, "bias", None) is not None or w.ndim != 1:
            return None
        return w

    # -- per sequence ----------------------------------------------------------------------------------------
    def _head_is_plain(self) -> bool:
        """Whether logits == output_embeddings(last hidden state) for this model (no soft-capping or scaling), so
        the target can skip materialising full-vocab logits for every position. Checked once, numerically."""
        if self._plain_head is None:
            head = self.model.get_output_embeddings()
            ok = False
            # logit soft-capping or scaling (Gemma 2/3, Cohere, Granite...) happens outside the head module
            scaled = any(getattr(self.hf_config, a, None) not in (None, 1, 1.0) for a in (
                "final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale"))
            if head is not None and not scaled:
                ids = torch.arange(3, 11, device=self.device)[None] % self.vocab_size
                try:
                    with torch.no_grad():
                        full = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
                        last = self.model(input_ids=ids, output_hidden_states=True, use_cache=False,
                                          logits_to_keep=1)
                        mine = head(full.hidden_states[-1][0]).float()
                    ok = (last.logits.shape[1] == 1
                          and torch.allclose(mine, full.logits[0].float(), rtol=1e-2, atol=1e-2)
                          and torch.allclose(mine[-1], last.logits[0, -1].float(), rtol=1e-2, atol=1e-2))
                except (TypeError, ValueError, RuntimeError) as e:  # e.g. a model without logits_to_keep
                    print(f"peagle train: {type(self.model).__name__} cannot skip full-vocab logits "
                          f"({type(e).__name__}: {e}); the teacher computes them for every position (slower, "
                          "same labels)", file=sys.stderr)
                    ok = False
            self._plain_head = ok
        return self._plain_head

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [n] -> (features [n, 3H], label logits [n, Vd] over the draft vocab, full-vocab argmax [n]),
        features and labels in the target's dtype. Full-vocab logits are made `logits_chunk` positions at a time
        when the model's head allows it, so an n x V tensor never exists."""
        if self.used is None:
            raise RuntimeError("set Teacher.used (the draft vocab) before computing labels")
        if self.target is not None:
            return self._native_call(input_ids)
        return self._hf_call(input_ids.to(self.device)[None], None)[0]

    @torch.no_grad()
    def batch(self, rows: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """`self(ids)` for several rows in one forward (--micro-batch-size): right-padded to the longest, the padding
        masked out, so every row's outputs are its own (up to the rounding of a batched product). The engine's CPU
        forward takes one row per call, so there the rows run in turn."""
        if self.target is not None or len(rows) == 1:
            return [self(ids) for ids in rows]
        if self.used is None:
            raise RuntimeError("set Teacher.used (the draft vocab) before computing labels")
        lengths = [ids.numel() for ids in rows]
        ids = torch.zeros(len(rows), max(lengths), dtype=torch.long, device=self.device)
        attention = torch.zeros_like(ids)
        for r, row in enumerate(rows):
            ids[r, :lengths[r]] = row.to(self.device)
            attention[r, :lengths[r]] = 1
        return self._hf_call(ids, attention, lengths)

    def _hf_call(self, ids: torch.Tensor, attention: torch.Tensor | None, lengths: list[int] | None = None):
        """transformers' forward of rows ids [B, T] -> per row (features, labels, argmax), each cut to its length."""
        plain = self._head_is_plain()
        kw = {"logits_to_keep": 1} if plain else {}
        if attention is not None:
            kw["attention_mask"] = attention
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False, **kw)
        hs = out.hidden_states
        head = self.model.get_output_embeddings()
        used = self.used.to(hs[-1].device)
        results = []
        for r, n in enumerate(lengths or [ids.shape[1]]):
            features = torch.cat([hs[i][r, :n] for i in self.feature_layer_ids], dim=-1)
            last = hs[-1][r, :n]
            labels = torch.empty(n, used.numel(), dtype=last.dtype, device=last.device)
            argmax = torch.empty(n, dtype=torch.long, device=last.device)
            for a in range(0, n, self.logits_chunk):
                b = min(n, a + self.logits_chunk)
                chunk = head(last[a:b]) if plain else out.logits[r, a:b]
                argmax[a:b] = chunk.argmax(-1)
                labels[a:b] = chunk.index_select(-1, used).to(labels.dtype)
            results.append((features, labels, argmax))
        del out, hs
        return results

    def _native_call(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = input_ids.numel()
        cache = self.target.new_cache(1, n)
        layout = BatchLayout.build(torch.zeros(1, dtype=torch.long), torch.arange(n)[None])
        h, features = self.target.trunk(input_ids[None].cpu(), layout, cache)
        h, features = h[0], features[0]
        used = self.used.cpu()
        labels = torch.empty(n, used.numel(), dtype=h.dtype)
        argmax = torch.empty(n, dtype=torch.long)
        for a in range(0, n, self.logits_chunk):
            chunk = self.target.logits(h[a:a + self.logits_chunk])
            argmax[a:a + self.logits_chunk] = chunk.argmax(-1)
            labels[a:a + self.logits_chunk] = chunk.index_select(-1, used).to(labels.dtype)
        return features, labels, argmax
