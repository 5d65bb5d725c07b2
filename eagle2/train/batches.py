"""Batching of stored sequences for head training: length-bucketed, padded, reproducible.

The batch order of epoch e depends only on (seed, e), so a resumed run sees exactly the
batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from eagle2.train.data import Sequence


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool (False on padding)
    features: torch.Tensor  # [B, T, H] float32
    lengths: torch.Tensor  # [B]

    def to(self, device) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.loss_mask, self.features,
                                               self.lengths)))


def collate(seqs: list[Sequence], dtype: torch.dtype = torch.float32) -> Batch:
    lengths = torch.tensor([len(s.input_ids) for s in seqs])
    num_b, num_t = len(seqs), int(lengths.max())
    hidden = seqs[0].features.shape[-1]
    ids = torch.zeros(num_b, num_t, dtype=torch.long)
    mask = torch.zeros(num_b, num_t, dtype=torch.bool)
    feats = torch.zeros(num_b, num_t, hidden, dtype=dtype)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        ids[b, :n], mask[b, :n], feats[b, :n] = s.input_ids, s.loss_mask, s.features.to(dtype)
    return Batch(ids, mask, feats, lengths)


def pack(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices (already sorted by length) so that padded size <= batch_tokens."""
    batches, cur, longest = [], [], 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if cur and new_longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Shuffle, sort into length buckets of similar size, pack, shuffle the batches."""
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    idx.sort(key=lambda i: lengths[i])  # stable: ties keep the shuffled order
    batches = pack(idx, lengths, batch_tokens)
    rng.shuffle(batches)
    return batches
