"""Exact bf16 attention on the CPU (docs/cpu-backend.md "Exact bf16 attention").

With bf16 rounding, PyTorch's SDPA gives a token slightly different numbers as a node of a
verified tree than as one token of plain decoding (other shapes, other reduction orders), and
those differences flip greedy tokens. The attention here gives a query a result that depends
only on its own keys, in position order: bitwise the same in a tree, alone or in a batch. It is
the module path's attention of the CPU backend (`CanonicalWindow.attend`); the native operators
(`csrc/cpu_ops.cpp`) compute the same thing row by row and keep the committed keys transposed
in blocks (`with_key_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle2.attention import KVCache, StepInputs


def with_key_blocks(cache: KVCache, value_tiles: bool = False) -> KVCache:
    """The cache with room for the native attention's kept key blocks (`KVCache.key_blocks`:
    the K cache's memory again; value_tiles: and the committed values as AMX tiles, the V
    cache's memory again), none valid yet."""
    cache.key_blocks, cache.key_blocks_valid = empty_key_blocks(
        tuple(cache.k.shape[:3]), cache.k.shape[3], cache.k.shape[-1], cache.k.device,
        value_tiles)
    return cache


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



ATTN_CHUNK = 32  # window starts are multiples of this
WINDOW_DEPTH = 32  # deepest tree node (depth below the root) exact attention takes


@dataclass
class CanonicalWindow:
    """Which keys each query reads where (docs/cpu-backend.md "Exact bf16 attention").

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
    reads_blocks = False  # a paged cache's entries come gathered into rows

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               inp: StepInputs) -> torch.Tensor:
        return canonical_attention(q, cache_k, cache_v, inp)


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



def canonical_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                        inp: StepInputs) -> torch.Tensor:
    """Attention whose result for a query depends only on its own keys, in position order:
    the same whether it is one token of plain decoding or a node of a verified tree, alone or
    in a batch (docs/cpu-backend.md "Exact bf16 attention").

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
