"""The paged KV cache (docs/kv-cache.md "Paged cache") gives bitwise the slotted cache's
results: prefill, tree steps, commits and copied slots, through scrambled block tables."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from test_attention import _bf16_target, needs_exact_bf16, sample_tree

from eagle2.attention import KVCache, causal_mask

MAX_LEN = 96


def _caches(target, block_size: int = 8):
    """A slotted cache of 2 slots and a paged one whose slots own scrambled blocks."""
    slotted = target.allocate_cache(2, MAX_LEN)
    paged = target.allocate_paged_cache(2, 40, block_size, MAX_LEN)
    per_slot = MAX_LEN // block_size
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    paged.set_blocks(0, order[:per_slot])
    paged.set_blocks(1, order[per_slot:2 * per_slot])
    return slotted, paged


def _run(target, cache: KVCache, prompts: list[list[int]], tree) -> list[torch.Tensor]:
    """Prefill each prompt, one tree step for both, commit a path, one more tree step: the
    features of each forward."""
    out = []
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        f = target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                           causal_mask(torch.tensor([n]), n), cache, torch.tensor([b]))
        cache.lengths[b] = n
        out.append(f.features)
    slots = torch.arange(2)
    for _ in range(2):
        positions = cache.lengths[:, None] + tree.depths
        f = target.forward(tree.tokens.expand(2, -1), positions,
                           tree.tree_mask.expand(2, -1, -1), cache, slots)
        out.append(f.features)
        cache.commit(slots, torch.tensor([[0, 1, 4], [0, 3, 0]]), torch.tensor([3, 2]))
    return out


def _committed(cache: KVCache, slot: int) -> torch.Tensor:
    n = int(cache.lengths[slot])
    if cache.paged:
        keys = [cache.gather(i, torch.tensor([slot]), n)[0] for i in range(len(cache.k))]
        return torch.stack(keys)[:, 0]  # [L, KVH, n, Dh]
    return cache.k[:, slot, :, :n]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_equals_slotted_bitwise(block_size):
    target = tiny_target(seed=21)
    slotted, paged = _caches(target, block_size)
    prompts = [list(range(1, 30)), [5, 9, 2]]
    tree = sample_tree()
    _same(_run(target, slotted, prompts, tree), _run(target, paged, prompts, tree))
    assert torch.equal(paged.lengths, slotted.lengths)
    for slot in range(2):
        assert torch.equal(_committed(paged, slot), _committed(slotted, slot))


@needs_exact_bf16
def test_paged_exact_bf16_attention_equals_slotted_bitwise():
    """The CPU's exact attention (`canonical_attention`) over gathered blocks."""
    target = _bf16_target(seed=22)
    assert target.backend.exact
    slotted, paged = _caches(target)
    prompts = [[t % 60 for t in range(2, 70)], [4, 4, 4, 4]]  # crosses the 32-key attention chunks
    tree = sample_tree()
    _same(_run(target, slotted, prompts, tree), _run(target, paged, prompts, tree))


def test_copied_slot_shares_blocks_and_null_block_takes_stray_writes():
    target = tiny_target(seed=23)
    cache = target.allocate_paged_cache(3, 20, 8, MAX_LEN)
    cache.set_blocks(2, [4, 9])
    prompt = list(range(3, 15))
    n = len(prompt)
    target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                   causal_mask(torch.tensor([n]), n), cache, torch.tensor([2]))
    cache.lengths[2] = n
    cache.copy_slot(2, 0)
    assert cache.block_tables[0, :3].tolist() == [4, 9, 20]  # 20: the null block
    assert torch.equal(_committed(cache, 0), _committed(cache, 2))
    before = cache.k[:, :20].clone()
    # a slot without blocks writes only the null block
    target.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]),
                   causal_mask(torch.tensor([2]), 2), cache, torch.tensor([1]))
    assert torch.equal(cache.k[:, :20], before)


def test_blocks_from_a_memory_budget():
    from eagle2.runner import LocalRunner, num_blocks_for

    target = tiny_target(seed=24)  # fp32, 2 layers, 2 KV heads of 16 dimensions
    per_token = target.kv_bytes_per_token()
    assert per_token == 2 * 2 * (16 + 16) * 4
    runner = LocalRunner(target, 4, 64, kv_cache_memory=per_token * 32 * 11, block_size=32)
    assert runner.paged == (10, 32)  # 11 blocks' bytes: 10 blocks and the null block
    assert runner.cache.k.shape == (2, 11, 2, 32, 16)
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for(target, per_token * 32, 32)
    with pytest.raises(ValueError, match="CUDA"):
        num_blocks_for(target, 0.5, 32)  # a fraction of free memory: GPUs only


def test_paged_flex_attention_equals_slotted():
    """FlexAttention (what CUDA targets attend with outside CUDA graphs; eager here) over the
    gathered blocks: the slotted cache's results."""
    from eagle2.flex import FlexBackend

    target = tiny_target(seed=23)
    target.backend = FlexBackend(compiled=False)
    slotted, paged = _caches(target)
    prompts = [list(range(1, 40)), [7, 3, 11]]
    tree = sample_tree()
    _same(_run(target, slotted, prompts, tree), _run(target, paged, prompts, tree))
    for slot in range(2):
        assert torch.equal(_committed(paged, slot), _committed(slotted, slot))
