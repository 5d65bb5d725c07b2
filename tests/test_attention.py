"""Tree attention equals causal attention along each root path; commit equals recomputation."""

from __future__ import annotations

import torch
from conftest import tiny_target

from eagle2.attention import causal_mask
from eagle2.tree import finish_tree


def causal_features(target, tokens: list[int]) -> torch.Tensor:
    """Plain causal forward over a whole sequence with a fresh cache: [T, H]."""
    cache = target.allocate_cache(1, 256)
    t = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    out = target.forward(t, pos, causal_mask(torch.tensor([len(tokens)]), len(tokens)), cache,
                         torch.tensor([0]))
    return out.features[0]


def prefill(target, prompt: list[int], slots: int = 1):
    cache = target.allocate_cache(slots, 256)
    n = len(prompt)
    target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                   causal_mask(torch.tensor([n]), n), cache, torch.tensor([0]))
    cache.lengths[0] = n
    return cache


def sample_tree():
    # root, 3 children, grandchildren under the first two, one great-grandchild
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4]])
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 3]])
    tokens = torch.tensor([[11, 3, 9, 30, 4, 5, 17, 21]])
    return finish_tree(tokens, parents, depths)


def test_tree_attention_matches_causal_along_each_path():
    target = tiny_target(seed=3)
    prompt = [1, 5, 2, 8, 13, 40]
    tree = sample_tree()
    cache = prefill(target, prompt)
    out = target.forward(tree.tokens, cache.lengths[:1, None] + tree.depths, tree.tree_mask,
                         cache, torch.tensor([0]))
    for node in range(tree.size):
        path = [i for i in range(tree.size) if tree.tree_mask[0, node, i]]
        seq = prompt + [int(tree.tokens[0, i]) for i in path]
        ref = causal_features(target, seq)[-1]
        torch.testing.assert_close(out.features[0, node], ref, rtol=1e-5, atol=1e-5)


def test_cache_after_commit_equals_recomputation():
    target = tiny_target(seed=4)
    prompt = [2, 7, 1, 8, 2, 8]
    tree = sample_tree()
    cache = prefill(target, prompt)
    target.forward(tree.tokens, cache.lengths[:1, None] + tree.depths, tree.tree_mask, cache,
                   torch.tensor([0]))
    accepted = [0, 1, 4, 7]  # root -> 3 -> 4 -> 21
    cache.commit(torch.tensor([0]), torch.tensor([accepted]), torch.tensor([len(accepted)]))
    seq = prompt + [int(tree.tokens[0, i]) for i in accepted]
    assert int(cache.lengths[0]) == len(seq)
    ref = prefill(target, seq)
    n = len(seq)
    torch.testing.assert_close(cache.k[:, 0, :, :n], ref.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, 0, :, :n], ref.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)
