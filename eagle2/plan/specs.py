"""Model and draft-head specs for the planner: the config.json values that decide shapes
(presets for the flagship models, or read from a config.json)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

DTYPE_BYTES = MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4})
GIB = 2**30
DEFAULT_CONTEXT = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The config.json values of a Llama-family model that decide its shapes."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for field in ("hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "vocab_size",
                      "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads ({self.num_attention_heads}) must "
                             f"be a multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"{self.name}: hidden_size {self.hidden_size} is not divisible "
                                 f"by {self.num_attention_heads} heads; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)


PRESETS = MappingProxyType({
    # meta-llama/Meta-Llama-3-8B(-Instruct) config.json
    "llama-3-8b": ModelSpec("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    # meta-llama/Meta-Llama-3-70B(-Instruct) config.json
    "llama-3-70b": ModelSpec("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    # meta-llama/Llama-2-70b(-chat)-hf config.json
    "llama-2-70b": ModelSpec("Llama-2-70B", 8192, 28672, 80, 64, 8, 32000, 4096, 10000.0),
})


@dataclass(frozen=True)
class DraftSpec:
    """An EAGLE-1/2 head: fc Linear(2H -> H) + `model.num_hidden_layers` decoder layers."""

    model: ModelSpec
    fc_bias: bool

    @property
    def name(self) -> str:
        return self.model.name


# EAGLE heads have the target's dimensions and one layer; the LLaMA-3 heads set "bias": false,
# the LLaMA-2 heads keep the fc bias (EAGLE's default).
DRAFT_PRESETS = MappingProxyType({
    "eagle-llama3-8b": ("llama-3-8b", False),
    "eagle-llama3-70b": ("llama-3-70b", False),
    "eagle-llama2-70b": ("llama-2-70b", True),
})


def eagle_head_for(target: ModelSpec, fc_bias: bool = False) -> DraftSpec:
    """The EAGLE head shaped like `target`: same dims, one decoder layer."""
    head = dataclasses.replace(target, name=f"EAGLE head for {target.name}", num_hidden_layers=1)
    return DraftSpec(head, fc_bias)


def _read_config(path_text: str, presets: Any) -> dict[str, Any]:
    path = Path(path_text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{path_text!r} is neither a preset ({', '.join(presets)}) nor a "
                         "config.json or a directory holding one")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def spec_from_config(cfg: dict[str, Any], name: str) -> ModelSpec:
    """ModelSpec from an HF config.json dict (Llama architecture only)."""
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{name}: model_type {cfg['model_type']!r} is not 'llama'; the planner "
                         "knows the tensor-parallel layout of Llama-family models only")
    fields = {f.name: cfg[f.name] for f in dataclasses.fields(ModelSpec)
              if cfg.get(f.name) is not None and f.name != "name"}
    if "num_attention_heads" in fields:
        fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    fields.setdefault("max_position_embeddings", 2048)
    if "rope_theta" not in fields and "rope_theta" in (cfg.get("rope_parameters") or {}):
        fields["rope_theta"] = cfg["rope_parameters"]["rope_theta"]  # transformers >= 5 layout
    try:
        return ModelSpec(name=name, **fields)
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{name}: config.json is not a complete Llama config ({err})") from None


def load_model_spec(name_or_path: str) -> ModelSpec:
    """A preset name (see PRESETS) or a path to a config.json / a directory holding one."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    return spec_from_config(_read_config(name_or_path, PRESETS), name_or_path)


def load_draft_spec(value: str, target: ModelSpec) -> DraftSpec | None:
    """'none', 'auto' (a head shaped like the target), a DRAFT_PRESETS name, or a config path."""
    if value == "none":
        return None
    if value == "auto":
        return eagle_head_for(target)
    if value in DRAFT_PRESETS:
        base, fc_bias = DRAFT_PRESETS[value]
        return eagle_head_for(PRESETS[base], fc_bias)
    cfg = _read_config(value, ("auto", "none", *DRAFT_PRESETS))
    # EAGLE's Model(config, bias=True) reads "bias" from the head's config.json.
    return DraftSpec(spec_from_config(cfg, value), bool(cfg.get("bias", True)))

