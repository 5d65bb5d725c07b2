"""Placement and memory planner: a Llama target tensor-parallel on N GPUs + an EAGLE draft worker.

Deployment step before serving (docs/DESIGN.md "Overview"): decide the tensor-parallel size,
check that the target's shards and the draft worker fit, and say how many sequences of a given
context the KV caches hold. Pure arithmetic over config.json values; `shard_shapes` additionally
builds the model on the meta device (no weights allocated) to list the per-rank parameter shapes.

What the engine loads per target GPU mirrors `eagle2.tp` (docs/DESIGN.md "Tensor
parallelism"): q/k/v and gate/up projections split evenly by rows (whole KV-head groups), o and
down projections by columns; embed_tokens, the norms and lm_head stay whole on every rank. The
planner refuses tp sizes that do not divide the heads, the KV heads and the MLP width.

The draft worker (docs/DESIGN.md "Draft head")
holds the EAGLE head (fc Linear(2H -> H) + decoder layers without
input_layernorm) and a copy of the target's embed_tokens and lm_head, plus the head's KV cache.

Modules: `specs` (model and head specs), `memory` (per-rank arithmetic), `layout` (the plan
of one replica), `layouts` (whole-node layouts ranked by tokens/s), `cli` (`eagle2 plan`).
"""

from eagle2.plan.cli import add_arguments, format_plan, run
from eagle2.plan.layout import DraftPlan, PlanRequest, ServingPlan, plan
from eagle2.plan.layouts import Hardware, NodeLayout, Workload, format_layouts, node_layouts
from eagle2.plan.memory import (
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
    "DEFAULT_CONTEXT",
    "DRAFT_PRESETS",
    "DTYPE_BYTES",
    "GIB",
    "PRESETS",
    "DraftPlan",
    "DraftSpec",
    "Hardware",
    "ModelSpec",
    "NodeLayout",
    "PlanRequest",
    "ServingPlan",
    "Workload",
    "add_arguments",
    "check_tp_rank",
    "draft_params",
    "eagle_head_for",
    "format_layouts",
    "format_plan",
    "kv_bytes_per_token",
    "load_draft_spec",
    "load_model_spec",
    "node_layouts",
    "num_params",
    "plan",
    "rank_params",
    "run",
    "shard_shape",
    "shard_shapes",
    "spec_from_config",
    "to_hf_config",
    "tp_problems",
    "valid_tp_sizes",
]
