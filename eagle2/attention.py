"""Llama decoder layers over a preallocated, slotted KV cache with tree attention.

See docs/DESIGN.md "Verification, KV cache and batching".

The target and the draft head both run through `decoder_layer`: it calls the Hugging Face
layer's own sub-modules (projections, norms, MLP), so a tensor-parallel model (`eagle2.tp`)
works unchanged (its o_proj/down_proj all-reduce inside), but the attention and the cache are
ours. We do not go through the HF model's 4D-mask path: a tree step needs per-request cache
lengths, writes at arbitrary positions and a commit by gather, which are simpler and faster to
own than to fit into HF's Cache classes.

Attention of query i of request b sees key position j iff
    window_start[b] <= j < length[b]                    (committed prefix), or
    j = length[b] + m with tree_mask[b, i, m]            (itself and its ancestors in the tree).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@dataclass
class KVCache:
    """Preallocated K/V for `num_slots` sequences; slot b holds one request.

    Positions [0, lengths[b]) are committed; positions after it are scratch written by the
    current tree step and either committed by `commit` or overwritten by the next step.
    """

    k: torch.Tensor  # [L, slots, KVH, S, Dh]
    v: torch.Tensor  # [L, slots, KVH, S, Dh]
    lengths: torch.Tensor  # [slots] committed length, long
    # the committed keys kept transposed in blocks for the native attention (docs/DESIGN.md
    # "Exact bf16 attention"), and with AMX the committed values as its tiles after them:
    # [L, slots, KVH, blocks, Dh / 2 * 16] int32 (`empty_key_blocks`), and per layer, slot
    # and KV head how many key blocks are valid [L, slots, KVH]
    key_blocks: torch.Tensor | None = None
    key_blocks_valid: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 ones_column: bool = False, key_blocks: bool = False,
                 value_tiles: bool = False) -> KVCache:
        """ones_column: V gets a last column of ones (`canonical_attention` reads the sums of
        its probabilities from the same matmul as the values). key_blocks: keep the committed
        keys transposed as well (`eagle2.native`'s attention; the K cache's memory again);
        value_tiles: and the committed values as AMX tiles (the V cache's memory again)."""
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        v = torch.zeros(*shape[:-1], head_dim + int(ones_column), dtype=dtype, device=device)
        v[..., head_dim:] = 1
        cache = cls(torch.zeros(shape, dtype=dtype, device=device), v,
                    torch.zeros(num_slots, dtype=torch.long, device=device))
        if key_blocks:
            cache.key_blocks, cache.key_blocks_valid = empty_key_blocks(
                shape[:3], max_len, head_dim, device, value_tiles)
        return cache

    def layer_key_blocks(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's (key_blocks, key_blocks_valid) for the native attention, or Nones."""
        if self.key_blocks is None:
            return None, None
        return self.key_blocks[layer_idx], self.key_blocks_valid[layer_idx]

    def layer_views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor,
                                                   torch.Tensor | None, torch.Tensor | None]:
        """One layer's (k, v, key_blocks, key_blocks_valid): views made once per layer and
        kept (made in every layer's call, with its other arguments they had cost ~0.24 ms of
        a 12 ms forward: `fused._native_layer`), made again if a tensor is replaced."""
        tensors = (self.k, self.v, self.key_blocks, self.key_blocks_valid)
        key = tuple(map(id, tensors))
        if self.__dict__.get("_views_of") != key:
            self.__dict__["_views"] = [
                (self.k[i], self.v[i], *self.layer_key_blocks(i)) for i in range(len(self.k))]
            self.__dict__["_views_of"] = key
        return self.__dict__["_views"][layer_idx]

    @property
    def values(self) -> torch.Tensor:
        """V without the column of ones, if it has one."""
        return self.v[..., : self.k.shape[-1]]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def commit(self, slots: torch.Tensor, node_idx: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Move the accepted nodes' K/V to the end of each prefix and advance the lengths.

        slots: [B] cache slots; node_idx: [B, A] tree-node indices to keep in order (root
        first), padded arbitrarily past num_kept[b]; num_kept: [B].
        E.g. length 7, node_idx [0, 2, 5] -> entries at 7, 9, 12 move to 7, 8, 9; length 10.
        """
        keep = num_kept.tolist()
        if all(row[:k] == list(range(k)) for row, k in zip(node_idx.tolist(), keep, strict=True)):
            # every kept node already sits where it goes (a plain step, or a chain accepted
            # from its start): nothing moves (the move cost ~0.25 ms a step at batch 1)
            self.lengths[slots] += num_kept
            return
        base = self.lengths[slots]  # [B]
        src = base[:, None] + node_idx  # [B, A]
        dst = base[:, None] + torch.arange(node_idx.shape[1], device=node_idx.device)
        assert int(src.max()) < self.max_len, "tree ran past the cache; allocate a longer one"
        for kv in (self.k, self.v):
            moved = kv[:, slots[:, None], :, src]  # [B, A, L, KVH, Dh] (advanced dims first)
            kv[:, slots[:, None], :, dst] = moved
        self.lengths[slots] += num_kept

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot src's committed entries (only those: a whole slot of the embedded model is
        50 MB, and copying it took 17-30 ms each time a request finished) into slot dst."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        if self.key_blocks_valid is not None:  # dst's blocks were another request's keys
            self.key_blocks_valid[:, dst] = 0


def empty_key_blocks(leading: tuple[int, ...], max_len: int, head_dim: int,
                     device: torch.device | str = "cpu", value_tiles: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_blocks, key_blocks_valid) for K caches [*leading, max_len, head_dim], no block
    valid: [*leading, ceil(max_len / 16), head_dim / 2 * 16] int32 (room for blocks of 16
    keys, or of 8 with AVX2) and [*leading] int32 (`KVCache.key_blocks`). value_tiles: room
    for the values as AMX tiles too, in chunks of 32 after the keys (the native attention
    keeps them there where the room is: [*leading, 4 ceil(max_len / 32), ...])."""
    count = 4 * -(-max_len // 32) if value_tiles else -(-max_len // 16)
    blocks = torch.empty(*leading, count, head_dim // 2 * 16, dtype=torch.int32, device=device)
    return blocks, torch.zeros(leading, dtype=torch.int32, device=device)


@dataclass
class StepInputs:
    """Everything the layers of one forward share (computed once per forward)."""

    slots: torch.Tensor  # [B]
    write_pos: torch.Tensor  # [B, N] cache positions the new K/V go to
    # [B, 1, N, S_used] bool, True = may attend; None where the native operators attend (they
    # read base and tree_mask)
    mask: torch.Tensor | None
    cos: torch.Tensor  # [B, N, Dh]
    sin: torch.Tensor  # [B, N, Dh]
    contiguous: bool  # slots == arange(B): read the cache through a view, not a copy
    write_start: int | None = None  # contiguous and one common write offset: slice writes
    window: CanonicalWindow | None = None  # set: attend with `canonical_attention`
    base: torch.Tensor | None = None  # [B] committed lengths (what `tree_mask` is after)
    tree_mask: torch.Tensor | None = None  # [B, N, T] scratch entries each new token sees


ATTN_CHUNK = 32  # window starts are multiples of this
WINDOW_DEPTH = 32  # deepest tree node (depth below the root) exact attention takes


@dataclass
class CanonicalWindow:
    """Which keys each query reads where (docs/DESIGN.md, "Exact bf16 attention").

    A token at position p attends to keys [0, p]. Its window starts at
    ws(p) = ATTN_CHUNK * floor(max(p - WINDOW_DEPTH, 0) / ATTN_CHUNK), a function of p alone,
    and never after the committed prefix of a tree of depth <= WINDOW_DEPTH. Keys [0, ws) are
    read where they lie in the cache (one matmul for all queries, masked per query past its
    ws); keys [ws, p] are gathered into a window of fixed width in position order: committed
    keys, then the query's tree ancestors, which is where plain decoding has them.
    """

    shared: int  # keys read in place: max ws over the batch
    used: int  # cache positions whose scores are computed: [0, used)
    shared_bias: torch.Tensor | None  # [B, 1, N, 1, shared] fp32: 0 = attend, -inf = not
    pos: torch.Tensor  # [B, N, W] cache position of each window key (0 where invalid)
    bias: torch.Tensor  # [B, 1, N, 1, W] fp32 mask of the window keys
    rows: torch.Tensor  # [B * KVH * Np * W] rows of one layer's V cache viewed [-1, Dh + 1]
    group: int  # queries per block-diagonal matmul of the window; Np = N rounded up to it


def canonical_window(base: torch.Tensor, tree_mask: torch.Tensor, slots: torch.Tensor,
                     cache_shape: tuple[int, ...], chunk: int = ATTN_CHUNK,
                     depth: int = WINDOW_DEPTH) -> CanonicalWindow:
    """base [B]: committed lengths; tree_mask [B, N, T]: the scratch entries (cache positions
    base + m) each new token sees, ancestors before descendants; slots [B]; cache_shape: one
    layer's K cache [slots, KVH, S, Dh]. The positions whose scores are computed are rounded
    up to 2 chunks, so that the matmuls' shapes (and oneDNN's kernels for them, ~0.5 ms to
    build) change every 64 tokens."""
    num_b, num_n, num_t = tree_mask.shape
    _, num_kv, limit, _ = cache_shape
    dev = base.device
    count = tree_mask.sum(-1)  # [B, N] ancestors incl. itself = depth + 1
    start = (base[:, None] + count - 1 - depth).clamp(min=0) // chunk * chunk  # [B, N] ws(p)
    width = depth + chunk
    t_idx = torch.arange(num_t, device=dev)
    order = torch.where(tree_mask, t_idx, num_t + t_idx).sort(-1).values  # ancestors first
    # keys [base, ws) are read in place: only right if they are the query's first ancestors
    # in order (a chain, e.g. a prompt); a tree of depth <= WINDOW_DEPTH never has any
    ahead = (start - base[:, None]).clamp(min=0)
    if bool((ahead > 0).any()) and not bool(
            ((order == t_idx) | (t_idx >= ahead[..., None])).all()):
        raise ValueError(f"exact attention takes trees of depth <= {depth} (or chains)")
    canon = start[..., None] + torch.arange(width, device=dev)  # [B, N, W] positions
    rank = canon - base[:, None, None]
    committed = rank < 0
    in_tree = (rank >= 0) & (rank < count[..., None])
    anc = order.gather(-1, rank.clamp(0, num_t - 1))
    valid = committed | in_tree
    pos = torch.where(valid, torch.where(committed, canon, base[:, None, None] + anc), 0)
    shared = int(start.max()) if num_b else 0
    used = min(-(-max(int(pos.max()) + 1, shared) // (2 * chunk)) * 2 * chunk, limit)
    group = min(num_n, 8)
    padded = F.pad(pos, (0, 0, 0, -num_n % group))  # [B, Np, W]
    heads = (slots[:, None] * num_kv + torch.arange(num_kv, device=dev)) * limit  # [B, KVH]
    rows = (heads[:, :, None, None] + padded[:, None]).reshape(-1)

    def bias(ok: torch.Tensor) -> torch.Tensor:  # [B, N, X] -> [B, 1, N, 1, X]
        out = torch.zeros(ok.shape, device=dev).masked_fill_(~ok, float("-inf"))
        return out[:, None, :, None]

    shared_bias = None
    if shared:
        shared_bias = bias(torch.arange(shared, device=dev) < start[..., None])
    return CanonicalWindow(shared, used, shared_bias, pos, bias(valid), rows, group)


def step_inputs(cache: KVCache, slots: torch.Tensor, tree_mask: torch.Tensor,
                positions: torch.Tensor, rotary: Callable, like: torch.Tensor,
                window: int | None = None, canonical: bool = False,
                dense_mask: bool = True) -> StepInputs:
    """Build the shared per-forward inputs for N new tokens per request.

    The new tokens are the last N entries of a scratch region of T >= N entries that starts at
    each slot's committed length (the target uses T = N; the drafter appends one tree level
    per call, so its earlier levels are the first T - N entries).
    tree_mask: [B, N, T] bool, which scratch entries each new token sees (itself included).
    positions: [B, N] RoPE positions. window: also hide prefix entries older than this.
    canonical: attend with `canonical_attention` (results independent of the tree's shape).
    rotary: (like, positions) -> cos, sin [B, N, Dh] (a rotary module or a `RopeTable`).
    dense_mask: build the [B, 1, N, S] mask (the native operators need only tree_mask).
    """
    num_b, num_n = positions.shape
    num_t = tree_mask.shape[2]
    base = cache.lengths[slots]  # [B]
    scratch = base[:, None] + torch.arange(num_t, device=positions.device)  # [B, T]
    write_pos = scratch[:, num_t - num_n:]  # [B, N]
    # what the checks below read, as lists (each tensor reduction here had cost ~5-15 us)
    starts, slot_ids = base.tolist(), slots.tolist()
    s_used = max(starts, default=0) + num_t
    assert s_used <= cache.max_len, f"sequence needs {s_used} cache entries > {cache.max_len}"
    mask = None
    if dense_mask:
        cols = torch.arange(s_used, device=positions.device)  # [S]
        prefix = cols[None, :] < base[:, None]  # [B, S]
        if window is not None:
            prefix &= cols[None, :] >= (base[:, None] - window)
        mask = prefix[:, None, :].expand(num_b, num_n, s_used).clone()  # [B, N, S]
        mask.scatter_(2, scratch[:, None, :].expand(num_b, num_n, num_t), tree_mask)
        mask = mask[:, None]
    cos, sin = rotary(like, positions)
    contiguous = num_b > 0 and slot_ids == list(range(num_b))
    write_start = None
    if contiguous and starts.count(starts[0]) == num_b:
        write_start = starts[0] + num_t - num_n
    found = (canonical_window(base, tree_mask, slots, cache.k.shape[1:])
             if canonical and window is None else None)
    return StepInputs(slots, write_pos, mask, cos, sin, contiguous, write_start, found,
                      base, tree_mask)


class RopeTable:
    """RoPE's cos and sin for every position up to a bound, computed by the rotary module once
    (and again, twice as long, when a position reaches past it) and read per forward: the
    module computes each position's values on their own (one product, cos and sin, elementwise),
    so they are the module's for any batch of positions, for ~10 us instead of ~50-130 (a
    few rows of eight dispatched operations each forward)."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [S, Dh]

    def __call__(self, like: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.table(like, int(positions.max()) + 1 if positions.numel() else 1)
        return cos[positions], sin[positions]

    def table(self, like: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= size, Dh] in like's dtype and device (the whole table, for operators
        that index it themselves: `drafter._HeadStep`)."""
        table = self._table
        if table is None or table[0].shape[0] < size or table[0].dtype != like.dtype \
                or table[0].device != like.device:
            size = max(size, 2 * table[0].shape[0] if table is not None else 1024)
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])
            self._table = table = cos[0], sin[0]
        return table


def decoder_layer(layer: torch.nn.Module, layer_idx: int, x: torch.Tensor, cache: KVCache,
                  inp: StepInputs, head_dim: int, skip_input_norm: bool = False) -> torch.Tensor:
    """One Llama decoder layer on x [B, N, H] that writes its K/V into the cache."""
    attn = layer.self_attn
    h = x if skip_input_norm else layer.input_layernorm(x)
    num_b, num_n, _ = h.shape
    q = attn.q_proj(h).view(num_b, num_n, -1, head_dim).transpose(1, 2)  # [B, Hq, N, Dh]
    k = attn.k_proj(h).view(num_b, num_n, -1, head_dim).transpose(1, 2)  # [B, KVH, N, Dh]
    v = attn.v_proj(h).view(num_b, num_n, -1, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, inp.cos, inp.sin)
    out = cached_attention(q, k, v, cache, layer_idx, inp)  # [B, Hq, N, Dh]
    x = x + attn.o_proj(out.transpose(1, 2).reshape(num_b, num_n, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                     layer_idx: int, inp: StepInputs) -> torch.Tensor:
    """Write the new k, v [B, KVH, N, Dh] into the cache, attend q [B, Hq, N, Dh] over the
    prefix and the tree (inp.mask): -> [B, Hq, N, Dh]."""
    num_b, num_n = q.shape[0], q.shape[2]
    cache_v = cache.values[layer_idx]
    if inp.write_start is not None:  # contiguous slots, all at one length: slice copies
        end = inp.write_start + num_n
        cache.k[layer_idx, :num_b, :, inp.write_start:end] = k
        cache_v[:num_b, :, inp.write_start:end] = v
    else:
        slot_idx = inp.slots[:, None]  # [B, 1]
        cache.k[layer_idx][slot_idx, :, inp.write_pos] = k.transpose(1, 2).to(cache.k.dtype)
        cache_v[slot_idx, :, inp.write_pos] = v.transpose(1, 2).to(cache.v.dtype)
    s_used = inp.mask.shape[-1]
    if inp.window is not None:
        return canonical_attention(q, cache.k[layer_idx], cache.v[layer_idx], inp)
    if inp.contiguous:
        keys = cache.k[layer_idx, :num_b, :, :s_used]  # [B, KVH, S, Dh] (a view)
        values = cache_v[:num_b, :, :s_used]
    else:
        keys = cache.k[layer_idx][inp.slots, :, :s_used]  # a copy
        values = cache_v[inp.slots, :, :s_used]
    return F.scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=inp.mask,
        enable_gqa=q.shape[1] != keys.shape[1],
    )


def canonical_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                        inp: StepInputs) -> torch.Tensor:
    """Attention whose result for a query depends only on its own keys, in position order:
    the same whether it is one token of plain decoding or a node of a verified tree, alone or
    in a batch (docs/DESIGN.md, "Exact bf16 attention").

    q [B, Hq, N, Dh]; one layer's cache_k [slots, KVH, S, Dh] and cache_v [slots, KVH, S,
    Dh + 1] (a last column of ones; this step's entries written) -> [B, Hq, N, Dh]. It rests
    on what bf16 matmuls do on a CPU with packed bf16 kernels (tests/test_attention.py): an
    output element does not depend on the other rows or columns, nor on zeros in whole chunks
    of the reduced dimension. So: scores are one matmul; the keys before the window start go
    through one matmul with the probabilities of keys past each query's own ws set to 0; the
    windows go through block-diagonal matmuls of `group` queries; the ones column gives each
    part's sum of probabilities from the same products.
    """
    cw = inp.window
    num_b, num_hq, num_n, dim = q.shape
    num_kv = cache_k.shape[1]
    group, shared, used, width = num_hq // num_kv, cw.shared, cw.used, cw.pos.shape[-1]
    if inp.contiguous:
        # a copy: the batched matmul would otherwise copy them transposed, 2-4x slower
        keys = cache_k[:num_b, :, :used].contiguous()
    else:
        keys = cache_k[inp.slots, :, :used]  # a copy
    qn = q.view(num_b, num_kv, group, num_n, dim).transpose(2, 3) * dim ** -0.5
    scores = torch.matmul(qn.reshape(num_b, num_kv, num_n * group, dim), keys.transpose(-1, -2))
    scores = scores.float().view(num_b, num_kv, num_n, group, used)  # [B, KVH, N, G, S]
    idx = cw.pos[:, None, :, None].expand(num_b, num_kv, num_n, group, width)
    s_win = scores.gather(-1, idx) + cw.bias  # [B, KVH, N, G, W]
    top = s_win.amax(-1, keepdim=True)
    if shared:
        s_sh = scores[..., :shared] + cw.shared_bias
        top = torch.maximum(top, s_sh.amax(-1, keepdim=True))
    # windows: block-diagonal [q G, q W] @ [q W, Dh + 1] for blocks of q = cw.group queries
    blk = cw.group
    num_p = cw.rows.numel() // (num_b * num_kv * width)  # N rounded up to blk
    p_win = F.pad(torch.exp(s_win - top).to(cache_v.dtype), (0, 0, 0, 0, 0, num_p - num_n))
    diag = p_win.new_zeros(num_b, num_kv, num_p // blk, blk, group, blk, width)
    diag.diagonal(0, 3, 5).copy_(p_win.view(num_b, num_kv, num_p // blk, blk, group, width)
                                 .permute(0, 1, 2, 4, 5, 3))
    v_win = cache_v.reshape(-1, dim + 1).index_select(0, cw.rows)
    total = torch.matmul(diag.view(num_b, num_kv, num_p // blk, blk * group, blk * width),
                         v_win.view(num_b, num_kv, num_p // blk, blk * width, dim + 1))
    total = total.view(num_b, num_kv, num_p, group, dim + 1)[:, :, :num_n].float()
    if shared:
        p_sh = torch.exp(s_sh - top).to(cache_v.dtype)  # [B, KVH, N, G, A]
        v_sh = cache_v[:num_b, :, :shared] if inp.contiguous else cache_v[inp.slots, :, :shared]
        part = torch.matmul(p_sh.view(num_b, num_kv, num_n * group, shared), v_sh)
        total = total + part.view(num_b, num_kv, num_n, group, dim + 1).float()
    out = (total[..., :dim] / total[..., dim:]).to(q.dtype)  # [B, KVH, N, G, Dh]
    return out.permute(0, 1, 3, 2, 4).reshape(num_b, num_hq, num_n, dim)


def sequence_inputs(cache: KVCache, lengths: torch.Tensor, num_t: int,
                    rotary: torch.nn.Module, like: torch.Tensor) -> StepInputs:
    """Inputs for a causal pass over whole right-padded sequences [B, T] from position 0 in
    slots 0..B-1 of an empty cache (head training)."""
    num_b = lengths.shape[0]
    slots = torch.arange(num_b, device=lengths.device)
    positions = torch.arange(num_t, device=lengths.device).expand(num_b, num_t)
    return step_inputs(cache, slots, causal_mask(lengths, num_t), positions, rotary, like)


def causal_mask(lengths: torch.Tensor, num_n: int) -> torch.Tensor:
    """[B, N, N] lower-triangular mask; rows and columns past lengths[b] see only themselves."""
    idx = torch.arange(num_n, device=lengths.device)
    tri = idx[None, :] <= idx[:, None]  # [N, N]
    valid = idx[None, :] < lengths[:, None]  # [B, N]
    eye = torch.eye(num_n, dtype=torch.bool, device=lengths.device)
    return torch.where(valid[:, :, None] & valid[:, None, :], tri, eye)


def vocab_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] @ weight[V, H].T for a large V.

    With several rows on a CPU this computes (weight @ x.T).T: MKL's kernel for a tall weight
    times a thin activation is about 2x faster than `F.linear`'s for a 49k vocabulary (8 rows:
    22 vs 45 ms). One row (plain decoding) and GPUs keep `F.linear`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1 or x.device.type != "cpu":
        return F.linear(x, weight)
    return torch.mm(weight, rows.t()).t().reshape(*x.shape[:-1], weight.shape[0])
