"""Placement and memory planner: a Llama target tensor-parallel on N GPUs + an EAGLE draft worker.

Deployment step before serving (BRIEF §1, §8, §9): decide the tensor-parallel size, check that
the target's shards and the draft worker fit, and say how many sequences of a given context
the KV caches hold. Pure arithmetic over config.json values; `shard_shapes` additionally builds
the model on the meta device (no weights allocated) to list the per-rank parameter shapes.

What the engine loads per target GPU mirrors DeepSpeed AutoTP
(`init_inference(model, tensor_parallel={"tp_size": n}, replace_with_kernel_inject=False)`),
read from deepspeed/module_inject/{replace_module,auto_tp,layers,tp_shard}.py:
- only modules inside LlamaDecoderLayer are sharded, plus `lm_head`. `model.embed_tokens`,
  the final norm and every RMSNorm stay whole on every rank;
- q/k/v_proj are column-parallel (dim 0), o_proj row-parallel (dim 1), both split by whole
  KV-head groups: rank r gets kv_heads // tp (+1 if r < kv_heads % tp) groups;
- gate/up_proj column-parallel, down_proj row-parallel, split in grains of 64
  (`DeepSpeedTPConfig.tp_grain_size`), the remainder going to the last rank;
- lm_head row-parallel (split on the hidden dim, grains of 64) with an all-reduce. A tied
  lm_head is cloned first, so tying saves nothing on the target GPUs.
The planner refuses uneven splits (AutoTP would accept them, but the rank with the extra
head group is the bottleneck of every step).

The draft worker (BRIEF §2) holds the EAGLE head (fc Linear(2H -> H) + decoder layers without
input_layernorm) and a copy of the target's embed_tokens and lm_head, plus the head's KV cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

DTYPE_BYTES = MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4})
AUTOTP_GRAIN = 64  # deepspeed.inference.config.DeepSpeedTPConfig.tp_grain_size default
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
                         "knows DeepSpeed AutoTP's layout for Llama-family models only")
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


# ---------------------------------------------------------------- AutoTP sharding rule


def autotp_shard_size(total: int, tp: int, rank: int, num_kv_heads: int, by_heads: bool) -> int:
    """Rows/columns of a `total`-wide dimension that rank `rank` of `tp` holds under AutoTP.

    Mirrors deepspeed.module_inject.tp_shard.get_shard_size: attention projections split by
    whole KV-head groups, MLP and lm_head in grains of AUTOTP_GRAIN (remainder to the last rank).
    E.g. 3 KV heads, tp=2, q_proj rows 192 -> [128, 64]; MLP 320 rows -> [192, 128].
    """
    if by_heads and total % num_kv_heads == 0:
        num_groups = num_kv_heads // tp + (1 if rank < num_kv_heads % tp else 0)
        return total * num_groups // num_kv_heads
    if total < AUTOTP_GRAIN:
        return total // tp + (1 if rank < total % tp else 0)
    num_grains, remainder = divmod(total, AUTOTP_GRAIN)
    size = (num_grains // tp + (1 if rank < num_grains % tp else 0)) * AUTOTP_GRAIN
    return size + (remainder if rank == tp - 1 else 0)


# parameter-name suffix -> (split dim, split by KV-head groups); anything else is replicated.
# nn.Linear weights are [out, in]: column-parallel splits dim 0, row-parallel dim 1.
_SPLIT_RULES = (
    (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), 0, True),
    (("self_attn.o_proj.weight",), 1, True),
    (("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias"),
     0, False),
    (("mlp.down_proj.weight", "lm_head.weight"), 1, False),
)


def shard_shape(name: str, shape: tuple[int, ...], spec: ModelSpec, tp: int, rank: int
                ) -> tuple[int, ...]:
    """Per-rank shape of the full parameter `name` of `shape` under AutoTP."""
    for suffixes, dim, by_heads in _SPLIT_RULES:
        if name.endswith(suffixes):
            out = list(shape)
            out[dim] = autotp_shard_size(shape[dim], tp, rank, spec.num_key_value_heads, by_heads)
            return tuple(out)
    return tuple(shape)


def check_tp_rank(spec: ModelSpec, tp: int, rank: int) -> None:
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    if tp > spec.num_key_value_heads:
        raise ValueError(f"{spec.name}: tp={tp} exceeds its {spec.num_key_value_heads} KV heads; "
                         "AutoTP splits by whole KV-head groups, so some ranks would hold none")


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
    """Parameter name -> shape on rank `rank` after AutoTP, from a model built on meta.

    `config` is a ModelSpec or a transformers LlamaConfig. A tied lm_head is listed too: AutoTP
    clones it into its own (sharded) parameter.
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
    """Parameters AutoTP leaves on rank `rank`: layer shards + embed + lm_head shard + norm."""
    check_tp_rank(spec, tp, rank)
    shapes = _layer_shapes(spec).items()
    layer = sum(math.prod(shard_shape(n, s, spec, tp, rank)) for n, s in shapes)
    embed = (spec.vocab_size, spec.hidden_size)
    lm_head = shard_shape("lm_head.weight", embed, spec, tp, rank)
    return spec.num_hidden_layers * layer + math.prod(embed) + math.prod(lm_head) + spec.hidden_size


def draft_params(draft: DraftSpec) -> int:
    """The head's own parameters: fc + layers without input_layernorm (BRIEF §2)."""
    h = draft.model.hidden_size
    layer = sum(math.prod(s) for s in _layer_shapes(draft.model, input_norm=False).values())
    return 2 * h * h + (h if draft.fc_bias else 0) + draft.model.num_hidden_layers * layer


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int, tp: int = 1, rank: int = 0) -> int:
    """K and V of every layer for one token on one rank: 2 * L * kv_heads_on_rank * d * bytes."""
    kv_width = autotp_shard_size(spec.num_key_value_heads * spec.head_dim, tp, rank,
                                 spec.num_key_value_heads, by_heads=True)
    return 2 * spec.num_hidden_layers * kv_width * dtype_bytes


def tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Why `tp` is not a clean AutoTP split of `spec` (empty list: it is)."""
    problems = [f"{what} ({n}) is not divisible by tp={tp}" for what, n in (
        ("num_attention_heads", spec.num_attention_heads),
        ("num_key_value_heads", spec.num_key_value_heads),
        ("intermediate_size", spec.intermediate_size)) if n % tp]
    if tp > spec.num_key_value_heads:
        problems.append(f"tp={tp} > {spec.num_key_value_heads} KV heads (AutoTP splits by whole "
                        "KV-head groups)")
    return problems


def valid_tp_sizes(spec: ModelSpec, max_tp: int) -> list[int]:
    return [tp for tp in range(1, max_tp + 1) if not tp_problems(spec, tp)]


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRequest:
    """What to place: `num_gpus` GPUs of one node with `gpu_mem_gib` GiB each."""

    model: ModelSpec
    num_gpus: int
    gpu_mem_gib: float
    draft: DraftSpec | None = None
    tp_size: int | None = None  # None: the largest clean split of the GPUs left by the draft
    dtype: str = "bf16"
    context_len: int | None = None  # None: min(8192, max_position_embeddings)
    reserve_fraction: float = 0.10  # CUDA context, activations, logits, allocator slack

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"--gpus must be >= 1, got {self.num_gpus}")
        if self.gpu_mem_gib <= 0:
            raise ValueError(f"--gpu-mem must be > 0 GiB, got {self.gpu_mem_gib}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {list(DTYPE_BYTES)}")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"--reserve must be in [0, 1), got {self.reserve_fraction}")
        if self.context_len is not None and self.context_len < 1:
            raise ValueError(f"--context must be >= 1, got {self.context_len}")
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"--tp must be >= 1, got {self.tp_size}")
        if self.draft is not None:
            d, t = self.draft.model, self.model
            if (d.hidden_size, d.vocab_size) != (t.hidden_size, t.vocab_size):
                raise ValueError(
                    f"draft {d.name} (hidden {d.hidden_size}, vocab {d.vocab_size}) does not "
                    f"match target {t.name} (hidden {t.hidden_size}, vocab {t.vocab_size}); "
                    "an EAGLE head reads the target's features, embedding and lm_head")


@dataclass(frozen=True)
class DraftPlan:
    """The draft worker's GPU: head + embed/lm_head copy + the head's KV cache."""

    name: str
    head_params: int
    shared_params: int  # embed_tokens + lm_head copied from the target (one tensor if tied)
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    max_sequences: int


@dataclass(frozen=True)
class ServingPlan:
    """Placement and memory of one replica. Bytes are exact; "per GPU" is the fullest rank."""

    model: str
    dtype: str
    num_gpus: int
    gpu_mem_bytes: int
    usable_bytes_per_gpu: int  # gpu_mem * (1 - reserve_fraction)
    tp_size: int
    idle_gpus: int
    context_len: int
    num_params: int
    weight_bytes_total: int  # checkpoint size in `dtype`
    weight_bytes_per_gpu: int  # layer shards + replicated embed_tokens/norms + lm_head shard
    weight_bytes_all_target_gpus: int  # sum over ranks (replication included)
    kv_bytes_per_token: int  # all ranks together
    kv_bytes_per_token_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_tokens_per_gpu: int
    target_max_sequences: int
    max_sequences: int  # min(target, draft) at context_len
    draft: DraftPlan | None
    notes: tuple[str, ...] = ()


def _choose_tp(req: PlanRequest, num_target_gpus: int) -> int:
    where = " after the draft GPU" if req.draft else ""
    if num_target_gpus < 1:
        raise ValueError(f"{req.num_gpus} GPU(s) leave none for the target{where}; "
                         "add GPUs or pass --draft none")
    valid = valid_tp_sizes(req.model, num_target_gpus)
    if req.tp_size is None:
        return valid[-1]  # tp=1 always divides
    if req.tp_size > num_target_gpus:
        raise ValueError(f"tp={req.tp_size} needs {req.tp_size} GPUs but only "
                         f"{num_target_gpus} are left for the target{where}; valid tp: {valid}")
    problems = tp_problems(req.model, req.tp_size)
    if problems:
        raise ValueError(f"tp={req.tp_size} cannot split {req.model.name}: "
                         f"{'; '.join(problems)}. Valid tp on {num_target_gpus} GPUs: {valid}")
    return req.tp_size


def _draft_plan(req: PlanRequest, usable: int, context: int) -> DraftPlan:
    draft, nbytes = req.draft, DTYPE_BYTES[req.dtype]
    embed = req.model.vocab_size * req.model.hidden_size
    shared = embed if req.model.tie_word_embeddings else 2 * embed
    head = draft_params(draft)
    weights = (head + shared) * nbytes
    if weights > usable:
        raise ValueError(f"draft worker needs {weights / GIB:.2f} GiB (head + embed/lm_head) "
                         f"but one GPU has {usable / GIB:.2f} GiB usable; use larger GPUs")
    kv_token = kv_bytes_per_token(draft.model, nbytes)
    max_seq = (usable - weights) // (kv_token * context)
    if max_seq < 1:
        raise ValueError(f"draft worker cannot hold the KV cache of one {context}-token sequence "
                         f"({kv_token * context / GIB:.2f} GiB); lower --context")
    return DraftPlan(draft.name, head, shared, weights, kv_token, usable - weights, max_seq)


def _check_weights_fit(req: PlanRequest, tp: int, weights: int, usable: int) -> None:
    if weights <= usable:
        return
    spec, hint = req.model, ""
    if req.draft and valid_tp_sizes(spec, req.num_gpus)[-1] > tp:
        hint = ", or --draft none to give the draft GPU to the target"
    raise ValueError(
        f"{spec.name} in {req.dtype} needs {weights / GIB:.2f} GiB of weights per GPU at "
        f"tp={tp}, but only {usable / GIB:.2f} GiB of {req.gpu_mem_gib:g} GiB is usable "
        f"(reserve {req.reserve_fraction:.0%}); use more or larger GPUs{hint} "
        f"(valid tp: {valid_tp_sizes(spec, spec.num_key_value_heads)})")


def plan(req: PlanRequest) -> ServingPlan:
    """Place the target (AutoTP) and the draft worker; raise ValueError if it cannot work."""
    spec, nbytes = req.model, DTYPE_BYTES[req.dtype]
    context = req.context_len or min(DEFAULT_CONTEXT, spec.max_position_embeddings)
    if context > spec.max_position_embeddings:
        raise ValueError(f"--context {context} exceeds {spec.name}'s max_position_embeddings "
                         f"{spec.max_position_embeddings}")
    num_target_gpus = req.num_gpus - (1 if req.draft else 0)
    tp = _choose_tp(req, num_target_gpus)
    gpu_mem = int(req.gpu_mem_gib * GIB)
    usable = int(gpu_mem * (1.0 - req.reserve_fraction))
    per_rank = [rank_params(spec, tp, r) * nbytes for r in range(tp)]
    weights = max(per_rank)
    _check_weights_fit(req, tp, weights, usable)
    kv_gpu = max(kv_bytes_per_token(spec, nbytes, tp, r) for r in range(tp))
    kv_tokens = (usable - weights) // kv_gpu
    target_seqs = kv_tokens // context
    if target_seqs < 1:
        raise ValueError(f"after {weights / GIB:.2f} GiB of weights per GPU, the KV cache holds "
                         f"{kv_tokens} tokens per GPU, less than one {context}-token sequence; "
                         "use more GPUs or lower --context")
    draft = _draft_plan(req, usable, context) if req.draft else None
    idle = num_target_gpus - tp
    notes = []
    if idle:
        notes.append(f"{idle} GPU(s) idle: tp must divide {spec.num_key_value_heads} KV heads, "
                     f"{spec.num_attention_heads} heads and {spec.intermediate_size}; valid tp "
                     f"on {num_target_gpus} GPUs: {valid_tp_sizes(spec, num_target_gpus)}")
    return ServingPlan(
        model=spec.name, dtype=req.dtype, num_gpus=req.num_gpus, gpu_mem_bytes=gpu_mem,
        usable_bytes_per_gpu=usable, tp_size=tp, idle_gpus=idle, context_len=context,
        num_params=num_params(spec), weight_bytes_total=num_params(spec) * nbytes,
        weight_bytes_per_gpu=weights, weight_bytes_all_target_gpus=sum(per_rank),
        kv_bytes_per_token=kv_bytes_per_token(spec, nbytes), kv_bytes_per_token_per_gpu=kv_gpu,
        kv_budget_bytes_per_gpu=usable - weights, kv_tokens_per_gpu=kv_tokens,
        target_max_sequences=target_seqs,
        max_sequences=min(target_seqs, draft.max_sequences) if draft else target_seqs,
        draft=draft, notes=tuple(notes))


# ---------------------------------------------------------------- CLI glue


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `eagle2 plan`."""
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}) or a config.json / its directory")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs on the node")
    parser.add_argument("--gpu-mem", type=float, required=True,
                        help="memory per GPU in GiB (an '80 GB' H100 is 80 GiB)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size (default: largest valid on the GPUs left "
                             "after the draft GPU)")
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16")
    parser.add_argument("--context", type=int, default=None,
                        help=f"tokens per sequence (default: {DEFAULT_CONTEXT} or the model's "
                             "max_position_embeddings if smaller)")
    parser.add_argument("--draft", default="auto",
                        help=f"'auto' (head shaped like the target), 'none', a preset "
                             f"({', '.join(DRAFT_PRESETS)}) or a head's config.json")
    parser.add_argument("--reserve", type=float, default=0.10,
                        help="fraction of each GPU kept for CUDA context and activations")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(p: ServingPlan) -> str:
    """Human-readable summary of a plan."""
    draft_gpus = 1 if p.draft else 0
    target = f"target: tp={p.tp_size} (AutoTP) on GPUs 0-{p.tp_size - 1}"
    target += f", draft worker on GPU {p.tp_size}" if p.draft else ""
    target += f", {p.idle_gpus} idle" if p.idle_gpus else ""
    lines = [
        (f"{p.model}, {p.dtype}, {p.num_gpus} x {_gib(p.gpu_mem_bytes)} "
         f"({_gib(p.usable_bytes_per_gpu)} usable each), context {p.context_len}"),
        target,
        (f"weights: {p.num_params:,} params = {_gib(p.weight_bytes_total)}; per GPU "
         f"{_gib(p.weight_bytes_per_gpu)} (embed_tokens replicated, lm_head split)"),
        (f"KV cache: {p.kv_bytes_per_token:,} B/token, {p.kv_bytes_per_token_per_gpu:,} B/token "
         f"per GPU; {_gib(p.kv_budget_bytes_per_gpu)} free per GPU = {p.kv_tokens_per_gpu:,} "
         f"tokens = {p.target_max_sequences} sequences"),
    ]
    if p.draft:
        d = p.draft
        lines.append(f"draft: {d.name}: head {d.head_params:,} + embed/lm_head "
                     f"{d.shared_params:,} params = {_gib(d.weight_bytes)}; KV "
                     f"{d.kv_bytes_per_token:,} B/token; fits, {d.max_sequences} sequences")
    lines.append(f"max concurrent sequences at {p.context_len} tokens: {p.max_sequences}"
                 f" on {p.tp_size + draft_gpus} GPUs")
    return "\n".join(lines + [f"note: {n}" for n in p.notes])


def run(args: argparse.Namespace) -> int:
    """`eagle2 plan`: print the plan; on an impossible layout print why to stderr, return 1."""
    try:
        model = load_model_spec(args.model)
        req = PlanRequest(model=model, num_gpus=args.gpus, gpu_mem_gib=args.gpu_mem,
                          draft=load_draft_spec(args.draft, model), tp_size=args.tp,
                          dtype=args.dtype, context_len=args.context,
                          reserve_fraction=args.reserve)
        result = plan(req)
    except ValueError as err:
        print(f"eagle2 plan: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(result), indent=2) if args.json else format_plan(result))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="eagle2 plan", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
