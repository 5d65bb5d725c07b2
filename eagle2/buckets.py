"""Fixed-shape steps for CUDA graphs: batch, node and key-length buckets, and the padding of
a step's inputs up to its bucket and of its outputs back, the same on every device.

A CUDA graph replays one fixed shape, but the serving engine's steps vary: the batch B, the
new entries per request N (the target's verification: the tree's nodes; a prefill: the
longest prompt; the draft head: one tree level) and how many cache entries they attend over.
So a step is padded up to a bucket (Bb, Nb) and attends over a key-length bucket S
(`Buckets`); `eagle2.cuda_graphs` captures one graph per bucket on CUDA and runs the very same
padded step eagerly elsewhere, so the CPU tests check the logic the GPU replays.

How a step is padded (`pad_step`), for tree_mask [B, N, T] (the new entries are the last N of
a scratch region of T entries after each slot's committed length: the target has T = N, a
draft level T = the earlier levels + N):

- rows B..Bb-1 are padding: their cache slot is the reserved scratch slot (one slot past the
  real ones, committed length 0, never committed, never read by a real row), token 0,
  position 0;
- entries N..Nb-1 of every row, and every entry of a padded row, are padding: each sees only
  itself (the scratch region grows to T - N + Nb and tree_mask is the identity there), no
  real entry sees them, and their K/V land past the real tree in the row's own scratch
  region (real rows: past the committed length and past this step's real entries, where the
  next step writes its own entries before it reads them) or in the scratch slot (padded
  rows). So a real row's committed entries and its real new entries are those of the
  unpadded step, and no real output depends on what the padding holds;
- `unpad` takes the real [B, N] corner of an output.

Padded outputs equal the unpadded step's on any device up to the kernels' rounding for other
row and key counts (on a CPU in fp32, ~1e-6: MKL's GEMM and SDPA round differently for other
shapes); for one bucket they are bitwise the same whatever the padding holds.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64)


def bucket_up(value: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= value (sizes ascending), or None past the largest.
    E.g. bucket_up(5, (1, 2, 4, 8)) = 8."""
    i = bisect_left(sizes, value)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class Buckets:
    """The fixed shapes steps are padded to: batch sizes, new entries per request, and key
    lengths (powers of two from min_keys, capped at the cache's length)."""

    batch: tuple[int, ...] = POWERS_OF_TWO
    nodes: tuple[int, ...] = POWERS_OF_TWO
    min_keys: int = 256

    def __post_init__(self):
        for name in ("batch", "nodes"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"{name} buckets must be ascending positive sizes, got {sizes}")
        if self.min_keys < 1:
            raise ValueError(f"min_keys must be >= 1, got {self.min_keys}")

    def batch_for(self, num_b: int, num_slots: int) -> int | None:
        """The batch bucket of num_b requests in a cache of num_slots real slots (a bucket
        past the slots is the slot count: a padded step never reads past the cache), or None
        (larger than the largest bucket or than the cache)."""
        if not 1 <= num_b <= num_slots:
            return None
        found = bucket_up(num_b, self.batch)
        return None if found is None else min(found, num_slots)

    def nodes_for(self, num_n: int) -> int | None:
        """The bucket of num_n new entries per request, or None (past the largest)."""
        return bucket_up(num_n, self.nodes) if num_n >= 1 else None

    def keys_for(self, needed: int, max_len: int) -> int | None:
        """The key length a step attends over when it needs `needed` cache entries (the
        longest committed length + its padded scratch region): the next power of two from
        min_keys, capped at max_len; None past max_len."""
        if needed > max_len:
            return None
        keys = self.min_keys
        while keys < needed:
            keys *= 2
        return min(keys, max_len)


@dataclass
class PaddedStep:
    """A step's inputs padded to a bucket, and how much of it is real."""

    tokens: torch.Tensor  # [Bb, Nb] long
    positions: torch.Tensor  # [Bb, Nb] RoPE positions
    tree_mask: torch.Tensor  # [Bb, Nb, Tb] bool, Tb = T - N + Nb
    slots: torch.Tensor  # [Bb] cache slots (the scratch slot for padded rows)
    num_b: int  # real rows B
    num_n: int  # real new entries per row N

    @classmethod
    def empty(cls, num_b: int, num_n: int, num_t: int, scratch_slot: int,
              device: torch.device | str) -> PaddedStep:
        """All-padding inputs of a bucket [num_b, num_n] with a scratch region of num_t
        entries (buffers a graph is captured over; `pad_step(..., out=)` fills them)."""
        step = cls(torch.zeros(num_b, num_n, dtype=torch.long, device=device),
                   torch.zeros(num_b, num_n, dtype=torch.long, device=device),
                   torch.zeros(num_b, num_n, num_t, dtype=torch.bool, device=device),
                   torch.full((num_b,), scratch_slot, dtype=torch.long, device=device), 0, 0)
        _self_only(step.tree_mask)
        return step


def _self_only(tree_mask: torch.Tensor) -> None:
    """In place: every entry of tree_mask [Bb, Nb, Tb] sees itself only (the last Nb
    columns are the new entries)."""
    num_n, num_t = tree_mask.shape[1:]
    tree_mask.zero_()
    tree_mask.diagonal(offset=num_t - num_n, dim1=1, dim2=2).fill_(True)


def pad_nodes(x: torch.Tensor, num_b: int, num_n: int, fill: float | int | bool = 0,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, N, ...] -> [num_b, num_n, ...] with x in the [B, N] corner, `fill` elsewhere
    (written into `out` when given)."""
    if out is None:
        out = x.new_full((num_b, num_n, *x.shape[2:]), fill)
    else:
        out.fill_(fill)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def pad_step(tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
             slots: torch.Tensor, num_b: int, num_n: int, scratch_slot: int,
             out: PaddedStep | None = None) -> PaddedStep:
    """Pad one step (tokens, positions [B, N], tree_mask [B, N, T], slots [B]) to the bucket
    [num_b, num_n] as the module docstring says; out: buffers to fill in place (from
    `PaddedStep.empty` with the same bucket and T - N + num_n). Device operations only (no
    host synchronisation). E.g. B = 1, N = 2, T = 2 -> [2, 4]: tree_mask row 0 of request 0
    keeps its two columns, rows 2, 3 and every row of request 1 see only themselves."""
    real_b, real_n = tokens.shape
    real_t = tree_mask.shape[2]
    if real_b > num_b or real_n > num_n:
        raise ValueError(f"step [{real_b}, {real_n}] exceeds its bucket [{num_b}, {num_n}]")
    num_t = real_t - real_n + num_n
    if out is None:
        out = PaddedStep.empty(num_b, num_n, num_t, scratch_slot, tokens.device)
    elif out.tree_mask.shape != (num_b, num_n, num_t):
        raise ValueError(f"buffers {tuple(out.tree_mask.shape)} are not the bucket's "
                         f"{(num_b, num_n, num_t)}")
    else:
        _self_only(out.tree_mask)
        out.slots.fill_(scratch_slot)
    pad_nodes(tokens, num_b, num_n, 0, out.tokens)
    pad_nodes(positions, num_b, num_n, 0, out.positions)
    out.tree_mask[:real_b, :real_n, :real_t] = tree_mask
    out.tree_mask[:real_b, :real_n, real_t:] = False
    out.slots[:real_b] = slots
    out.num_b, out.num_n = real_b, real_n
    return out


def unpad(x: torch.Tensor, num_b: int, num_n: int, copy: bool = True) -> torch.Tensor:
    """The real [num_b, num_n, ...] corner of a padded output (a copy unless copy=False: a
    graph's output buffer is overwritten by its next replay)."""
    real = x[:num_b, :num_n]
    return real.clone() if copy else real
