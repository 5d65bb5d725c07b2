"""Llama decoder layers over a preallocated, slotted KV cache with tree attention.

See docs/kv-cache.md.

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
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle2.tree import host_lists


@dataclass
class KVCache:
    """Preallocated K/V for `num_slots` sequences; slot b holds one request.

    Positions [0, lengths[b]) are committed; positions after it are scratch written by the
    current tree step and either committed by `commit` or overwritten by the next step.

    Two layouts of the same tensors (docs/kv-cache.md): slotted (`block_tables` None), where
    block b is slot b's whole row of S entries; paged, where k and v hold fixed-size blocks
    of `block_size` entries, per layer [blocks, KVH, block_size, Dh] (FlashInfer's paged KV
    cache, kv_layout "HND"), and slot b's position p is entry p % block_size of block
    block_tables[b, p // block_size]. The last block is the null block: table entries no
    block was given to point at it (scratch that nobody reads unmasked).
    """

    k: torch.Tensor  # [L, blocks, KVH, S, Dh] (slotted: blocks = slots; paged: S = block_size)
    v: torch.Tensor  # [L, blocks, KVH, S, Dh]
    lengths: torch.Tensor  # [slots] committed length, long
    # the committed keys kept transposed in blocks for the CPU backend's native attention
    # (docs/cpu-backend.md), and with AMX the committed values as its tiles after them:
    # [L, slots, KVH, blocks, Dh / 2 * 16] int32 (`eagle2.cpu.attention.empty_key_blocks`),
    # and per layer, slot and KV head how many key blocks are valid [L, slots, KVH]
    key_blocks: torch.Tensor | None = None
    key_blocks_valid: torch.Tensor | None = None
    # paged: [slots, max_blocks] long, each slot's blocks in position order (null-padded)
    block_tables: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 ones_column: bool = False, heads_outer: bool = False) -> KVCache:
        """ones_column: V gets a last column of ones (the CPU backend's exact attention reads
        the sums of its probabilities from the same matmul as the values). The CPU backend
        adds the key blocks it keeps (`eagle2.cpu.attention.with_key_blocks`). heads_outer:
        the same [L, slots, KVH, S, Dh] tensors as views of memory laid out [L, KVH, slots,
        S, Dh], so that one layer's KV head is one run of slots x S entries
        (`KVCache.head_runs`)."""
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)

        def zeros(dim: int) -> torch.Tensor:
            if not heads_outer:
                return torch.zeros(*shape[:-1], dim, dtype=dtype, device=device)
            return torch.zeros(num_layers, num_kv_heads, num_slots, max_len, dim, dtype=dtype,
                               device=device).transpose(1, 2)

        v = zeros(head_dim + int(ones_column))
        v[..., head_dim:] = 1
        return cls(zeros(head_dim), v, torch.zeros(num_slots, dtype=torch.long, device=device))

    @classmethod
    def allocate_paged(cls, num_layers: int, num_slots: int, num_blocks: int, block_size: int,
                       max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device | str, ones_column: bool = False,
                       heads_outer: bool = False) -> KVCache:
        """num_blocks blocks of block_size entries (and the null block after them) shared by
        num_slots sequences of at most max_len entries each; every table entry null.
        heads_outer: as `allocate`'s (FlexAttention then reads the blocks in place)."""
        cache = cls.allocate(num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim,
                             dtype, device, ones_column, heads_outer)
        cache.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        cache.block_tables = torch.full((num_slots, -(-max_len // block_size)), num_blocks,
                                        dtype=torch.long, device=device)
        return cache

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def null_block(self) -> int:
        return self.k.shape[1] - 1

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        """Slot's block table: blocks in position order, the rest null (paged only)."""
        row = self.block_tables[slot]
        assert len(blocks) <= row.shape[0], f"{len(blocks)} blocks > {row.shape[0]} per slot"
        row.fill_(self.null_block)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.long, device=row.device)

    def entries(self, slots: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [B] and positions [B, N] -> (block [B, N], offset [B, N]) of the paged cache.
        E.g. block_size 4, table [7, 2]: position 5 -> block 2, offset 1."""
        size = self.block_size
        return self.block_tables[slots[:, None], pos // size], pos % size

    def table_rows(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """The blocks [B, nb] that hold each slot's first `width` entries."""
        return self.block_tables[slots, : -(-width // self.block_size)]

    def gather(self, layer_idx: int, slots: torch.Tensor, width: int,
               blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's first `width` entries of each slot's K and V (all columns), read
        through the block tables into rows of the slotted layout: [B, KVH, width, Dh(+1)]
        (a copy; what attention kernels without a block table read). blocks: `table_rows`
        of the slots and width, where the caller has them."""
        if blocks is None:
            blocks = self.table_rows(slots, width)  # [B, nb]

        def rows(kv: torch.Tensor) -> torch.Tensor:
            got = kv[layer_idx][blocks]  # [B, nb, KVH, bs, D]
            num_b, nb, num_kv, size, dim = got.shape
            return got.transpose(1, 2).reshape(num_b, num_kv, nb * size, dim)[:, :, :width]

        return rows(self.k), rows(self.v)

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

    def head_runs(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V (V's column of ones left out) as [1, KVH, blocks x S, Dh]
        views: every block's entries of a KV head in one run (entry p of block j at
        j x S + p), what FlexAttention reads a paged cache through. Needs the heads-outer
        layout (`allocate(heads_outer=True)`); raises otherwise (a copy of the whole cache
        a layer would defeat the purpose)."""
        dim = self.k.shape[-1]
        runs = []
        for kv in (self.k[layer_idx], self.v[layer_idx, ..., :dim]):
            heads = kv.transpose(0, 1)  # [KVH, blocks, S, Dh]
            if heads.stride(1) != heads.shape[2] * heads.stride(2) or heads.stride(3) != 1:
                raise ValueError("the cache is not laid out heads-outer "
                                 "(KVCache.allocate_paged(heads_outer=True))")
            runs.append(heads.as_strided((1, heads.shape[0], heads.shape[1] * heads.shape[2],
                                          dim), (0, heads.stride(0), heads.stride(2), 1)))
        return runs[0], runs[1]

    @property
    def max_len(self) -> int:
        """The most entries one slot holds."""
        if self.block_tables is not None:
            return self.block_tables.shape[1] * self.block_size
        return self.k.shape[3]

    def commit(self, slots: torch.Tensor, node_idx: torch.Tensor, num_kept: torch.Tensor) -> None:
        """Move the accepted nodes' K/V to the end of each prefix and advance the lengths.

        slots: [B] cache slots (distinct); node_idx: [B, A] tree-node indices to keep in order
        (root first), padded arbitrarily past num_kept[b]; num_kept: [B]. node_idx and
        num_kept are best on the host (the engine's: they are read there, and a copy from a
        GPU waits for it); any of the three may be on either device.
        E.g. length 7, node_idx [0, 2, 5] -> entries at 7, 9, 12 move to 7, 8, 9; length 10.
        """
        dev = self.lengths.device
        keep = num_kept.tolist()
        slots, num_kept = slots.to(dev), num_kept.to(dev)
        if all(row[:k] == list(range(k)) for row, k in zip(node_idx.tolist(), keep, strict=True)):
            # every kept node already sits where it goes (a plain step, or a chain accepted
            # from its start): nothing moves (the move cost ~0.25 ms a step at batch 1)
            self.lengths.index_add_(0, slots, num_kept)  # (one operation: `+=` is three)
            return
        node_idx = node_idx.to(dev)
        base = self.lengths[slots]  # [B]
        src = base[:, None] + node_idx  # [B, A]
        dst = base[:, None] + torch.arange(node_idx.shape[1], device=node_idx.device)
        assert int(src.max()) < self.max_len, "tree ran past the cache; allocate a longer one"
        if self.block_tables is not None:
            (src_block, src_off), (dst_block, dst_off) = (self.entries(slots, src),
                                                          self.entries(slots, dst))
            for kv in (self.k, self.v):
                kv[:, dst_block, :, dst_off] = kv[:, src_block, :, src_off]  # [B, A, L, KVH, D]
            self.lengths.index_add_(0, slots, num_kept)
            return
        for kv in (self.k, self.v):
            moved = kv[:, slots[:, None], :, src]  # [B, A, L, KVH, Dh] (advanced dims first)
            kv[:, slots[:, None], :, dst] = moved
        self.lengths.index_add_(0, slots, num_kept)

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot src's committed entries (only those: a whole slot of the embedded model is
        50 MB, and copying it took 17-30 ms each time a request finished) into slot dst.
        Paged: the block table is copied, not the entries."""
        if self.block_tables is not None:
            self.block_tables[dst] = self.block_tables[src]
            self.lengths[dst] = self.lengths[src]
            return
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        if self.key_blocks_valid is not None:  # dst's blocks were another request's keys
            self.key_blocks_valid[:, dst] = 0


class AttentionWindow(Protocol):
    """What a backend's attention keeps per forward (`StepInputs.window`). Over a paged cache
    `attend` gets each slot's entries gathered into rows, unless the window `reads_blocks`:
    then the layer's blocks in place (`KVCache.head_runs`) with the step's own inputs."""

    reads_blocks: bool

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
               inp: StepInputs) -> torch.Tensor: ...


# (base [B], tree_mask [B, N, T], slots [B], one layer's K cache shape) -> AttentionWindow
WindowBuilder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]],
                         AttentionWindow]


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
    # set: attend with `window.attend(q, cache_k, cache_v, inp)`, a backend's exact attention
    # (`eagle2.cpu.attention.CanonicalWindow`) instead of SDPA over `mask`
    window: AttentionWindow | None = None
    base: torch.Tensor | None = None  # [B] committed lengths (what `tree_mask` is after)
    tree_mask: torch.Tensor | None = None  # [B, N, T] scratch entries each new token sees
    # paged cache: entries of each slot the layers read through the block tables (gathered
    # into rows of the slotted layout for SDPA and `window`), and the inputs `window.attend`
    # gets with those rows (slots 0..B-1, contiguous)
    gather_len: int = 0
    gathered: StepInputs | None = None
    # paged cache, the same for every layer (made once a forward, not once a layer): the
    # (block, offset) [B, N] each new entry goes to, and the blocks [B, nb] holding each slot's
    # first gather_len entries
    write_entries: tuple[torch.Tensor, torch.Tensor] | None = None
    read_blocks: torch.Tensor | None = None
    # `packed_bias`'s masks, made by the first layer that asks and shared by the others
    packed: dict = field(default_factory=dict)

    def packed_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The mask [B, 1, N, S] as an additive bias in `dtype` (0 where a token may attend,
        -inf elsewhere), its rows repeated for `group` query heads: [B, 1, group N, S], row
        g N + n is token n's (`masked_sdpa`'s packed query heads). Its rows start 16-element
        aligned (a view of wider rows), as CUDA's memory-efficient kernel wants a bias (SDPA
        pads a copy of an unaligned one in every call)."""
        key = (group, dtype)
        if key not in self.packed:
            num_b, _, num_n, keys = self.mask.shape
            bias = torch.zeros(num_b, 1, group, num_n, -(-keys // 16) * 16, dtype=dtype,
                               device=self.mask.device)
            bias[..., :keys].masked_fill_(~self.mask[:, :, None], float("-inf"))
            self.packed[key] = bias.view(num_b, 1, group * num_n, -1)[..., :keys]
        return self.packed[key]


def dense_step_mask(base: torch.Tensor, scratch: torch.Tensor, tree_mask: torch.Tensor,
                    keys: int, window: int | None = None) -> torch.Tensor:
    """The [B, 1, N, keys] bool mask of a step: each new entry sees its row's committed prefix
    [0, base[b]) (the last `window` of it, where given) and the scratch entries
    scratch [B, T] that tree_mask [B, N, T] lets it see."""
    num_b, num_n, num_t = tree_mask.shape
    cols = torch.arange(keys, device=base.device)  # [S]
    prefix = cols[None, :] < base[:, None]  # [B, S]
    if window is not None:
        prefix &= cols[None, :] >= (base[:, None] - window)
    mask = prefix[:, None, :].expand(num_b, num_n, keys).clone()  # [B, N, S]
    mask.scatter_(2, scratch[:, None, :].expand(num_b, num_n, num_t), tree_mask)
    return mask[:, None]


def step_inputs(cache: KVCache, slots: torch.Tensor, tree_mask: torch.Tensor,
                positions: torch.Tensor, rotary: Callable, like: torch.Tensor,
                window: int | None = None, exact_window: WindowBuilder | None = None,
                dense_mask: bool = True) -> StepInputs:
    """Build the shared per-forward inputs for N new tokens per request.

    The new tokens are the last N entries of a scratch region of T >= N entries that starts at
    each slot's committed length (the target uses T = N; the drafter appends one tree level
    per call, so its earlier levels are the first T - N entries).
    tree_mask: [B, N, T] bool, which scratch entries each new token sees (itself included).
    positions: [B, N] RoPE positions. window: also hide prefix entries older than this.
    exact_window: a backend's exact attention (results independent of the tree's shape:
    `Backend.attention_window`), else SDPA over the dense mask.
    rotary: (like, positions) -> cos, sin [B, N, Dh] (a rotary module or a `RopeTable`).
    dense_mask: build the [B, 1, N, S] mask (the native operators need only tree_mask).
    """
    num_b, num_n = positions.shape
    num_t = tree_mask.shape[2]
    base = cache.lengths[slots]  # [B]
    scratch = base[:, None] + torch.arange(num_t, device=positions.device)  # [B, T]
    write_pos = scratch[:, num_t - num_n:]  # [B, N]
    # what the checks below read, as lists (each tensor reduction here had cost ~5-15 us;
    # from a device: one read)
    starts, slot_ids = host_lists([base, slots])
    s_used = max(starts, default=0) + num_t
    assert s_used <= cache.max_len, f"sequence needs {s_used} cache entries > {cache.max_len}"
    mask = dense_step_mask(base, scratch, tree_mask, s_used, window) if dense_mask else None
    cos, sin = rotary(like, positions)
    paged = cache.block_tables is not None
    contiguous = not paged and num_b > 0 and slot_ids == list(range(num_b))
    write_start = None
    if contiguous and starts.count(starts[0]) == num_b:
        write_start = starts[0] + num_t - num_n
    rows, shape = slots, cache.k.shape[1:]
    gather_len = 0
    if paged:  # the layers read gathered rows: [B, KVH, gather_len, Dh]
        gather_len = min(-(-s_used // PAGED_GATHER) * PAGED_GATHER, cache.max_len)
        rows = torch.arange(num_b, device=slots.device)
        shape = (num_b, shape[1], gather_len, shape[3])
    found = (exact_window(base, tree_mask, rows, shape)
             if exact_window is not None and window is None else None)
    inp = StepInputs(slots, write_pos, mask, cos, sin, contiguous, write_start, found,
                     base, tree_mask, gather_len)
    if paged:
        inp.gathered = StepInputs(rows, write_pos, mask, cos, sin, True, None, found, base,
                                  tree_mask, gather_len)
        inp.write_entries = cache.entries(slots, write_pos)
        inp.read_blocks = cache.table_rows(slots, gather_len)
    return inp


# a paged forward gathers each slot's entries rounded up to this (the CPU's exact attention
# rounds the keys it scores up to 64, FlexAttention's blocks are 128)
PAGED_GATHER = 128


class HeadRotary(LlamaRotaryEmbedding):
    """A draft head's RoPE, whose frequencies stay fp32 whatever dtype the head is cast to, as
    the target's do (transformers keeps them fp32 in a model loaded in bf16) and as the heads
    were trained. `head.to(torch.bfloat16)` had rounded `inv_freq` to bf16 (8 bits): an
    angle pos * f off by up to pos * f * 2^-9, ~0.7 rad at position 500 for f ~ 0.75, so the
    head's attention over its own cache drifted as the context grew. Moves between devices
    still apply."""

    def _apply(self, fn, recurse=True):
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            self._buffers[name] = buf.to(self._buffers[name].device)
        return self


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
        that index it themselves: `eagle2.cpu.head.HeadStep`)."""
        table = self._table
        if table is None or table[0].shape[0] < size or table[0].dtype != like.dtype \
                or table[0].device != like.device:
            size = max(size, 2 * table[0].shape[0] if table is not None else 1024)
            cos, sin = self.rotary(like, torch.arange(size, device=like.device)[None])
            self._table = table = cos[0], sin[0]
        return table


@dataclass
class Parts:
    """Several groups of new tokens in one forward (`TargetModel.forward_parts`: e.g. the
    running requests' trees and prompts, docs/kv-cache.md "Prompts ride in the verification
    forward"). The layers see x [1, T, H], every group's tokens flattened one after another,
    so their projections and MLP are one matrix product over all T tokens; attention runs per
    group, over its own `StepInputs` (its slots, tree mask, positions): `attend_groups`."""

    inputs: list[StepInputs]
    shapes: list[tuple[int, int]]  # (B, N) of each group

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """[1, T, D] -> each group's [B, N, D] (views)."""
        sizes = [b * n for b, n in self.shapes]
        return [g.view(b, n, -1) for g, (b, n) in zip(t[0].split(sizes), self.shapes,
                                                      strict=True)]

    @staticmethod
    def join(groups: list[torch.Tensor]) -> torch.Tensor:
        """Each group's [B, N, D] -> [1, T, D]."""
        return torch.cat([g.reshape(-1, g.shape[-1]) for g in groups])[None]



def attend_groups(inp: StepInputs | Parts, tensors: list[torch.Tensor],
                  attend_one: Callable) -> torch.Tensor:
    """A layer's attention: attend_one(*tensors, inp) -> [B, N, D] for one group's tensors
    [B, N, *] (e.g. its q, k, v); for a `Parts` forward, each group's slices of the tensors
    [1, T, *] with its own inputs, joined: [1, T, D]."""
    if not isinstance(inp, Parts):
        return attend_one(*tensors, inp)
    return inp.join([attend_one(*group[:-1], group[-1]) for group in
                     zip(*(inp.split(t) for t in tensors), inp.inputs, strict=True)])


def decoder_layer(layer: torch.nn.Module, layer_idx: int, x: torch.Tensor, cache: KVCache,
                  inp: StepInputs | Parts, head_dim: int,
                  skip_input_norm: bool = False) -> torch.Tensor:
    """One Llama decoder layer on x [B, N, H] (or a `Parts` forward's [1, T, H]) that writes
    its K/V into the cache. Where the layer's projections were merged
    (`eagle2.tp.merge_projections`: `qkv_proj`, `gate_up_proj`) q|k|v and gate|up are one
    matrix product each."""
    attn = layer.self_attn
    h = x if skip_input_norm else layer.input_layernorm(x)
    merged = getattr(attn, "qkv_proj", None)
    if merged is not None:  # [B, N, (Hq + 2 KVH) Dh] -> q, k, v
        q, k, v = merged(h).split(attn.qkv_sizes, dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    def attend_one(q, k, v, inp: StepInputs) -> torch.Tensor:  # [B, N, Hq Dh]
        num_b, num_n, _ = q.shape
        q = q.view(num_b, num_n, -1, head_dim).transpose(1, 2)  # [B, Hq, N, Dh]
        k = k.view(num_b, num_n, -1, head_dim).transpose(1, 2)  # [B, KVH, N, Dh]
        v = v.view(num_b, num_n, -1, head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, inp.cos, inp.sin)
        out = cached_attention(q, k, v, cache, layer_idx, inp)  # [B, Hq, N, Dh]
        return out.transpose(1, 2).reshape(num_b, num_n, -1)

    x = x + attn.o_proj(attend_groups(inp, [q, k, v], attend_one))
    mlp, h = layer.mlp, layer.post_attention_layernorm(x)
    gate_up = getattr(mlp, "gate_up_proj", None)
    if gate_up is None:
        return x + mlp(h)
    gate, up = gate_up(h).chunk(2, dim=-1)  # [B, N, I] each
    return x + mlp.down_proj(mlp.act_fn(gate) * up)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                     layer_idx: int, inp: StepInputs) -> torch.Tensor:
    """Write the new k, v [B, KVH, N, Dh] into the cache, attend q [B, Hq, N, Dh] over the
    prefix and the tree (inp.mask): -> [B, Hq, N, Dh]."""
    num_b, num_n = q.shape[0], q.shape[2]
    if cache.block_tables is not None:
        return _paged_attention(q, k, v, cache, layer_idx, inp)
    cache_v = cache.values[layer_idx]
    if inp.write_start is not None:  # contiguous slots, all at one length: slice copies
        end = inp.write_start + num_n
        cache.k[layer_idx, :num_b, :, inp.write_start:end] = k
        cache_v[:num_b, :, inp.write_start:end] = v
    else:
        slot_idx = inp.slots[:, None]  # [B, 1]
        cache.k[layer_idx][slot_idx, :, inp.write_pos] = k.transpose(1, 2).to(cache.k.dtype)
        cache_v[slot_idx, :, inp.write_pos] = v.transpose(1, 2).to(cache.v.dtype)
    if inp.window is not None:  # a backend's attention (it may have no dense mask)
        return inp.window.attend(q, cache.k[layer_idx], cache.v[layer_idx], inp)
    s_used = inp.mask.shape[-1]
    if inp.contiguous:
        keys = cache.k[layer_idx, :num_b, :, :s_used]  # [B, KVH, S, Dh] (a view)
        values = cache_v[:num_b, :, :s_used]
    else:
        keys = cache.k[layer_idx][inp.slots, :, :s_used]  # a copy
        values = cache_v[inp.slots, :, :s_used]
    return masked_sdpa(q, keys.to(q.dtype), values.to(q.dtype), inp)


def _paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                     layer_idx: int, inp: StepInputs) -> torch.Tensor:
    """`cached_attention` over a paged cache: the new k, v [B, KVH, N, Dh] go to their blocks,
    then the attention reads each slot's entries gathered through its block table, or (a
    window that `reads_blocks`) the blocks where they are."""
    block, off = inp.write_entries  # [B, N] (`step_inputs`)
    head_dim = k.shape[-1]
    cache.k[layer_idx][block, :, off] = k.transpose(1, 2).to(cache.k.dtype)  # [B, N, KVH, Dh]
    cache.v[layer_idx][block, :, off, :head_dim] = v.transpose(1, 2).to(cache.v.dtype)
    if inp.window is not None and inp.window.reads_blocks:  # FlexAttention: blocks in place
        return inp.window.attend(q, *cache.head_runs(layer_idx), inp)
    keys, values = cache.gather(layer_idx, inp.slots, inp.gather_len, inp.read_blocks)
    if inp.window is not None:
        return inp.window.attend(q, keys, values, inp.gathered)
    s_used = inp.mask.shape[-1]
    return masked_sdpa(q, keys[:, :, :s_used].to(q.dtype),
                       values[:, :, :s_used, :head_dim].to(q.dtype), inp)


# devices on which `masked_sdpa` packs GQA's query heads into the query dimension
PACK_GQA_DEVICES = frozenset({"cuda"})


def masked_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                inp: StepInputs) -> torch.Tensor:
    """SDPA of q [B, Hq, N, Dh] over keys, values [B, KVH, S, Dh] where inp.mask [B, 1, N, S]
    allows -> [B, Hq, N, Dh].

    GQA (Hq = G KVH, G > 1) with a mask: on CUDA, SDPA takes `enable_gqa` only in its flash
    kernel, which takes no mask, so a masked GQA call runs the math kernel (K/V repeated G
    times, fp32 scores [B, Hq, N, S] in memory; docs/architecture.md "On GPUs"). There (on
    `PACK_GQA_DEVICES`) the G query heads that share a KV head are packed into the query
    dimension instead, as the decode kernels of FlashInfer and vLLM do: q [B, KVH, G N, Dh]
    against the K/V as they are, under the mask's rows repeated per head as an additive bias
    (`StepInputs.packed_bias`, made once a forward): a masked SDPA without GQA, which the
    memory-efficient kernel runs, reading each KV head once. Every query row still attends
    over its own KV head's keys under its own mask row: the same attention, rows batched
    differently. Elsewhere (the CPU) SDPA takes `enable_gqa`."""
    num_b, num_hq, num_n, head_dim = q.shape
    num_kv = keys.shape[1]
    if num_hq == num_kv or q.device.type not in PACK_GQA_DEVICES:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=inp.mask,
                                              enable_gqa=num_hq != num_kv)
    group = num_hq // num_kv
    packed = q.reshape(num_b, num_kv, group * num_n, head_dim)  # row g N + n: head kv G + g
    out = F.scaled_dot_product_attention(packed, keys, values,
                                         attn_mask=inp.packed_bias(group, q.dtype))
    # (CUDA's kernels return [B, L, H, D] memory transposed: a copy where a view cannot be)
    return out.reshape(num_b, num_hq, num_n, out.shape[-1])


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
