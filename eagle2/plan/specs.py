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
    # meta-llama/Llama-3.1-8B(-Instruct) config.json (the same shapes, 128K positions)
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, 131072,
                              500000.0),
    # meta-llama/Meta-Llama-3-70B(-Instruct) config.json
    "llama-3-70b": ModelSpec("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    # meta-llama/Llama-3.3-70B-Instruct config.json (Llama-3-70B's shapes, 128K positions)
    "llama-3.3-70b": ModelSpec("Llama-3.3-70B", 8192, 28672, 80, 64, 8, 128256, 131072,
                               500000.0),
    # meta-llama/Llama-2-70b(-chat)-hf config.json
    "llama-2-70b": ModelSpec("Llama-2-70B", 8192, 28672, 80, 64, 8, 32000, 4096, 10000.0),
})


DRAFT_KINDS = ("eagle2", "eagle3")


@dataclass(frozen=True)
class DraftSpec:
    """A draft head's shapes (the head's config.json; see eagle2/head.py, eagle2/eagle3.py).

    kind "eagle2" (EAGLE-1/2, docs/draft-tree.md "Draft head"): fc Linear(2H -> H) +
    `model.num_hidden_layers` decoder layers without input_layernorm; drafts through the
    target's lm_head. kind "eagle3": fc Linear(3H -> H, no bias) + one decoder layer whose
    q/k/v read 2H (normed embedding and normed fused feature) + a final norm + its own
    lm_head over `draft_vocab_size` tokens, with the d2t/t2d maps between the vocabularies.
    Both read the target's embedding; `model.vocab_size` is the target's vocabulary.
    """

    model: ModelSpec
    fc_bias: bool
    kind: str = "eagle2"
    draft_vocab_size: int = 0  # eagle3: rows of the head's lm_head (0: the full vocabulary)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"{self.name}: unknown draft kind {self.kind!r}; use one of "
                             f"{list(DRAFT_KINDS)}")
        if self.kind == "eagle2":
            if self.draft_vocab_size:
                raise ValueError(f"{self.name}: draft_vocab_size is an EAGLE-3 field")
            return
        if self.fc_bias or self.model.num_hidden_layers != 1:
            raise ValueError(f"{self.name}: an EAGLE-3 head has one decoder layer and no fc bias")
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.model.vocab_size)
        if not 1 <= self.draft_vocab_size <= self.model.vocab_size:
            raise ValueError(f"{self.name}: draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, vocab_size {self.model.vocab_size}]")

    @property
    def name(self) -> str:
        return self.model.name


def eagle_head_for(target: ModelSpec, fc_bias: bool = False) -> DraftSpec:
    """The EAGLE-1/2 head shaped like `target`: same dims, one decoder layer."""
    head = dataclasses.replace(target, name=f"EAGLE head for {target.name}", num_hidden_layers=1)
    return DraftSpec(head, fc_bias)


def eagle3_head_for(target: ModelSpec, draft_vocab_size: int = 32000,
                    name: str = "") -> DraftSpec:
    """The EAGLE-3 head shaped like `target`: same dims, one layer, a reduced vocabulary
    (32000 tokens in the published heads; capped at the target's vocabulary)."""
    head = dataclasses.replace(target, name=name or f"EAGLE-3 head for {target.name}",
                               num_hidden_layers=1)
    return DraftSpec(head, False, "eagle3", min(draft_vocab_size, target.vocab_size))


@dataclass(frozen=True)
class DraftPreset:
    """A published head: the target preset it is shaped like, and how it differs."""

    repo: str  # the Hugging Face repository, downloaded as is
    target: str  # a PRESETS key
    kind: str = "eagle2"
    fc_bias: bool = False
    draft_vocab_size: int = 0

    def spec(self) -> DraftSpec:
        base, name = PRESETS[self.target], self.repo.rpartition("/")[2]
        if self.kind == "eagle3":
            return eagle3_head_for(base, self.draft_vocab_size, name)
        return DraftSpec(dataclasses.replace(base, name=name, num_hidden_layers=1), self.fc_bias)


# EAGLE-1/2 heads have the target's dimensions and one layer; the LLaMA-3 heads set "bias":
# false, the LLaMA-2 heads keep the fc bias (EAGLE's default). The EAGLE-3 heads: one layer,
# no bias, draft_vocab_size 32000 (their config.json).
DRAFT_PRESETS = MappingProxyType({
    "eagle-llama3-8b": DraftPreset("yuhuili/EAGLE-LLaMA3-Instruct-8B", "llama-3-8b"),
    "eagle-llama3-70b": DraftPreset("yuhuili/EAGLE-LLaMA3-Instruct-70B", "llama-3-70b"),
    "eagle-llama2-70b": DraftPreset("yuhuili/EAGLE-llama2-chat-70B", "llama-2-70b",
                                    fc_bias=True),
    "eagle3-llama3.1-8b": DraftPreset("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "llama-3.1-8b",
                                      "eagle3", draft_vocab_size=32000),
    "eagle3-llama3.3-70b": DraftPreset("yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "llama-3.3-70b",
                                       "eagle3", draft_vocab_size=32000),
})

# `--draft auto` for a preset target: its published head (the EAGLE-3 one where there is one);
# other targets get an EAGLE-1/2 head shaped like them.
DEFAULT_DRAFTS = MappingProxyType({
    "llama-3-8b": "eagle-llama3-8b",
    "llama-3.1-8b": "eagle3-llama3.1-8b",
    "llama-3-70b": "eagle-llama3-70b",
    "llama-3.3-70b": "eagle3-llama3.3-70b",
    "llama-2-70b": "eagle-llama2-70b",
})


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


def is_eagle3_config(cfg: dict[str, Any]) -> bool:
    """An EAGLE-3 head's config.json: `draft_vocab_size` (the reference release) or an
    architecture naming Eagle3 (SpecForge, SGLang, vLLM). The config rule of
    `eagle2.eagle3.is_eagle3`; the planner reads no tensors, so it has no tensor-name fallback."""
    return "draft_vocab_size" in cfg or any("Eagle3" in a for a in cfg.get("architectures") or ())


def draft_spec_from_config(cfg: dict[str, Any], name: str) -> DraftSpec:
    """DraftSpec from a head's config.json dict, EAGLE-1/2 or EAGLE-3."""
    if is_eagle3_config(cfg):
        # eagle2.eagle3.from_state builds one layer whatever the config says
        spec = spec_from_config(dict(cfg, num_hidden_layers=1), name)
        return DraftSpec(spec, False, "eagle3", int(cfg.get("draft_vocab_size") or 0))
    # EAGLE's Model(config, bias=True) reads "bias" from the head's config.json.
    return DraftSpec(spec_from_config(cfg, name), bool(cfg.get("bias", True)))


def default_draft(target: ModelSpec) -> DraftSpec:
    """`--draft auto`: a preset target's published head, else an EAGLE-1/2 head like it."""
    for key, preset in PRESETS.items():
        if preset == target and key in DEFAULT_DRAFTS:
            return DRAFT_PRESETS[DEFAULT_DRAFTS[key]].spec()
    return eagle_head_for(target)


def load_draft_spec(value: str, target: ModelSpec) -> DraftSpec | None:
    """'none', 'auto' (see `default_draft`), a DRAFT_PRESETS name, or a head's config.json /
    its directory (as downloaded)."""
    if value == "none":
        return None
    if value == "auto":
        return default_draft(target)
    if value in DRAFT_PRESETS:
        return DRAFT_PRESETS[value].spec()
    return draft_spec_from_config(_read_config(value, ("auto", "none", *DRAFT_PRESETS)), value)
