"""The config of a new draft head for a target: one Llama decoder layer at the target's sizes.

Shared by the EAGLE-1/2 head (`eagle2.head`) and the EAGLE-3 head (`eagle2.eagle3`).
"""

from __future__ import annotations

from transformers import LlamaConfig


def head_config_for(target_config, **overrides) -> LlamaConfig:
    """A one-layer Llama config matching the target's hidden sizes (a new head's config)."""
    fields = dict(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=getattr(target_config, "head_dim", None),
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        hidden_act=target_config.hidden_act,
        num_hidden_layers=1,
        bias=False,
    )
    rope = getattr(target_config, "rope_parameters", None)
    if rope is not None:
        fields["rope_parameters"] = dict(rope)
    else:
        fields["rope_theta"] = getattr(target_config, "rope_theta", 10000.0)
    fields.update(overrides)
    if fields["head_dim"] is None:
        fields.pop("head_dim")
    return LlamaConfig(**fields)
