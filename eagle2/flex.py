"""Tree attention through PyTorch's FlexAttention: the attention of EAGLE-2's verification
step (the target's one forward over the whole draft tree) and of the draft head's tree
expansion, over the slotted or paged KV cache without a dense mask.

The torch backend (`eagle2.backend.Backend`) builds a [B, 1, N, S] bool mask per forward for
`F.scaled_dot_product_attention`; with a mask (and GQA) SDPA may fall back to its math kernel
(fp32 upcast, K/V repeated per head). Here the rule of `eagle2.attention` (query i of request b
sees key j iff window_start[b] <= j < length[b], or j = length[b] + m with tree_mask[b, i, m])
is a FlexAttention `mask_mod` that reads only the committed lengths [B] and the tree mask
[B, N, T], and a `BlockMask` built from the same two (`tree_block_mask`, on the device) lists,
per request, the KV blocks of 128 keys the kernel visits: those wholly inside the visible
prefix as full (no mask_mod), the blocks holding the prefix's ragged ends or a tree entry as
partial, none past the tree. Both are built once per forward (`flex_step_inputs`) and shared
by every layer, through the
`AttentionWindow` hook of `attention.cached_attention` (which writes the new K/V into the cache
first). GQA runs as `enable_gqa=True`: K/V are never repeated per head.

On CUDA `flex_attention` runs compiled (`torch.compile`, the documented way to get the fused
kernel; `dynamic=True`, as the batch, the tree and the used prefix change every step), over
the whole cache rows of contiguous slots (a fixed shape: the block mask skips the unused
blocks). Elsewhere it runs eagerly unless asked (`FlexBackend(compiled=True)`; the CPU build
compiles it too, but each new shape costs ~20 s): the eager kernel materialises the scores of
the used prefix (not of the whole cache) and ignores the block lists, so the CPU checks the
mask_mod (and, compiled, the block lists) against the dense reference, not the GPU's speed.

Over a paged cache (docs/kv-cache.md) a compiled FlexBackend can read the blocks where they
lie (`PagedFlexWindow`; EAGLE2_PAGED_IN_PLACE=1 or `FlexBackend(paged_in_place=True)`; not
the default until a GPU has run it), as torch's experimental PagedAttention does, instead of
copying each layer's used entries into rows first (per layer [B, KVH, S, Dh] for K and V: at
64 requests of 2k tokens, a 70B layer's share of a GPU copied ~67 MB twice, read once more by
the kernel). Its caches are laid out heads-outer (`KVCache.allocate_paged(heads_outer=True)`), so
that a layer's KV head is one run of every block (`KVCache.head_runs`, [1, KVH, blocks x S,
Dh]: key j x S + p is entry p of block j) that all requests' queries attend to;
`paged_block_mask` maps each request's block lists through its block table, and its
mask_mod maps a key back to the request's position (blocks that are not the request's are
never seen). Eager, the kernel would score every block of the cache, so only tests ask for
it (`FlexBackend(paged_in_place=True)`), with small caches. CUDA graphs' padded steps attend
by SDPA over gathered entries unless EAGLE2_GRAPH_ATTENTION=flex (docs/architecture.md "On
GPUs").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eagle2.attention import KVCache, StepInputs, cached_attention, step_inputs, vocab_projection
from eagle2.backend import Backend

BLOCK = 128  # FlexAttention's sparse block size (queries and keys)
# "1": a compiled FlexBackend reads paged caches in place by default (`FlexBackend.reads_blocks`)
PAGED_IN_PLACE_ENV = "EAGLE2_PAGED_IN_PLACE"

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tree_mask_mod(base: torch.Tensor, tree_mask: torch.Tensor,
                  window: int | None = None) -> MaskMod:
    """The attention rule as a FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool.

    base: [B] committed lengths; tree_mask: [B, N, T] the scratch entries (at base + m) each
    new token sees. window: also hide prefix entries older than base - window. The sizes are
    read from the tensors inside (not closed over as ints), so a compiled kernel is not
    specialised to one tree size; indices are clamped because a compiled kernel may evaluate
    the mask past the sequence ends (where the key is masked anyway)."""

    def tree_part(b, q_idx, kv_idx):
        num_n, num_t = tree_mask.shape[1], tree_mask.shape[2]
        m = kv_idx - base[b]
        seen = tree_mask[b, q_idx.clamp(max=num_n - 1), m.clamp(0, num_t - 1)]
        return (m >= 0) & (m < num_t) & seen

    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < base[b]) | tree_part(b, q_idx, kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            start = base[b]
            prefix = (kv_idx < start) & (kv_idx >= start - window)
            return prefix | tree_part(b, q_idx, kv_idx)
    return mask_mod


@functools.lru_cache(maxsize=32)
def _block_starts(num_blocks: int, block: int, device: torch.device) -> torch.Tensor:
    """[K] the first key position of each KV block (made once per cache length and device)."""
    with torch.inference_mode(False):
        return torch.arange(num_blocks, device=device) * block


def tree_block_mask(base: torch.Tensor, tree_mask: torch.Tensor, kv_len: int,
                    window: int | None = None, block: int = BLOCK) -> BlockMask:
    """The BlockMask of `tree_mask_mod` over kv_len keys, from the lengths and the tree mask
    alone (O(B * N * T + B * kv_len / block) work on the device, no host synchronisation, no
    [B, N, S] tensor).

    Per request b and block of `block` queries: KV blocks wholly inside [window_start, base)
    are full (every query sees every key: the kernel skips mask_mod); blocks holding a ragged
    end of the prefix, or a scratch entry some query of the block sees, are partial (mask_mod
    decides each key); all others (the unused cache past the tree) are skipped."""
    return BlockMask.from_kv_blocks(
        *_tree_blocks(base, tree_mask, kv_len, window, block, block), BLOCK_SIZE=block,
        mask_mod=tree_mask_mod(base, tree_mask, window),
        seq_lengths=(tree_mask.shape[1], kv_len), compute_q_blocks=False)


def paged_block_mask(base: torch.Tensor, tree_mask: torch.Tensor, tables: torch.Tensor,
                     num_blocks: int, block_size: int, window: int | None = None
                     ) -> BlockMask:
    """The BlockMask of `tree_mask_mod` over a paged cache read in place: the keys are every
    block's entries, entry p of block j at j * block_size + p (`KVCache.head_runs`). tables:
    [B, nb] each request's blocks holding its first nb * block_size positions
    (`KVCache.table_rows`); num_blocks: the cache's blocks, the null block (the last)
    included.

    The lists are `tree_block_mask`'s over each request's positions with KV blocks of
    block_size, mapped through its table to the blocks that hold them (as torch's
    experimental PagedAttention converts a logical block mask); the mask_mod maps a key back
    to its request's position through the inverse table [B, num_blocks] (-1: a block not the
    request's, never seen)."""
    num_b, num_n, _ = tree_mask.shape
    nb, dev = tables.shape[1], tables.device
    num_partial, partial_idx, num_full, full_idx = _tree_blocks(
        base, tree_mask, nb * block_size, window, BLOCK, block_size)
    rows = tables[:, None, None, :]  # [B, 1, 1, nb]

    def held(idx: torch.Tensor) -> torch.Tensor:
        """Logical block indices [B, 1, Qb, nb] -> the blocks holding them [B, 1, Qb, blocks]
        (the kernel reads only the first `num` of each row; the lists span every block)."""
        out = torch.zeros(*idx.shape[:-1], num_blocks, dtype=torch.int32, device=dev)
        out[..., :nb] = rows.expand_as(idx).gather(-1, idx.long())
        return out

    logical = torch.full((num_b, num_blocks), -1, dtype=torch.int32, device=dev)
    logical.scatter_(1, tables, torch.arange(nb, dtype=torch.int32, device=dev)
                     .expand(num_b, nb))
    logical[:, num_blocks - 1] = -1  # the null block fills the tables' unused tail
    inner = tree_mask_mod(base, tree_mask, window)

    def mask_mod(b, h, q_idx, kv_idx):
        j = logical[b, (kv_idx // block_size).clamp(max=num_blocks - 1)]
        return (j >= 0) & inner(b, h, q_idx, j * block_size + kv_idx % block_size)

    return BlockMask.from_kv_blocks(
        num_partial, held(partial_idx), num_full, held(full_idx),
        BLOCK_SIZE=(BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(num_n, num_blocks * block_size), compute_q_blocks=False)


def _tree_blocks(base: torch.Tensor, tree_mask: torch.Tensor, kv_len: int, window: int | None,
                 block: int, kv_block: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_block_mask`'s lists for query blocks of `block` and KV blocks of `kv_block`:
    (partial count [B, 1, Qb], partial blocks [B, 1, Qb, K], full count, full blocks), each
    row's listed blocks first."""
    num_b, num_n, num_t = tree_mask.shape
    dev = base.device
    num_q, num_kv = -(-num_n // block), -(-kv_len // kv_block)
    starts = _block_starts(num_kv, kv_block, dev)  # [K]
    ends = starts + kv_block
    lo = (base - window).clamp(min=0) if window is not None else torch.zeros_like(base)  # [B]
    full = (starts >= lo[:, None]) & (ends <= base[:, None])  # [B, K]
    ragged = (ends > lo[:, None]) & (starts < base[:, None]) & ~full  # [B, K]
    # which scratch entries some query of each query block sees: [B, Qb, T]
    rows = tree_mask.new_zeros(num_b, num_q * block, num_t)  # [B, Qb * block, T]
    rows[:, :num_n] = tree_mask
    seen = rows.view(num_b, num_q, block, num_t).any(2)  # [B, Qb, T]
    at = (base[:, None] + torch.arange(num_t, device=dev)) // kv_block  # [B, T] their blocks
    hits = torch.zeros(num_b, num_q, num_kv, dtype=torch.int32, device=dev)  # [B, Qb, K]
    hits.scatter_add_(2, at[:, None, :].expand(num_b, num_q, num_t), seen.to(torch.int32))
    partial = ((hits > 0) | ragged[:, None, :]) & ~full[:, None, :]  # [B, Qb, K]
    full = full[:, None, :].expand(num_b, num_q, num_kv)  # [B, Qb, K]

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, Qb, K] bool -> (count [B, 1, Qb], indices [B, 1, Qb, K]: the listed first)."""
        order = torch.argsort((~blocks).to(torch.uint8), dim=-1, stable=True)
        return (blocks.sum(-1, dtype=torch.int32)[:, None],
                order.to(torch.int32)[:, None].contiguous())

    return (*listed(partial), *listed(full))


@functools.cache
def compiled_flex_attention(dynamic: bool) -> Callable:
    """`flex_attention` through torch.compile (compiled on first use for each kind of input).

    dynamic: one kernel for all batch, tree and cache sizes (CUDA). The CPU's C++ template
    fails to build once the mask's captured tensors have symbolic sizes (torch 2.13: "error:
    'cur_kvSplitSize7' was not declared"), so compiled CPU runs compile each shape.

    Every kind of call is a graph of its own even with dynamic shapes (batch and tree size
    one against more, the target's mask against the head's sliding window, keys viewed in
    the cache or gathered, the paged in-place lists): more than dynamo's default limit of 8
    graphs a function, past which each new kind runs the unfused flex_attention (K/V
    repeated per head, fp32 scores [B, Hq, N, S]) for the rest of the process. So the limit
    is raised to FLEX_RECOMPILE_LIMIT (a process-wide dynamo setting)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               FLEX_RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=dynamic)


@functools.cache
def compile_failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the compiled flex_attention cannot run on `device` (the error of one tiny compiled
    call, made once a process: e.g. Triton finding no C compiler or Python headers to build
    its launcher), or None where it runs, or where there is no such device to try."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return None
    try:
        q = torch.randn(1, 2, 4, 16, device=device, dtype=dtype)
        mask = BlockMask.from_kv_blocks(
            torch.ones(1, 1, 1, dtype=torch.int32, device=device),
            torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=device),
            mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, seq_lengths=(4, 4))
        compiled_flex_attention(device.type == "cuda")(q, q, q, block_mask=mask)
    except Exception as e:  # whatever the compiler stack raises
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


# graphs dynamo keeps for the compiled flex_attention (its default: 8; the test of the kinds
# of call, tests/test_flex_attention.py, makes 16)
FLEX_RECOMPILE_LIMIT = 64


class FlexWindow:
    """One forward's FlexAttention over the cache (`attention.AttentionWindow`): the block
    mask, shared by all layers, and how many cache rows each layer reads."""

    reads_blocks = False  # a paged cache's entries come gathered into rows

    def __init__(self, block_mask: BlockMask, kv_len: int, compiled: bool):
        self.block_mask, self.kv_len, self.compiled = block_mask, kv_len, compiled

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               inp: StepInputs) -> torch.Tensor:
        """q [B, Hq, N, Dh] over one layer's cache rows cache_k, cache_v [slots, KVH, S, Dh]
        (the new K/V already written) -> [B, Hq, N, Dh]."""
        num_b, kv_len, head_dim = q.shape[0], self.kv_len, cache_k.shape[-1]
        if inp.contiguous:
            keys = cache_k[:num_b, :, :kv_len]  # [B, KVH, S, Dh] (a view)
            values = cache_v[:num_b, :, :kv_len, :head_dim]
        else:
            keys = cache_k[inp.slots, :, :kv_len]  # a copy
            values = cache_v[inp.slots, :, :kv_len, :head_dim]
        attend = (compiled_flex_attention(q.device.type == "cuda") if self.compiled
                  else flex_attention)
        return attend(q, keys.to(q.dtype), values.to(q.dtype), block_mask=self.block_mask,
                      enable_gqa=q.shape[1] != keys.shape[1])


class PagedFlexWindow:
    """One forward's FlexAttention over a paged cache's blocks where they lie (no per-layer
    copy of the used entries): each layer's K/V as one run of every block per KV head
    (`KVCache.head_runs`, [1, KVH, blocks x S, Dh]), the queries of all requests against
    it, and `paged_block_mask` listing, per request, the blocks its tree sees."""

    reads_blocks = True

    def __init__(self, block_mask: BlockMask, block_size: int, compiled: bool):
        self.block_mask, self.compiled = block_mask, compiled
        # CUDA's kernel takes keys in tiles that must divide the KV blocks (64 or 128 keys
        # by default): smaller cache blocks ask for tiles of their size
        self.kernel_options = {"BLOCK_N": block_size} if block_size < 64 else None

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               inp: StepInputs) -> torch.Tensor:
        """q [B, Hq, N, Dh] over one layer's runs cache_k, cache_v [1, KVH, blocks x S, Dh]
        (the new K/V already written) -> [B, Hq, N, Dh]."""
        if self.compiled:
            extra = ({"kernel_options": self.kernel_options}
                     if self.kernel_options and q.device.type == "cuda" else {})
            return compiled_flex_attention(q.device.type == "cuda")(
                q, cache_k.to(q.dtype), cache_v.to(q.dtype), block_mask=self.block_mask,
                enable_gqa=q.shape[1] != cache_k.shape[1], **extra)
        return flex_attention(q, cache_k.to(q.dtype), cache_v.to(q.dtype),
                              block_mask=self.block_mask,
                              enable_gqa=q.shape[1] != cache_k.shape[1])


def flex_step_inputs(cache: KVCache, slots: torch.Tensor, tree_mask: torch.Tensor,
                     positions: torch.Tensor, rotary: Callable, like: torch.Tensor,
                     window: int | None = None, compiled: bool = False,
                     in_place: bool = False) -> StepInputs:
    """`attention.step_inputs` without the dense mask: the layers attend through FlexAttention
    (`StepInputs.window` is a `FlexWindow`). Arguments as `step_inputs`'s.

    The keys each layer reads: compiled over contiguous slots, the whole cache rows (a view
    of fixed shape; the block mask skips the unused blocks); compiled over other slots, the
    used rows rounded up to whole blocks (gathered); eager, only the used rows (its kernel
    computes every score). in_place, over a paged cache laid out heads-outer: the blocks
    where they lie (a `PagedFlexWindow`; what compiled kernels should read: eager, every
    block's scores are computed)."""
    inp = step_inputs(cache, slots, tree_mask, positions, rotary, like, window,
                      dense_mask=False)
    if in_place and cache.paged:  # (read_blocks: the tables over the used entries)
        inp.window = PagedFlexWindow(
            paged_block_mask(inp.base, tree_mask, inp.read_blocks, cache.k.shape[1],
                             cache.block_size, window), cache.block_size, compiled)
        return inp
    if compiled and inp.contiguous:
        kv_len = cache.max_len
    else:
        base = inp.base
        s_used = (int(base.max()) if base.numel() else 0) + tree_mask.shape[2]
        kv_len = min(-(-s_used // BLOCK) * BLOCK, cache.max_len) if compiled else s_used
    inp.window = FlexWindow(tree_block_mask(inp.base, tree_mask, kv_len, window), kv_len,
                            compiled)
    return inp


def flex_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                          layer_idx: int, inp: StepInputs) -> torch.Tensor:
    """`attention.cached_attention`'s contract through FlexAttention: write the new k, v
    [B, KVH, N, Dh] into the cache, attend q [B, Hq, N, Dh] over the prefix and the tree
    -> [B, Hq, N, Dh]. inp: from `flex_step_inputs`."""
    if not isinstance(inp.window, FlexWindow | PagedFlexWindow):
        raise ValueError("flex_cached_attention needs inputs from flex_step_inputs")
    return cached_attention(q, k, v, cache, layer_idx, inp)


class FlexHeadKernels:
    """The draft head's calls on the flex backend (what `Drafter` asks of
    `Backend.head_kernels`): its layer attends through FlexAttention (with the sliding window
    of `TreeConfig.draft_window`); its linears and top-k are the torch module path's."""

    native = None  # no native operators
    step = None  # no one-operator head call

    def __init__(self, head: torch.nn.Module, draft_lm_head: torch.Tensor, cache: KVCache,
                 compiled: bool):
        self.head, self.draft_lm_head, self.cache, self.compiled = (head, draft_lm_head, cache,
                                                                    compiled)

    def cost_key(self) -> str:
        return "|flex" + ("-compiled" if self.compiled else "")

    def prepare_step(self, end: torch.Tensor, window: int) -> None:
        """Nothing to prepare (no one-operator call)."""

    def top_log_probs(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] (after pre_logits) -> top-k (log-prob, draft-vocabulary index)."""
        logits = vocab_projection(x, self.draft_lm_head).float()  # [..., Vd]
        return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)

    def run(self, slots: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
            positions: torch.Tensor, tree_mask: torch.Tensor, window: int | None
            ) -> torch.Tensor:
        """The head over [B, N] new entries (tree_mask [B, N, T]) -> outputs [B, N, H]."""
        inp = flex_step_inputs(self.cache, slots, tree_mask, positions, self.head.rotary,
                               embeds, window, self.compiled)
        return self.head.step(embeds, features, self.cache, inp)


class FlexBackend(Backend):
    """The torch backend with tree attention through FlexAttention (no dense mask): what
    `eagle2.devices.backend_for` gives CUDA models (compiled); on other devices only when
    asked (`backend_for(..., attention="flex")` or EAGLE2_ATTENTION=flex), eager unless
    `compiled=True`. The draft head's layer attends the same way (`FlexHeadKernels`)."""

    name = "torch"

    def __init__(self, compiled: bool | None = None, paged_in_place: bool | None = None):
        """compiled: run `flex_attention` through torch.compile; None: on CUDA only.
        paged_in_place: read a paged cache's blocks where they lie (`PagedFlexWindow`; its
        caches are laid out heads-outer) instead of gathering each layer's used entries;
        None: where compiled and $EAGLE2_PAGED_IN_PLACE is 1 (not yet by default: no GPU has
        run it; `make gpu-check`'s paged_attention phase compares the two). Eager, the kernel
        would score every block of the cache: for tests with small caches."""
        self.compiled, self.paged_in_place = compiled, paged_in_place

    def compiles(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compiled is None else self.compiled

    def reads_blocks(self, device: torch.device) -> bool:
        if self.paged_in_place is not None:
            return self.paged_in_place
        return self.compiles(device) and os.environ.get(PAGED_IN_PLACE_ENV) == "1"

    def info(self, target) -> dict:
        return {**super().info(target), "attention": "flex",
                "attention_compiled": self.compiles(target.device),
                "paged_in_place": self.reads_blocks(target.device)}

    def cost_key(self, target) -> str:
        return "|flex" + ("-compiled" if self.compiles(target.device) else "")

    def forward_inputs(self, target, cache: KVCache, slots: torch.Tensor,
                       tree_mask: torch.Tensor, positions: torch.Tensor,
                       x: torch.Tensor) -> StepInputs:
        return flex_step_inputs(cache, slots, tree_mask, positions, target.rope, x,
                                compiled=self.compiles(x.device),
                                in_place=self.reads_blocks(x.device))

    def head_kernels(self, head: torch.nn.Module, draft_lm_head: torch.Tensor,
                     embed: torch.Tensor, d2t: torch.Tensor | None, cache: KVCache,
                     rope_table: Callable[[], tuple[torch.Tensor, torch.Tensor]]
                     ) -> FlexHeadKernels:
        return FlexHeadKernels(head, draft_lm_head, cache, self.compiles(cache.k.device))
