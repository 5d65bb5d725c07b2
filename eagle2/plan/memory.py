"""Per-rank memory arithmetic: which rows/columns each tensor-parallel rank holds, parameter
counts, KV bytes per token, and which tp sizes split a model cleanly."""

from __future__ import annotations

import math
from typing import Any

from eagle2.plan.specs import DraftSpec, ModelSpec, spec_from_config

# parameter-name suffix -> split dim (eagle2.tp.split_dim); anything else is whole on every
# rank. nn.Linear weights are [out, in]: column-parallel splits dim 0, row-parallel dim 1.
_SPLIT_RULES = (
    (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias"), 0),
    (("self_attn.o_proj.weight", "mlp.down_proj.weight"), 1),
)


def shard_shape(name: str, shape: tuple[int, ...], spec: ModelSpec, tp: int, rank: int
                ) -> tuple[int, ...]:
    """Per-rank shape of the full parameter `name` of `shape` (eagle2.tp: even splits, whole
    KV-head groups for attention; embed_tokens, norms and lm_head whole)."""
    for suffixes, dim in _SPLIT_RULES:
        if name.endswith(suffixes):
            out = list(shape)
            out[dim] = shape[dim] // tp
            return tuple(out)
    return tuple(shape)


def check_tp_rank(spec: ModelSpec, tp: int, rank: int) -> None:
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    if tp > spec.num_key_value_heads:
        raise ValueError(f"{spec.name}: tp={tp} exceeds its {spec.num_key_value_heads} KV heads; "
                         "ranks hold whole KV-head groups, so some ranks would hold none")
    problems = tp_problems(spec, tp)
    if problems:
        raise ValueError(f"{spec.name}: tp={tp} does not split it evenly: {'; '.join(problems)}")


def to_hf_config(spec: ModelSpec):
    """transformers.LlamaConfig with the spec's values."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=spec.tie_word_embeddings,
        head_dim=spec.head_dim, attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias)


def shard_shapes(config: ModelSpec | Any, tp_size: int, rank: int = 0
                 ) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape on rank `rank` (eagle2.tp), from a model built on meta.

    `config` is a ModelSpec or a transformers LlamaConfig. A tied lm_head is listed too (on a
    rank it shares the embedding's tensor).
    """
    import torch
    from transformers import LlamaForCausalLM

    spec = config if isinstance(config, ModelSpec) else spec_from_config(
        config.to_dict(), getattr(config, "name_or_path", "") or "config")
    check_tp_rank(spec, tp_size, rank)
    with torch.device("meta"):
        model = LlamaForCausalLM(to_hf_config(spec))
    return {name: shard_shape(name, tuple(p.shape), spec, tp_size, rank)
            for name, p in model.named_parameters(remove_duplicate=False)}


# ---------------------------------------------------------------- parameter counts


def _layer_shapes(spec: ModelSpec, input_norm: bool = True) -> dict[str, tuple[int, ...]]:
    """Full shapes of one decoder layer's parameters, named like the HF module."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i), "post_attention_layernorm.weight": (h,)}
    if input_norm:
        shapes["input_layernorm.weight"] = (h,)
    if spec.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,)})
    if spec.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,),
                       "mlp.down_proj.bias": (h,)})
    return shapes


def num_params(spec: ModelSpec) -> int:
    """Parameters in the checkpoint (a tied lm_head counted once)."""
    layer = sum(math.prod(s) for s in _layer_shapes(spec).values())
    embed = spec.vocab_size * spec.hidden_size
    lm_head = 0 if spec.tie_word_embeddings else embed
    return spec.num_hidden_layers * layer + embed + lm_head + spec.hidden_size


def rank_params(spec: ModelSpec, tp: int, rank: int) -> int:
    """Parameters rank `rank` holds: layer shards + embed_tokens + lm_head (whole) + norm.
    A tied lm_head shares the embedding's tensor on the rank."""
    check_tp_rank(spec, tp, rank)
    shapes = _layer_shapes(spec).items()
    layer = sum(math.prod(shard_shape(n, s, spec, tp, rank)) for n, s in shapes)
    embed = (spec.vocab_size, spec.hidden_size)
    lm_head = 0 if spec.tie_word_embeddings else math.prod(embed)
    return spec.num_hidden_layers * layer + math.prod(embed) + lm_head + spec.hidden_size


def draft_shapes(draft: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Full shapes of the head's own parameters, named as `eagle2.head.load_head` builds them
    (the published names; rotary tables and the d2t/t2d buffers are not parameters)."""
    h = draft.model.hidden_size
    if draft.kind == "eagle3":
        return _eagle3_shapes(draft)
    shapes = {"fc.weight": (h, 2 * h)}
    if draft.fc_bias:
        shapes["fc.bias"] = (h,)
    for i in range(draft.model.num_hidden_layers):
        shapes.update({f"layers.{i}.{n}": s
                       for n, s in _layer_shapes(draft.model, input_norm=False).items()})
    return shapes


def _eagle3_shapes(draft: DraftSpec) -> dict[str, tuple[int, ...]]:
    """fc 3H -> H; q/k/v read cat(input_layernorm(embed), hidden_norm(g)), 2H wide; the
    layer's MLP, three norms, the final norm and the lm_head over the draft vocabulary."""
    spec, h = draft.model, draft.model.hidden_size
    shapes = {"fc.weight": (h, 3 * h)}
    for name, shape in _layer_shapes(spec).items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            shape = (shape[0], 2 * h)
        elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
            continue  # Eagle3Head's attention has no biases
        shapes[f"midlayer.{name}"] = shape
    shapes.update({"midlayer.hidden_norm.weight": (h,), "norm.weight": (h,),
                   "lm_head.weight": (draft.draft_vocab_size, h)})
    return shapes


def draft_params(draft: DraftSpec) -> int:
    """The head's own parameters: fc + layers without input_layernorm (EAGLE-1/2); fc + the
    2H-input layer + norms + its lm_head (EAGLE-3)."""
    return sum(math.prod(s) for s in draft_shapes(draft).values())


def draft_buffer_bytes(draft: DraftSpec) -> int:
    """Bytes of the vocabulary maps the draft worker keeps: an EAGLE-3 head's d2t (int64
    [Vd], target id of each draft token). Its t2d (bool [V]) is only checked at load and
    dropped; an EAGLE-1/2 head here drafts over the full vocabulary and has none."""
    return 8 * draft.draft_vocab_size if draft.kind == "eagle3" else 0


def draft_worker_target_params(model: ModelSpec, draft: DraftSpec) -> int:
    """The target's tensors the draft worker loads: embed_tokens, and for an EAGLE-1/2 head
    (which drafts through it) lm_head (one tensor if tied). An EAGLE-3 head drafts through its
    own lm_head, so services/draft_worker.build_drafter loads only the embedding."""
    embed = model.vocab_size * model.hidden_size
    if draft.kind == "eagle3" or model.tie_word_embeddings:
        return embed
    return 2 * embed


def draft_worker_params(model: ModelSpec, draft: DraftSpec) -> int:
    """All parameters on the draft worker's GPU: the head's own + the target's it loads."""
    return draft_params(draft) + draft_worker_target_params(model, draft)


def draft_step_params(model: ModelSpec, draft: DraftSpec) -> int:
    """Parameters one draft level reads: the head (fc included: an upper bound past the root
    step) and the lm_head it drafts through (embedding rows are lookups)."""
    own = draft_params(draft)
    return own if draft.kind == "eagle3" else own + model.vocab_size * model.hidden_size


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int, tp: int = 1, rank: int = 0) -> int:
    """K and V of every layer for one token on one rank: 2 * L * kv_heads_on_rank * d * bytes."""
    kv_width = spec.num_key_value_heads // tp * spec.head_dim
    return 2 * spec.num_hidden_layers * kv_width * dtype_bytes


def tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Why `tp` does not split `spec` evenly (empty list: it does)."""
    problems = [f"{what} ({n}) is not divisible by tp={tp}" for what, n in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_key_value_heads),
        ("intermediate_size", spec.intermediate_size)) if n % tp]
    if tp > spec.num_key_value_heads:
        problems.append(f"tp={tp} > {spec.num_key_value_heads} KV heads (ranks hold whole "
                        "KV-head groups)")
    return problems


def valid_tp_sizes(spec: ModelSpec, max_tp: int) -> list[int]:
    return [tp for tp in range(1, max_tp + 1) if not tp_problems(spec, tp)]
