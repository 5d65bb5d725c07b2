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

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(num_slots, dtype=torch.long, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def commit(self, slots: torch.Tensor, node_idx: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Move the accepted nodes' K/V to the end of each prefix and advance the lengths.

        slots: [B] cache slots; node_idx: [B, A] tree-node indices to keep in order (root
        first), padded arbitrarily past num_kept[b]; num_kept: [B].
        E.g. length 7, node_idx [0, 2, 5] -> entries at 7, 9, 12 move to 7, 8, 9; length 10.
        """
        base = self.lengths[slots]  # [B]
        src = base[:, None] + node_idx  # [B, A]
        dst = base[:, None] + torch.arange(node_idx.shape[1], device=node_idx.device)
        assert int(src.max()) < self.max_len, "tree ran past the cache; allocate a longer one"
        for kv in (self.k, self.v):
            moved = kv[:, slots[:, None], :, src]  # [B, A, L, KVH, Dh] (advanced dims first)
            kv[:, slots[:, None], :, dst] = moved
        self.lengths[slots] += num_kept

    def copy_slot(self, src: int, dst: int) -> None:
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.lengths[dst] = self.lengths[src]


@dataclass
class StepInputs:
    """Everything the layers of one forward share (computed once per forward)."""

    slots: torch.Tensor  # [B]
    write_pos: torch.Tensor  # [B, N] cache positions the new K/V go to
    mask: torch.Tensor  # [B, 1, N, S_used] bool, True = may attend
    cos: torch.Tensor  # [B, N, Dh]
    sin: torch.Tensor  # [B, N, Dh]
    contiguous: bool  # slots == arange(B): read the cache through a view, not a copy
    write_start: int | None = None  # contiguous and one common write offset: slice writes
    window: CanonicalWindow | None = None  # set: attend with `canonical_attention`


ATTN_CHUNK = 32  # keys per chunk of `canonical_attention`, aligned to absolute positions


@dataclass
class CanonicalWindow:
    """Where each query's keys sit in canonical order (docs/DESIGN.md, "Exact bf16 attention").

    Query i of request b (committed length L_b) attends to the prefix [0, L_b) and to its
    tree ancestors, which plain decoding would have seen at positions L_b, L_b + 1, ...
    Keys are taken in chunks of ATTN_CHUNK aligned at absolute position 0. The first
    `shared` positions are read where they are in the cache, masked by `shared_bias`; the
    window [a0_b, a0_b + W) of each query (a0_b = L_b rounded down to a chunk) is gathered from
    `pos`: the committed keys from a0_b on, then the ancestors in depth order. When every
    query's ancestors already sit at L_b, L_b + 1, ... (plain decoding, chains, prompts) there
    is no window and the shared part covers all keys.
    """

    shared: int  # a multiple of ATTN_CHUNK
    shared_bias: torch.Tensor  # [B, 1, 1, N or 1, shared] fp32: 0 = attend, -inf = not
    pos: torch.Tensor | None  # [B * N * W] flat index into [B * S] cache rows, or None
    bias: torch.Tensor | None  # [B, 1, 1, N, W] fp32 mask of the window keys


def canonical_window(base: torch.Tensor, tree_mask: torch.Tensor, mask: torch.Tensor,
                     span: int, chunk: int = ATTN_CHUNK) -> CanonicalWindow:
    """base [B]: committed lengths; tree_mask [B, N, T]: the scratch entries (cache positions
    base + m) each new token sees, ancestors before descendants; mask [B, N, S]: the whole
    attention mask; span: cache positions available for reading (the cache's length)."""
    num_b, num_n, num_t = tree_mask.shape
    dev = base.device
    t_idx = torch.arange(num_t, device=dev)
    count = tree_mask.sum(-1)  # [B, N] ancestors incl. itself
    order = torch.where(tree_mask, t_idx, num_t + t_idx).sort(-1).values  # theirs first
    rank = torch.arange(num_t, device=dev)
    in_place = bool(((order == rank) | (rank >= count[..., None])).all())

    def bias(valid: torch.Tensor) -> torch.Tensor:
        return torch.zeros(valid.shape, device=dev).masked_fill_(~valid, float("-inf"))

    if in_place:
        shared = min(-(-mask.shape[-1] // chunk) * chunk, span // chunk * chunk)
        if shared >= mask.shape[-1]:
            valid = F.pad(mask, (0, shared - mask.shape[-1]))
            return CanonicalWindow(shared, bias(valid)[:, None, None], None, None)
    a0 = base // chunk * chunk
    lead = base - a0  # committed keys inside the window
    width = -(-int((lead[:, None] + count).max()) // chunk) * chunk
    w = torch.arange(width, device=dev)
    committed = w[None, None, :] < lead[:, None, None]  # [B, 1, W]
    offset = w[None, None, :] - lead[:, None, None]  # [B, 1, W]
    in_tree = (offset >= 0) & (offset < count[:, :, None])  # [B, N, W]
    anc = order.gather(-1, offset.clamp(0, num_t - 1).expand(num_b, num_n, width))
    pos = torch.where(committed, a0[:, None, None] + w, base[:, None, None] + anc)
    valid = committed | in_tree
    rows = torch.arange(num_b, device=dev)[:, None, None] * span + torch.where(valid, pos, 0)
    shared = int(a0.max()) if num_b else 0
    shared_valid = torch.arange(shared, device=dev)[None, :] < a0[:, None]  # [B, A]
    return CanonicalWindow(shared, bias(shared_valid)[:, None, None, None], rows.reshape(-1),
                           bias(valid)[:, None, None])


def step_inputs(cache: KVCache, slots: torch.Tensor, tree_mask: torch.Tensor,
                positions: torch.Tensor, rotary: torch.nn.Module, like: torch.Tensor,
                window: int | None = None, canonical: bool = False) -> StepInputs:
    """Build the shared per-forward inputs for N new tokens per request.

    The new tokens are the last N entries of a scratch region of T >= N entries that starts at
    each slot's committed length (the target uses T = N; the drafter appends one tree level
    per call, so its earlier levels are the first T - N entries).
    tree_mask: [B, N, T] bool, which scratch entries each new token sees (itself included).
    positions: [B, N] RoPE positions. window: also hide prefix entries older than this.
    canonical: attend with `canonical_attention` (results independent of the tree's shape).
    """
    num_b, num_n = positions.shape
    num_t = tree_mask.shape[2]
    base = cache.lengths[slots]  # [B]
    scratch = base[:, None] + torch.arange(num_t, device=positions.device)  # [B, T]
    write_pos = scratch[:, num_t - num_n:]  # [B, N]
    s_used = int(scratch[:, -1].max()) + 1
    assert s_used <= cache.max_len, f"sequence needs {s_used} cache entries > {cache.max_len}"
    cols = torch.arange(s_used, device=positions.device)  # [S]
    prefix = cols[None, :] < base[:, None]  # [B, S]
    if window is not None:
        prefix &= cols[None, :] >= (base[:, None] - window)
    mask = prefix[:, None, :].expand(num_b, num_n, s_used).clone()  # [B, N, S]
    mask.scatter_(2, scratch[:, None, :].expand(num_b, num_n, num_t), tree_mask)
    cos, sin = rotary(like, positions)
    contiguous = bool(
        num_b > 0 and torch.equal(slots, torch.arange(num_b, device=slots.device))
    )
    write_start = None
    if contiguous and bool((base == base[0]).all()):
        write_start = int(base[0]) + num_t - num_n
    found = (canonical_window(base, tree_mask, mask, cache.max_len)
             if canonical and window is None else None)
    return StepInputs(slots, write_pos, mask[:, None], cos, sin, contiguous, write_start, found)


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
    if inp.write_start is not None:  # contiguous slots, all at one length: slice copies
        end = inp.write_start + num_n
        cache.k[layer_idx, :num_b, :, inp.write_start:end] = k
        cache.v[layer_idx, :num_b, :, inp.write_start:end] = v
    else:
        slot_idx = inp.slots[:, None]  # [B, 1]
        cache.k[layer_idx][slot_idx, :, inp.write_pos] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[layer_idx][slot_idx, :, inp.write_pos] = v.transpose(1, 2).to(cache.v.dtype)
    s_used = inp.mask.shape[-1]
    if inp.window is not None:
        return canonical_attention(q, cache.k[layer_idx], cache.v[layer_idx], inp)
    if inp.contiguous:
        keys = cache.k[layer_idx, :num_b, :, :s_used]  # [B, KVH, S, Dh] (a view)
        values = cache.v[layer_idx, :num_b, :, :s_used]
    else:
        keys = cache.k[layer_idx][inp.slots, :, :s_used]  # a copy
        values = cache.v[layer_idx][inp.slots, :, :s_used]
    return F.scaled_dot_product_attention(
        q, keys.to(q.dtype), values.to(q.dtype), attn_mask=inp.mask,
        enable_gqa=q.shape[1] != keys.shape[1],
    )


def canonical_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                        inp: StepInputs) -> torch.Tensor:
    """Attention whose result for a query depends only on its own keys, in position order:
    the same whether it is one token of plain decoding or a node of a verified tree, alone or
    in a batch (docs/DESIGN.md, "Exact bf16 attention").

    q [B, Hq, N, Dh]; cache_k, cache_v [slots, KVH, S, Dh] (this step's entries written) ->
    [B, Hq, N, Dh]. Scores are one matmul (each score is one dot product, bitwise the same in
    any bf16 matmul shape on CPU). Exp-sums and value products are formed per chunk of
    ATTN_CHUNK keys aligned at absolute positions (the same chunk gives the same result),
    and the chunks' results are added in position order by one sequential `cumsum`, so
    whether a chunk came from the shared prefix or from a gathered window does not show.
    """
    cw = inp.window
    num_b, num_hq, num_n, dim = q.shape
    num_kv = cache_k.shape[1]
    group, chunk, shared = num_hq // num_kv, ATTN_CHUNK, cw.shared
    if inp.contiguous:
        keys, values = cache_k[:num_b], cache_v[:num_b]  # views
    else:
        keys, values = cache_k[inp.slots], cache_v[inp.slots]  # copies
    qg = (q * dim ** -0.5).reshape(num_b, num_kv, group * num_n, dim)
    parts, sums = [], []
    if cw.pos is not None:  # gather each query's window: scores, then values
        width = cw.bias.shape[-1]
        span = keys.shape[2]
        flat_k = keys.transpose(1, 2).reshape(num_b * span, num_kv, dim)
        k_win = flat_k.index_select(0, cw.pos).view(num_b, num_n, width, num_kv, dim)
        s_win = torch.matmul(qg.view(num_b, num_kv, group, num_n, dim).permute(0, 1, 3, 2, 4),
                             k_win.permute(0, 3, 1, 4, 2))  # [B, KVH, N, G, W]
        s_win = s_win.transpose(2, 3).float() + cw.bias  # [B, KVH, G, N, W]
    if shared:
        s_sh = torch.matmul(qg, keys[:, :, :shared].transpose(-1, -2)).float()
        s_sh = s_sh.view(num_b, num_kv, group, num_n, shared) + cw.shared_bias
        top = s_sh.amax(-1, keepdim=True)
        if cw.pos is not None:
            top = torch.maximum(top, s_win.amax(-1, keepdim=True))
        e_sh = torch.exp(s_sh - top)
        sums.append(e_sh.unflatten(-1, (-1, chunk)).sum(-1))  # [B, KVH, G, N, A/C]
        p_sh = e_sh.to(values.dtype).view(num_b, num_kv, group * num_n, -1, chunk)
        v_sh = values[:, :, :shared].unflatten(2, (-1, chunk))  # [B, KVH, A/C, C, Dh]
        parts.append(torch.matmul(p_sh.transpose(2, 3), v_sh))  # [B, KVH, A/C, G N, Dh]
    else:
        top = s_win.amax(-1, keepdim=True)
    if cw.pos is not None:
        e_win = torch.exp(s_win - top)  # [B, KVH, G, N, W]
        sums.append(e_win.unflatten(-1, (-1, chunk)).sum(-1))
        flat_v = values.transpose(1, 2).reshape(num_b * span, num_kv, dim)
        v_win = flat_v.index_select(0, cw.pos).view(num_b, num_n, -1, chunk, num_kv, dim)
        p_win = e_win.to(values.dtype).unflatten(-1, (-1, chunk))  # [B, KVH, G, N, W/C, C]
        part = torch.matmul(p_win.permute(0, 1, 3, 4, 2, 5),  # [B, KVH, N, W/C, G, C]
                            v_win.permute(0, 4, 1, 2, 3, 5))  # [B, KVH, N, W/C, C, Dh]
        parts.append(part.permute(0, 1, 3, 4, 2, 5).reshape(num_b, num_kv, -1,
                                                             group * num_n, dim))
    total = torch.cat(parts, 2).cumsum(2)[:, :, -1]  # [B, KVH, G N, Dh]
    z = torch.cat(sums, -1).cumsum(-1)[..., -1]  # [B, KVH, G, N]
    out = total.view(num_b, num_kv, group, num_n, dim) / z[..., None]
    return out.to(q.dtype).view(num_b, num_hq, num_n, dim)


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
