"""The plan of one replica: tensor-parallel size, weights and KV cache per GPU, the draft
worker's GPU."""

from __future__ import annotations

from dataclasses import dataclass

from eagle2.plan.memory import (
    draft_buffer_bytes,
    draft_params,
    draft_worker_target_params,
    kv_bytes_per_token,
    num_params,
    rank_params,
    tp_problems,
    valid_tp_sizes,
)
from eagle2.plan.specs import DEFAULT_CONTEXT, DTYPE_BYTES, GIB, DraftSpec, ModelSpec

TREE_MARGIN = 130  # `Engine.tree_margin`: cache entries a request holds past its context


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
    # the service's paged cache (docs/kv-cache.md "In the service"): entries per block, and
    # kv_cache_memory: bytes of all ranks together, or a fraction in (0, 1] of each GPU's
    # memory left by the weights (None: what the reserve and the weights leave)
    block_size: int = 32
    kv_cache_memory: float | None = None

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
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0, got {self.kv_cache_memory}")
        if self.draft is not None:
            d, t = self.draft.model, self.model
            if (d.hidden_size, d.vocab_size) != (t.hidden_size, t.vocab_size):
                raise ValueError(
                    f"draft {d.name} (hidden {d.hidden_size}, vocab {d.vocab_size}) does not "
                    f"match target {t.name} (hidden {t.hidden_size}, vocab {t.vocab_size}); "
                    "an EAGLE head reads the target's features and embedding (EAGLE-1/2: "
                    "and its lm_head)")


@dataclass(frozen=True)
class DraftPlan:
    """The draft worker's GPU: head + the target's embed/lm_head + the head's KV cache."""

    name: str
    kind: str  # "eagle2" (EAGLE-1/2) | "eagle3"
    head_params: int  # the head's own (EAGLE-3: its lm_head over the draft vocabulary too)
    shared_params: int  # embed_tokens + lm_head loaded from the target (one tensor if tied)
    buffer_bytes: int  # EAGLE-3: the d2t map
    weight_bytes: int  # (head + shared) params in the dtype + buffers
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
    # the paged cache of the KV budget: blocks of block_size entries per GPU (the null block
    # left out), and how many sequences of context_len + TREE_MARGIN entries they hold
    block_size: int = 32
    kv_blocks_per_gpu: int = 0
    paged_max_sequences: int = 0


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
    shared = draft_worker_target_params(req.model, draft)
    head = draft_params(draft)
    buffers = draft_buffer_bytes(draft)
    weights = (head + shared) * nbytes + buffers
    if weights > usable:
        raise ValueError(f"draft worker needs {weights / GIB:.2f} GiB (head + embed/lm_head) "
                         f"but one GPU has {usable / GIB:.2f} GiB usable; use larger GPUs")
    kv_token = kv_bytes_per_token(draft.model, nbytes)
    max_seq = (usable - weights) // (kv_token * context)
    if max_seq < 1:
        raise ValueError(f"draft worker cannot hold the KV cache of one {context}-token sequence "
                         f"({kv_token * context / GIB:.2f} GiB); lower --context")
    return DraftPlan(draft.name, draft.kind, head, shared, buffers, weights, kv_token,
                     usable - weights, max_seq)


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
    """Place the target (tensor-parallel) and the draft worker; ValueError if it cannot work."""
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
    kv_budget = _kv_budget(req, tp, gpu_mem - weights, usable - weights)
    kv_tokens = kv_budget // kv_gpu
    target_seqs = kv_tokens // context
    if target_seqs < 1:
        raise ValueError(f"after {weights / GIB:.2f} GiB of weights per GPU, the KV cache holds "
                         f"{kv_tokens} tokens per GPU, less than one {context}-token sequence; "
                         "use more GPUs or lower --context")
    draft = _draft_plan(req, usable, context) if req.draft else None
    idle = num_target_gpus - tp
    notes = []
    if kv_budget > usable - weights:
        notes.append(f"kv_cache_memory takes {kv_budget / GIB:.2f} GiB per GPU, more than the "
                     f"{(usable - weights) / GIB:.2f} GiB the reserve leaves")
    blocks = max(kv_budget // (kv_gpu * req.block_size) - 1, 0)
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
        kv_budget_bytes_per_gpu=kv_budget, kv_tokens_per_gpu=kv_tokens,
        target_max_sequences=target_seqs,
        max_sequences=min(target_seqs, draft.max_sequences) if draft else target_seqs,
        draft=draft, notes=tuple(notes), block_size=req.block_size, kv_blocks_per_gpu=blocks,
        paged_max_sequences=blocks // -(-(context + TREE_MARGIN) // req.block_size))


def _kv_budget(req: PlanRequest, tp: int, after_weights: int, usable_left: int) -> int:
    """One GPU's K/V bytes: kv_cache_memory / tp (bytes: all ranks'), or that fraction of
    the memory the weights leave; None: what the reserve and the weights leave."""
    mem = req.kv_cache_memory
    if mem is None:
        return usable_left
    return int(mem * after_weights) if mem <= 1 else int(mem) // tp

