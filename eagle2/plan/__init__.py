"""Placement and memory planner: a Llama target tensor-parallel on N GPUs + an EAGLE draft worker.

Deployment step before serving (docs/DESIGN.md "Overview"): decide the tensor-parallel size,
check that the target's shards and the draft worker fit, and say how many sequences of a given
context the KV caches hold. Pure arithmetic over config.json values; `shard_shapes` additionally
builds the model on the meta device (no weights allocated) to list the per-rank parameter shapes.

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

The draft worker (docs/DESIGN.md "Draft head")
holds the EAGLE head (fc Linear(2H -> H) + decoder layers without
input_layernorm) and a copy of the target's embed_tokens and lm_head, plus the head's KV cache.

Modules: `specs` (model and head specs), `memory` (per-rank arithmetic), `layout` (the
plan), `cli` (`eagle2 plan`).
"""

from eagle2.plan.cli import add_arguments, format_plan, run
from eagle2.plan.layout import DraftPlan, PlanRequest, ServingPlan, plan
from eagle2.plan.memory import (
    autotp_shard_size,
    check_tp_rank,
    draft_params,
    kv_bytes_per_token,
    num_params,
    rank_params,
    shard_shape,
    shard_shapes,
    to_hf_config,
    tp_problems,
    valid_tp_sizes,
)
from eagle2.plan.specs import (
    AUTOTP_GRAIN,
    DEFAULT_CONTEXT,
    DRAFT_PRESETS,
    DTYPE_BYTES,
    GIB,
    PRESETS,
    DraftSpec,
    ModelSpec,
    eagle_head_for,
    load_draft_spec,
    load_model_spec,
    spec_from_config,
)

__all__ = [
    "AUTOTP_GRAIN", "DEFAULT_CONTEXT", "DRAFT_PRESETS", "DTYPE_BYTES", "GIB", "PRESETS",
    "DraftPlan", "DraftSpec", "ModelSpec", "PlanRequest", "ServingPlan", "add_arguments",
    "autotp_shard_size", "check_tp_rank", "draft_params", "eagle_head_for", "format_plan",
    "kv_bytes_per_token", "load_draft_spec", "load_model_spec", "num_params", "plan",
    "rank_params", "run", "shard_shape", "shard_shapes", "spec_from_config", "to_hf_config",
    "tp_problems", "valid_tp_sizes",
]
