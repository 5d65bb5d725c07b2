"""Tree construction: exact small cases, and the fast builder against a slow reference."""

from __future__ import annotations

import pytest
import torch

from eagle2.config import SamplingParams, TreeConfig
from eagle2.tree import DraftTree, build_tree, chain_tree, finish_tree, root_only, static_shape


def test_chain_mask_depths_paths():
    t = chain_tree(torch.tensor([[7, 8, 9, 10]]))
    assert t.tree_mask[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert t.depths.tolist() == [[0, 1, 2, 3]]
    assert t.retrieve_indices.tolist() == [[[0, 1, 2, 3]]]


def test_two_by_two_tree():
    # root -> a, b; a -> a0, a1; b -> b0, b1 (node order = depth order)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2]])
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 2]])
    t = finish_tree(torch.arange(7)[None], parents, depths)
    assert t.tree_mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ]
    assert t.retrieve_indices.tolist() == [[[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]]


def slow_build(root, tokens, parents, scores, depths, num_nodes):
    """The obvious version: python lists, explicit tie rule (higher value, then shallower)."""
    c = len(tokens)
    order = sorted(range(c), key=lambda i: (-scores[i], depths[i], i))[: num_nodes - 1]
    chosen = sorted(order)
    node_of = {cand: j + 1 for j, cand in enumerate(chosen)}
    out_tokens = [root] + [tokens[i] for i in chosen]
    out_parents = [-1] + [0 if parents[i] < 0 else node_of[parents[i]] for i in chosen]
    out_depths = [0] + [depths[i] for i in chosen]
    n = len(out_tokens)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i][j] = True
            j = out_parents[j]
    leaves = [i for i in range(n) if i not in out_parents]
    paths = []
    for leaf in leaves:
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = out_parents[j]
        paths.append(path[::-1])
    return out_tokens, out_parents, out_depths, mask, paths


def random_candidates(g, k: int, depth: int, quantize: bool):
    """Candidates as the drafter makes them: k at depth 1, then k*k children of the k best."""
    tokens, parents, scores, depths = [], [], [], []
    level = []
    for i in range(k):
        s = -float(torch.rand((), generator=g))
        tokens.append(int(torch.randint(0, 100, (), generator=g)))
        parents.append(-1), scores.append(s), depths.append(1)
        level.append(i)
    for d in range(2, depth + 2):
        frontier = sorted(level, key=lambda i: -scores[i])[:k]
        level = []
        for par in frontier:
            for _ in range(k):
                lp = -float(torch.rand((), generator=g))
                if quantize:  # many exact ties, zero log-probs included
                    lp = -round(float(torch.rand((), generator=g)) * 2) / 4
                level.append(len(tokens))
                tokens.append(int(torch.randint(0, 100, (), generator=g)))
                parents.append(par), scores.append(scores[par] + lp), depths.append(d)
    return tokens, parents, scores, depths


@pytest.mark.parametrize("quantize", [False, True])
def test_fast_builder_matches_slow_reference(quantize):
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        k = int(torch.randint(1, 5, (), generator=g))
        depth = int(torch.randint(1, 5, (), generator=g))
        num_nodes = int(torch.randint(2, 30, (), generator=g))
        batch = [random_candidates(g, k, depth, quantize) for _ in range(3)]
        t = build_tree(torch.tensor([5, 6, 7]), *(torch.tensor([b[i] for b in batch])
                                                   for i in (0, 1)),
                       torch.tensor([b[2] for b in batch], dtype=torch.float32),
                       torch.tensor([b[3] for b in batch]), num_nodes)
        for row, (tokens, parents, scores, depths) in enumerate(batch):
            f32 = torch.tensor(scores, dtype=torch.float32).tolist()
            ref = slow_build([5, 6, 7][row], tokens, parents, f32, depths, num_nodes)
            assert t.tokens[row].tolist() == ref[0], trial
            assert t.parents[row].tolist() == ref[1]
            assert t.depths[row].tolist() == ref[2]
            assert t.tree_mask[row].tolist() == ref[3]
            got = [[i for i in p if i >= 0] for p in t.retrieve_indices[row].tolist()]
            assert [p for p in got if p] == ref[4]


def test_concat_pads_and_keeps_rows():
    a = chain_tree(torch.tensor([[1, 2, 3]]))
    b = finish_tree(torch.tensor([[4, 5, 6, 7, 8]]), torch.tensor([[-1, 0, 0, 1, 1]]),
                    torch.tensor([[0, 1, 1, 2, 2]]))
    t = DraftTree.concat([a, b])
    assert t.tokens.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert t.num_nodes.tolist() == [3, 5]
    assert t.tree_mask[0, 3].tolist() == [False, False, False, True, False]  # pad: only itself
    assert t.retrieve_indices[0].tolist() == [[0, 1, 2], [-1, -1, -1], [-1, -1, -1]]


def test_padding_is_on_no_path_and_the_root_is_no_leaf():
    # root -> 1 -> 2, then one padding node (its parent -1): one path, the padding sees itself
    t = finish_tree(torch.tensor([[1, 2, 3, 0]]), torch.tensor([[-1, 0, 1, -1]]),
                    torch.tensor([[0, 1, 2, 0]]), num_nodes=torch.tensor([3]))
    assert t.retrieve_indices.tolist() == [[[0, 1, 2]]]
    assert t.tree_mask[0, 3].tolist() == [False, False, False, True]
    assert root_only(torch.tensor([4])).retrieve_indices.tolist() == [[[0]]]


def test_static_shape_is_the_eagle1_tree():
    shape = static_shape(26)
    assert [len(level) for level in shape] == [4, 8, 8, 3, 2]
    assert shape[0] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert sum(len(level) for level in static_shape(10)) == 9


@pytest.mark.parametrize("kwargs, message", [
    (dict(total_tokens=1), "total_tokens"),
    (dict(top_k=0), "top_k"),
    (dict(depth=0), "depth"),
    (dict(mode="beam"), "mode"),
    (dict(catch_up=8), "catch_up"),
    (dict(catch_up=-1), "catch_up"),
])
def test_bad_tree_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_root_only_is_what_finish_tree_derives_for_one_node():
    root = torch.tensor([5, 7, 0])
    want = finish_tree(root[:, None], torch.full((3, 1), -1), torch.zeros(3, 1, dtype=torch.long))
    got = root_only(root)
    for name, a, b in zip(("tokens", "parents", "depths", "tree_mask", "retrieve_indices",
                           "num_nodes", "values", "lookup"), got._fields(), want._fields(),
                          strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def longest_path_by_tensors(tree, pred: torch.Tensor):
    """The reference for `verify.verify_greedy_tokens`: its acceptance as tensor operations
    (what it ran before it walked the lists): each path's accepted prefix by cumprod, the
    first longest by argmax."""
    from eagle2.verify import Verified

    paths = tree.retrieve_indices  # [B, P, D + 1]
    safe = paths.clamp(min=0)
    tok = torch.gather(tree.tokens[:, None, :].expand(-1, paths.shape[1], -1), 2, safe)
    parent_pred = torch.gather(pred[:, None, :].expand(-1, paths.shape[1], -1), 2, safe[:, :, :-1])
    ok = (tok[:, :, 1:] == parent_pred) & (paths[:, :, 1:] >= 0)  # [B, P, D]
    num_acc = ok.long().cumprod(-1).sum(-1)  # [B, P]
    best = num_acc.argmax(-1)
    rows = torch.arange(paths.shape[0])
    nodes = [p[: a + 1] for p, a in zip(paths[rows, best].tolist(),
                                        num_acc[rows, best].tolist(), strict=True)]
    tokens = [[tree.tokens[b, n].item() for n in path[1:]] + [pred[b, path[-1]].item()]
              for b, path in enumerate(nodes)]
    return Verified(nodes, tokens)


def lazy_greedy_case(seed: int, first_rows: int = 0) -> bool:
    """verify_greedy_lazily (the argmax only where acceptance reaches) gives verify_greedy's
    result on random batches of trees of different sizes (padding), sibling tokens that repeat
    (two accepted branches: the first longest path wins) and argmaxes that often match; it
    asks for fewer rows than the trees have and never for a node off the accepted subtree.
    With first_rows, its first round has that many rows (or every node, or its roots and their
    children where they are more), the rest of the nodes of highest value, and no node is
    asked twice."""
    from eagle2.tree import tree_from_rows
    from eagle2.verify import verify_greedy, verify_greedy_lazily

    g = torch.Generator().manual_seed(seed)
    vocab = 3  # few tokens: drafts and argmaxes agree often, siblings repeat
    rows = []
    for _ in range(4):
        n = int(torch.randint(1, 12, (), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        order = sorted(range(n), key=lambda i: (depths[i], i))  # depth order, parents first
        where = {old: new for new, old in enumerate(order)}
        parents = [-1 if parents[i] < 0 else where[parents[i]] for i in order]
        depths = [depths[i] for i in order]
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        values = [1.0] + torch.rand(n - 1, generator=g).tolist()
        rows.append((tokens, parents, depths, values, [False] * n))
    tree = tree_from_rows(rows)
    logits = torch.randn(tree.batch_size, tree.tokens.shape[1], vocab, generator=g)
    asked, rounds = [], []

    def argmax(b, n):
        asked.extend(zip(b, n, strict=True))
        rounds.append(list(zip(b, n, strict=True)))
        return logits[b, n].argmax(-1)

    lazy = verify_greedy_lazily(tree, argmax, first_rows)
    full = verify_greedy(tree, logits)
    assert lazy == full == longest_path_by_tensors(tree, logits.argmax(-1))
    assert len(asked) == len(set(asked)) <= int(tree.num_nodes.sum())
    if first_rows:
        base = [(b, n) for b, row in enumerate(rows) for n in range(len(row[1]))
                if row[1][n] <= 0]
        assert rounds[0][:len(base)] == base
        total = sum(len(row[1]) for row in rows)
        assert len(rounds[0]) == max(len(base), min(first_rows, total))
        rest = sorted(((rows[b][3][n], -b, -n) for b, row in enumerate(rows)
                       for n in range(len(row[1])) if (b, n) not in base), reverse=True)
        assert rounds[0][len(base):] == [(-b, -n) for _, b, n in rest[:len(rounds[0])
                                                                           - len(base)]]
        return True
    pred = logits.argmax(-1).tolist()

    def accepted(b: int, n: int) -> bool:
        tokens, parents = rows[b][0], rows[b][1]
        while parents[n] >= 0 and tokens[n] == pred[b][parents[n]]:
            n = parents[n]
        return parents[n] < 0

    for i, (b, n) in enumerate(asked):
        # a root, a root's child, an accepted node, or the first child of an accepted node
        # asked alone in its round
        parent = rows[b][1][n]
        first_child = parent >= 0 and n == rows[b][1].index(parent)
        lookahead = i > 0 and asked[i - 1] == (b, parent) and first_child
        assert parent <= 0 or accepted(b, n) or (lookahead and accepted(b, parent)), (b, n)
    return len(asked) < int(tree.num_nodes.sum())


def test_lazy_greedy_verification_equals_verifying_with_every_argmax():
    assert sum(lazy_greedy_case(seed) for seed in range(12)) >= 6  # and rows were skipped


def test_lazy_greedy_verification_with_a_wider_first_round():
    for seed in range(12):
        for first_rows in (1, 6, 16, 64):
            assert lazy_greedy_case(seed, first_rows)
