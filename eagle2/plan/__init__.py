"""Placement and memory planner: a Llama target tensor-parallel on N GPUs + an EAGLE draft worker.

Deployment step before serving (docs/README.md "Overview"): decide the tensor-parallel size,
check that the target's shards and the draft worker fit, and say how many sequences of a given
context the KV caches hold. Pure arithmetic over config.json values; `shard_shapes` additionally
builds the model on the meta device (no weights allocated) to list the per-rank parameter shapes.

What the engine loads per target GPU mirrors `eagle2.tp` (docs/tensor-parallel.md "Tensor
parallelism"): q/k/v and gate/up projections split evenly by rows (whole KV-head groups), o and
down projections by columns; embed_tokens, the norms and lm_head stay whole on every rank. The
planner refuses tp sizes that do not divide the heads, the KV heads and the MLP width.

The draft worker (docs/draft-tree.md "Draft head") holds the head, a copy of the target's
embed_tokens and lm_head, and the head's KV cache. An EAGLE-1/2 head is fc Linear(2H -> H) +
decoder layers without input_layernorm and drafts through the target's lm_head; an EAGLE-3
head (eagle2/eagle3.py) is fc Linear(3H -> H) + one decoder layer with 2H-input q/k/v + its
own lm_head over a reduced vocabulary and its d2t map (the target's lm_head is loaded all the
same: `memory.draft_worker_target_params`).

Modules: `specs` (model and head specs), `memory` (per-rank arithmetic), `layout` (the plan
of one replica), `layouts` (whole-node layouts ranked by tokens/s), `cli` (`eagle2 plan`).
"""

from eagle2.plan.cli import add_arguments, format_plan, run
from eagle2.plan.layout import DraftPlan, PlanRequest, ServingPlan, plan
from eagle2.plan.layouts import Hardware, NodeLayout, Workload, format_layouts, node_layouts
from eagle2.plan.memory import (
    check_tp_rank,
    draft_buffer_bytes,
    draft_params,
    draft_shapes,
    draft_step_params,
    draft_worker_params,
    draft_worker_target_params,
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
    DEFAULT_DRAFTS,
    DRAFT_KINDS,
    DRAFT_PRESETS,
    DTYPE_BYTES,
    GIB,
    PRESETS,
    DraftPreset,
    DraftSpec,
    ModelSpec,
    default_draft,
    draft_spec_from_config,
    eagle3_head_for,
    eagle_head_for,
    is_eagle3_config,
    load_draft_spec,
    load_model_spec,
    spec_from_config,
)

__all__ = [
    "DEFAULT_CONTEXT",
    "DEFAULT_DRAFTS",
    "DRAFT_KINDS",
    "DRAFT_PRESETS",
    "DTYPE_BYTES",
    "GIB",
    "PRESETS",
    "DraftPlan",
    "DraftPreset",
    "DraftSpec",
    "Hardware",
    "ModelSpec",
    "NodeLayout",
    "PlanRequest",
    "ServingPlan",
    "Workload",
    "add_arguments",
    "check_tp_rank",
    "default_draft",
    "draft_buffer_bytes",
    "draft_params",
    "draft_shapes",
    "draft_spec_from_config",
    "draft_step_params",
    "draft_worker_params",
    "draft_worker_target_params",
    "eagle3_head_for",
    "eagle_head_for",
    "format_layouts",
    "format_plan",
    "is_eagle3_config",
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
