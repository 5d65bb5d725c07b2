"""Node layouts: how to use every GPU of a node, ranked by expected tokens/s per node.

A layout is R replicas of a tp-T target, each with a draft worker that either has its own GPU
("own"), shares a GPU with one of the replica's ranks ("shared", a fractional Ray GPU), or is
absent ("none", plain decoding). The estimate is a roofline of one decode step of a replica,
which on GPUs is bound by memory traffic at the batch sizes where speculation pays:

    verify = (weights per GPU + KV read per GPU) / bandwidth + 2 * L * all-reduce latency
             + 2 * params per GPU * B * N / peak FLOP/s       (tree tokens N per sequence)
    draft  = (depth + 1) * (head + lm_head bytes) / bandwidth     (embedding rows are lookups;
             the lm_head is the target's for EAGLE-1/2, an EAGLE-3 head's own smaller one)
    tokens/s per node = R * B * tau / (draft + verify)

Draft and verify alternate, so a draft worker on its own GPU costs the same time as one that
shares a rank's GPU, but it takes a GPU away from the targets: sharing wins whenever its memory
fits beside the rank's shard. The numbers are estimates for ranking; `make gpu-check` and
`eagle2 bench` measure the real ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle2.plan.memory import (
    draft_buffer_bytes,
    draft_step_params,
    draft_worker_params,
    kv_bytes_per_token,
    rank_params,
    valid_tp_sizes,
)
from eagle2.plan.specs import DEFAULT_CONTEXT, DTYPE_BYTES, GIB, DraftSpec, ModelSpec

DRAFT_PLACEMENTS = ("shared", "own", "none")


@dataclass(frozen=True)
class Hardware:
    """One GPU type: memory, HBM bandwidth, dense bf16 FLOP/s, all-reduce latency per call."""

    gpu_mem_gib: float = 80.0
    bandwidth_gbs: float = 3350.0  # H100 SXM HBM3
    peak_tflops: float = 600.0  # dense bf16 actually reached, below the 989 on the sheet
    allreduce_us: float = 12.0  # small all-reduce over NVLink
    reserve_fraction: float = 0.10

    def __post_init__(self) -> None:
        if min(self.gpu_mem_gib, self.bandwidth_gbs, self.peak_tflops) <= 0:
            raise ValueError("GPU memory, bandwidth and FLOP/s must be > 0")


@dataclass(frozen=True)
class Workload:
    """What the estimate assumes about the traffic."""

    max_batch: int = 8  # sequences per replica (the service's max_running)
    context_len: int = DEFAULT_CONTEXT
    tree_tokens: int = 26  # N verified per sequence and step
    depth: int = 5  # draft levels after the root step
    tau: float = 3.3  # tokens per step with speculation (EAGLE-2 paper, LLaMA3-70B: 4.16)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.tree_tokens < 1 or self.tau < 1.0:
            raise ValueError("max_batch and tree_tokens must be >= 1, tau >= 1")


@dataclass(frozen=True)
class NodeLayout:
    replicas: int
    tp_size: int
    draft: str  # "shared" | "own" | "none"
    draft_gpu_fraction: float  # the draft worker's Ray GPU share (0: none)
    idle_gpus: int
    batch: int  # sequences per replica in the estimate
    step_ms: float
    tokens_per_s: float  # per node
    reasons: tuple[str, ...]


def _draft_bytes(model: ModelSpec, draft: DraftSpec, nbytes: int) -> int:
    """The draft worker's weights: head + the target's embed/lm_head + vocabulary maps."""
    return draft_worker_params(model, draft) * nbytes + draft_buffer_bytes(draft)


def _layout(model: ModelSpec, draft: DraftSpec | None, placement: str, tp: int,
            num_gpus: int, hw: Hardware, work: Workload, dtype: str) -> NodeLayout | None:
    """One candidate, or None when it does not fit."""
    nbytes = DTYPE_BYTES[dtype]
    per_replica = tp + (1 if placement == "own" else 0)
    replicas = num_gpus // per_replica
    if replicas < 1 or (placement != "none" and draft is None):
        return None
    usable = int(hw.gpu_mem_gib * GIB * (1 - hw.reserve_fraction))
    weights = rank_params(model, tp, 0) * nbytes
    head = _draft_bytes(model, draft, nbytes) if draft else 0
    head_kv = kv_bytes_per_token(draft.model, nbytes) if draft else 0
    kv_gpu = kv_bytes_per_token(model, nbytes, tp)
    shared_extra = head if placement == "shared" else 0
    free = usable - weights - shared_extra  # the fullest GPU of the replica
    per_seq = work.context_len * (kv_gpu + (head_kv if placement == "shared" else 0))
    if free < per_seq or (placement == "own" and head + head_kv * work.context_len > usable):
        return None
    batch = min(work.max_batch, free // per_seq)
    bw = hw.bandwidth_gbs * 1e9
    tokens = work.tree_tokens if placement != "none" else 1
    kv_read = batch * (work.context_len // 2) * kv_gpu  # on average half the context is filled
    verify = ((weights + kv_read) / bw + (2 * model.num_hidden_layers * hw.allreduce_us * 1e-6
                                          if tp > 1 else 0.0)
              + 2 * rank_params(model, tp, 0) * batch * tokens / (hw.peak_tflops * 1e12))
    head_read = draft_step_params(model, draft) * nbytes if draft else 0
    draft_s = (work.depth + 1) * head_read / bw if placement != "none" else 0.0
    tau = work.tau if placement != "none" else 1.0
    step = verify + draft_s
    fraction = 0.0 if placement == "none" else 1.0 if placement == "own" else \
        math.ceil(20 * (head + head_kv * work.context_len * batch) / (hw.gpu_mem_gib * GIB)) / 20
    if placement == "shared" and tp > 1 and fraction >= 0.5:
        return None  # ranks of 1 - fraction <= 0.5 GPU: Ray could put two on one GPU
    reasons = [
        f"{replicas} x tp{tp} on {replicas * per_replica} of {num_gpus} GPUs",
        f"weights {weights / GIB:.1f} GiB per GPU; KV room for {free // per_seq} sequences of "
        f"{work.context_len} tokens, batch {batch} per replica",
        f"step {1000 * step:.1f} ms = verify {1000 * verify:.1f} (weights+KV "
        f"{1000 * (weights + kv_read) / bw:.1f}, all-reduce, {tokens}-token trees) + draft "
        f"{1000 * draft_s:.1f}; {1000 * step / tau:.1f} ms per token per sequence",
    ]
    if placement == "shared":
        reasons.append(f"draft worker shares a rank's GPU ({fraction:.2f} of it, "
                       f"{head / GIB:.1f} GiB of head + embed/lm_head): no GPU spent on it")
    elif placement == "own":
        reasons.append("draft worker on its own GPU: the same step time, one GPU fewer for "
                       "targets")
    else:
        reasons.append("no speculation: one token per step")
    idle = num_gpus - replicas * per_replica
    if idle:
        reasons.append(f"{idle} GPU(s) idle")
    return NodeLayout(replicas, tp, placement, fraction, idle, batch, round(1000 * step, 2),
                      round(replicas * batch * tau / step, 1), tuple(reasons))


def node_layouts(model: ModelSpec, draft: DraftSpec | None, num_gpus: int,
                 hw: Hardware = Hardware(), work: Workload = Workload(),
                 dtype: str = "bf16") -> list[NodeLayout]:
    """Every layout that fits, best tokens/s per node first (ties: fewer idle GPUs)."""
    if num_gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {num_gpus}")
    found = [lay for tp in valid_tp_sizes(model, num_gpus) for placement in DRAFT_PLACEMENTS
             if (lay := _layout(model, draft, placement, tp, num_gpus, hw, work, dtype))]
    if not found:
        raise ValueError(f"no layout of {model.name} fits {num_gpus} x {hw.gpu_mem_gib:g} GiB")
    return sorted(found, key=lambda lay: (-lay.tokens_per_s, lay.idle_gpus))


def format_layouts(layouts: list[NodeLayout], top: int = 5) -> str:
    lines = []
    for i, lay in enumerate(layouts[:top], 1):
        lines.append(f"{i}. {lay.replicas} x tp{lay.tp_size}, draft {lay.draft}: "
                     f"~{lay.tokens_per_s:,.0f} tokens/s per node")
        lines += [f"   - {r}" for r in lay.reasons]
    return "\n".join(lines)
