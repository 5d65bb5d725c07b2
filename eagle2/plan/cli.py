"""`eagle2 plan`: arguments, the human-readable summary and the command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from eagle2.plan.layout import TREE_MARGIN, DraftPlan, PlanRequest, ServingPlan, plan
from eagle2.plan.layouts import Hardware, Workload, format_layouts, node_layouts
from eagle2.plan.specs import (
    DEFAULT_CONTEXT,
    DRAFT_PRESETS,
    DTYPE_BYTES,
    GIB,
    PRESETS,
    load_draft_spec,
    load_model_spec,
)


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
                        help=f"'auto' (a preset target's published head, EAGLE-3 where there "
                             f"is one, else an EAGLE-1/2 head shaped like the target), 'none', "
                             f"a preset ({', '.join(DRAFT_PRESETS)}) or a head's config.json / "
                             "its directory (EAGLE-1/2 or EAGLE-3)")
    parser.add_argument("--reserve", type=float, default=0.10,
                        help="fraction of each GPU kept for CUDA context and activations")
    parser.add_argument("--block-size", type=int, default=32,
                        help="entries per block of the paged KV cache (the service's)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="the service's kv_cache_memory: bytes of all ranks together, or a "
                             "fraction in (0, 1] of each GPU's memory after the weights "
                             "(default: what --reserve and the weights leave)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--layouts", action="store_true",
                        help="rank whole-node layouts (replicas x tp, draft worker shared / own "
                             "GPU / none) by expected tokens/s per node")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="--layouts: sequences per replica (the service's max_running)")
    parser.add_argument("--tree-tokens", type=int, default=26,
                        help="--layouts: draft-tree nodes verified per sequence and step")
    parser.add_argument("--tau", type=float, default=3.3,
                        help="--layouts: expected tokens per step with speculation")
    parser.add_argument("--gpu-bw", type=float, default=3350.0,
                        help="--layouts: HBM bandwidth per GPU in GB/s (H100 SXM: 3350)")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(p: ServingPlan) -> str:
    """Human-readable summary of a plan."""
    draft_gpus = 1 if p.draft else 0
    target = f"target: tp={p.tp_size} on GPUs 0-{p.tp_size - 1}"
    target += f", draft worker on GPU {p.tp_size}" if p.draft else ""
    target += f", {p.idle_gpus} idle" if p.idle_gpus else ""
    lines = [
        (f"{p.model}, {p.dtype}, {p.num_gpus} x {_gib(p.gpu_mem_bytes)} "
         f"({_gib(p.usable_bytes_per_gpu)} usable each), context {p.context_len}"),
        target,
        (f"weights: {p.num_params:,} params = {_gib(p.weight_bytes_total)}; per GPU "
         f"{_gib(p.weight_bytes_per_gpu)} (embed_tokens and lm_head whole on every rank)"),
        (f"KV cache: {p.kv_bytes_per_token:,} B/token, {p.kv_bytes_per_token_per_gpu:,} B/token "
         f"per GPU; {_gib(p.kv_budget_bytes_per_gpu)} free per GPU = {p.kv_tokens_per_gpu:,} "
         f"tokens = {p.target_max_sequences} sequences"),
        (f"paged: {p.kv_blocks_per_gpu:,} blocks of {p.block_size} per GPU = "
         f"{p.paged_max_sequences} sequences of {p.context_len} + {TREE_MARGIN} entries"),
    ]
    if p.draft:
        lines.append(_format_draft(p.draft))
    lines.append(f"max concurrent sequences at {p.context_len} tokens: {p.max_sequences}"
                 f" on {p.tp_size + draft_gpus} GPUs")
    return "\n".join(lines + [f"note: {n}" for n in p.notes])


def _format_draft(d: DraftPlan) -> str:
    if d.kind == "eagle3":
        head = (f"EAGLE-3 head {d.head_params:,} (own lm_head included) + target "
                f"embedding {d.shared_params:,} params + d2t {d.buffer_bytes:,} B")
    else:
        head = f"head {d.head_params:,} + embed/lm_head {d.shared_params:,} params"
    return (f"draft: {d.name}: {head} = {_gib(d.weight_bytes)}; KV {d.kv_bytes_per_token:,} "
            f"B/token; fits, {d.max_sequences} sequences")


def run_layouts(args: argparse.Namespace) -> int:
    """`eagle2 plan --layouts`: every fitting node layout, best first, with the reasons."""
    try:
        model = load_model_spec(args.model)
        hw = Hardware(gpu_mem_gib=args.gpu_mem, bandwidth_gbs=args.gpu_bw,
                      reserve_fraction=args.reserve)
        work = Workload(max_batch=args.max_batch, tree_tokens=args.tree_tokens, tau=args.tau,
                        context_len=args.context or min(DEFAULT_CONTEXT,
                                                        model.max_position_embeddings))
        layouts = node_layouts(model, load_draft_spec(args.draft, model), args.gpus, hw, work,
                               args.dtype)
    except ValueError as err:
        print(f"eagle2 plan: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps([dataclasses.asdict(lay) for lay in layouts], indent=2) if args.json
          else format_layouts(layouts))
    return 0


def run(args: argparse.Namespace) -> int:
    """`eagle2 plan`: print the plan; on an impossible layout print why to stderr, return 1."""
    if getattr(args, "layouts", False):
        return run_layouts(args)
    try:
        model = load_model_spec(args.model)
        req = PlanRequest(model=model, num_gpus=args.gpus, gpu_mem_gib=args.gpu_mem,
                          draft=load_draft_spec(args.draft, model), tp_size=args.tp,
                          dtype=args.dtype, context_len=args.context,
                          reserve_fraction=args.reserve, block_size=args.block_size,
                          kv_cache_memory=args.kv_cache_memory)
        result = plan(req)
    except ValueError as err:
        print(f"eagle2 plan: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(result), indent=2) if args.json else format_plan(result))
    return 0

