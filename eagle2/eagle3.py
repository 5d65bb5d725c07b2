"""The EAGLE-3 draft head and its published checkpoint layout (docs/draft-tree.md "EAGLE-3 heads").

Features: the target's residual stream at the *input* of three decoder layers (by default
2, L//2 and L-3 of an L-layer target), concatenated [3H]. The head fuses them with
`fc: 3H -> H` into g; its one decoder layer attends over cat(input_layernorm(embed(token)),
hidden_norm(g)) (q/k/v take 2H) with g as the residual, then post-attention norm, MLP and
residual give g'. Draft logits are `lm_head(norm(g'))` over the head's own reduced vocabulary.
Deeper tree levels feed g' back as the feature (width H: fc is skipped).

Published layout (the reference release, SpecForge, SGLang, vLLM): config.json (a Llama config
with num_hidden_layers 1 and `draft_vocab_size`) plus model.safetensors or pytorch_model.bin
with `fc.weight`, `midlayer.*` (vLLM: `layers.0.*`; SGLang prefixes `model.`), `norm.weight`,
`lm_head.weight`, `d2t` (offsets: target id = i + d2t[i]) and `t2d` (a bool mask over the
target vocabulary). An `embed_tokens.weight` is ignored: the target's embedding is used.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

from eagle2.attention import HeadRotary, KVCache, StepInputs, cached_attention, sequence_inputs
from eagle2.calibration import Calibration
from eagle2.ngram import NgramStore

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what SGLang and vLLM dispatch on
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"  # in config["eagle_config"]: output ids


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Decoder-layer *input* indices whose residual streams an EAGLE-3 head reads."""
    return (2, num_layers // 2, num_layers - 3)


class _Attention(nn.Module):
    def __init__(self, config: LlamaConfig, head_dim: int):
        super().__init__()
        hidden, heads, kv = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _MidLayer(nn.Module):
    """The head's decoder layer (module names as in the published checkpoints)."""

    def __init__(self, config: LlamaConfig, head_dim: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = _Attention(config, head_dim)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)


class Eagle3Head(nn.Module):
    """fc (3H -> H) + one 2H-input decoder layer + norm + lm_head over the draft vocabulary.

    The same interface as `eagle2.head.DraftHead` (`step`, `pre_logits`, `output_weight`,
    `allocate_cache`, `rotary`, `d2t`, `calibration`), so the drafter runs either kind.
    """

    kind = "eagle3"

    def __init__(self, config: LlamaConfig, draft_vocab_size: int,
                 target_hidden_size: int | None = None,
                 aux_layer_ids: tuple[int, ...] | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.target_hidden_size = target_hidden_size or hidden
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=False)
        self.midlayer = _MidLayer(config, self.head_dim)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary = HeadRotary(config=config)  # fp32 frequencies in a bf16 head
        self.aux_layer_ids = aux_layer_ids  # output ids from the config, None = the default
        # absolute target ids of the draft vocabulary (the file stores offsets)
        self.register_buffer("d2t", torch.arange(draft_vocab_size), persistent=False)
        self.calibration: Calibration | None = None
        self.ngram: NgramStore | None = None  # `ngram.npz` beside the weights

    @property
    def bias(self) -> bool:
        return False

    def feature_layers(self, num_layers: int) -> tuple[int, ...]:
        """Which decoder-layer inputs of an `num_layers`-layer target this head reads."""
        if self.aux_layer_ids is not None:
            return tuple(i + 1 for i in self.aux_layer_ids)  # output id i = input of i + 1
        return default_feature_layers(num_layers)

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        w = self.fc.weight
        return KVCache.allocate(1, num_slots, self.config.num_key_value_heads, max_len,
                                self.head_dim, w.dtype, w.device)

    def step(self, token_embeds: torch.Tensor, features: torch.Tensor, cache: KVCache,
             inp: StepInputs) -> torch.Tensor:
        """[B, N, H] embeddings + [B, N, 3H] target features (or [B, N, H] own outputs g')
        -> g' [B, N, H], writing the layer's K/V into the cache."""
        h, g = self.layer_input(token_embeds, features)
        layer = self.midlayer
        attn = layer.self_attn
        num_b, num_n, _ = h.shape
        dh = self.head_dim
        q = attn.q_proj(h).view(num_b, num_n, -1, dh).transpose(1, 2)
        k = attn.k_proj(h).view(num_b, num_n, -1, dh).transpose(1, 2)
        v = attn.v_proj(h).view(num_b, num_n, -1, dh).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, inp.cos, inp.sin)
        out = cached_attention(q, k, v, cache, 0, inp)
        x = g + attn.o_proj(out.transpose(1, 2).reshape(num_b, num_n, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @property
    def decoder(self) -> nn.Module:
        return self.midlayer

    def layer_input(self, token_embeds: torch.Tensor, features: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the q/k/v projections' input [B, N, 2H], the residual g [B, N, H]) of `step`."""
        g = features.to(token_embeds.dtype)
        if g.shape[-1] == 3 * self.target_hidden_size:  # target features, not the head's own
            g = self.fc(g)
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(token_embeds), layer.hidden_norm(g)], dim=-1), g

    def pre_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def output_weight(self, target_lm_head: nn.Module | None = None) -> torch.Tensor:
        """[Vd, H]: the head's own lm_head (the target's is not used)."""
        return self.lm_head.weight.detach()

    def forward_train(self, token_embeds: torch.Tensor, features: torch.Tensor,
                      lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass over whole sequences (one unrolled step): -> g' [B, T, H]."""
        num_b, num_t, _ = token_embeds.shape
        if lengths is None:
            lengths = torch.full((num_b,), num_t, device=token_embeds.device)
        cache = self.allocate_cache(num_b, num_t)
        inp = sequence_inputs(cache, lengths, num_t, self.rotary, token_embeds)
        return self.step(token_embeds, features, cache, inp)


def config_says_eagle3(raw_config: dict) -> bool:
    """An EAGLE-3 config: `draft_vocab_size`, or an architecture name containing "Eagle3"."""
    return "draft_vocab_size" in raw_config or any(
        "Eagle3" in a for a in raw_config.get("architectures") or ())


def is_eagle3(raw_config: dict, keys: set[str]) -> bool:
    """Does a head directory hold an EAGLE-3 checkpoint (by config or by its tensor names)?"""
    return config_says_eagle3(raw_config) or any(k.endswith("hidden_norm.weight") for k in keys)


def normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGLang (`model.` prefix, `hot_token_id`) and vLLM (`layers.0.`) names -> reference ones."""
    out = {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        out[name] = value
    return out


def from_state(raw: dict, state: dict[str, torch.Tensor]) -> Eagle3Head:
    """Build an `Eagle3Head` from a published config dict and (normalized) state dict."""
    state = normalize_keys(state)
    state.pop("embed_tokens.weight", None)
    d2t_offsets = state.pop("d2t", None)
    hot = state.pop("hot_token_id", None)  # SGLang: absolute ids
    t2d = state.pop("t2d", None)
    fields = {k: v for k, v in raw.items()
              if k not in ("architectures", "eagle_config", "target_hidden_size")}
    fields["num_hidden_layers"] = 1
    config = LlamaConfig(**fields)
    if "lm_head.weight" not in state:
        raise ValueError("EAGLE-3 head checkpoint has no lm_head.weight")
    vocab = state["lm_head.weight"].shape[0]
    if raw.get("draft_vocab_size", vocab) != vocab:
        raise ValueError(f"config draft_vocab_size={raw['draft_vocab_size']} but lm_head has "
                         f"{vocab} rows")
    fc_in = state["fc.weight"].shape[1] if "fc.weight" in state else 3 * config.hidden_size
    if fc_in % 3:
        raise ValueError(f"fc.weight takes {fc_in} inputs: not three target features")
    aux = (raw.get("eagle_config") or {}).get(AUX_IDS_KEY)
    head = Eagle3Head(config, vocab, target_hidden_size=fc_in // 3,
                      aux_layer_ids=tuple(aux) if aux else None)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary")]
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 head checkpoint does not match the published layout: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if d2t_offsets is not None:
        if d2t_offsets.numel() != vocab:
            raise ValueError(f"d2t has {d2t_offsets.numel()} entries for {vocab} draft tokens")
        head.d2t = torch.arange(vocab) + d2t_offsets.long()
    elif hot is not None:
        head.d2t = hot.long()
    elif vocab != config.vocab_size:
        raise ValueError("EAGLE-3 head with a reduced vocabulary but no d2t mapping")
    if t2d is not None and int(t2d.sum()) != vocab:
        raise ValueError(f"t2d marks {int(t2d.sum())} tokens, the draft vocabulary has {vocab}")
    return head


def published_state(head: Eagle3Head, target_vocab: int) -> dict[str, torch.Tensor]:
    """The tensors of the published layout (reference names, d2t as offsets, t2d mask)."""
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
             if not k.startswith("rotary")}
    d2t = head.d2t.cpu().long()
    state["d2t"] = d2t - torch.arange(d2t.numel())
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[d2t] = True
    state["t2d"] = t2d
    return state


def published_config(head: Eagle3Head, target_config) -> dict:
    config = head.config.to_dict()
    config.update({"num_hidden_layers": 1, "architectures": [ARCHITECTURE],
                   "draft_vocab_size": head.lm_head.weight.shape[0],
                   "vocab_size": target_config.vocab_size})
    if head.aux_layer_ids is not None:
        config["eagle_config"] = {AUX_IDS_KEY: list(head.aux_layer_ids)}
    if head.target_hidden_size != head.config.hidden_size:
        config["target_hidden_size"] = head.target_hidden_size
    return config


def new_eagle3_head(target_config, draft_vocab: torch.Tensor | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32,
                    aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Head:
    """An untrained EAGLE-3 head for a target (seeded init); draft_vocab: sorted target ids;
    aux_layer_ids: decoder *output* ids as in the published config (None: the default)."""
    from eagle2.head_config import head_config_for

    torch.manual_seed(seed)
    vocab = draft_vocab if draft_vocab is not None else torch.arange(target_config.vocab_size)
    head = Eagle3Head(head_config_for(target_config), int(vocab.numel()),
                      aux_layer_ids=aux_layer_ids)
    head.d2t = vocab.long()
    return head.to(dtype).eval()

