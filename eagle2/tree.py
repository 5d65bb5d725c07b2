"""Draft trees as pure tensor functions (docs/DESIGN.md "Draft tree"): rerank and flatten.

A tree is built from a flat list of C candidates in depth order (all depth-1 candidates, then
all depth-2 ones, ...), each with a token, a parent (an index into the same list, -1 for the
root) and a score (sum of draft log-probs along its path; -inf: not a candidate). `build_tree`
keeps the `num_nodes - 1` best candidates (ties: the shallower, i.e. earlier, one) and flattens
them with the root first. A child's score never exceeds its parent's (log-probs are <= 0) and a
parent always comes earlier in the list, so a stable descending sort ranks every parent before
its children and the kept set is connected; `build_tree` asserts this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """B flattened trees of N nodes; node 0 is the root (the last token the target produced)."""

    tokens: torch.Tensor  # [B, N] token ids
    parents: torch.Tensor  # [B, N] parent node index; -1 for the root and padding
    depths: torch.Tensor  # [B, N] root 0; position offset of the node
    tree_mask: torch.Tensor  # [B, N, N] bool: node i sees node j (itself and its ancestors)
    retrieve_indices: torch.Tensor  # [B, P, D + 1] root-to-leaf node indices, -1 padded
    num_nodes: torch.Tensor  # [B] valid nodes per tree (the rest is padding)
    # [B, N] float: estimated probability that verification accepts the node (its path value,
    # calibrated by the drafter when it can); root 1, padding 0. Used to choose the budget.
    values: torch.Tensor
    # [B, N] bool: the node was proposed by prompt lookup alone (`eagle2.lookup`), not by the
    # head; such nodes cost no head call (what the budget and the stats need to know)
    lookup: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: torch.Tensor) -> DraftTree:
        return DraftTree(*(t[rows] for t in self._fields()))

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.parents, self.depths, self.tree_mask, self.retrieve_indices,
                self.num_nodes, self.values, self.lookup)

    def head_depth(self) -> int:
        """The deepest node the head proposed (the head calls this tree took, less one)."""
        return int(self.depths.masked_fill(self.lookup, 0).max()) if self.size else 0

    @staticmethod
    def concat(trees: list[DraftTree]) -> DraftTree:
        """Stack trees of different sizes into one batch, padding nodes and paths."""
        n = max(t.size for t in trees)
        p = max(t.retrieve_indices.shape[1] for t in trees)
        d = max(t.retrieve_indices.shape[2] for t in trees)
        padded = [_pad_tree(t, n, p, d) for t in trees]
        fields = zip(*(t._fields() for t in padded), strict=True)
        return DraftTree(*(torch.cat(parts) for parts in fields))


def _pad_tree(t: DraftTree, n: int, p: int, d: int) -> DraftTree:
    b, extra = t.batch_size, n - t.size
    eye = torch.eye(n, dtype=torch.bool, device=t.tokens.device).expand(b, n, n).clone()
    eye[:, : t.size, : t.size] = t.tree_mask
    r = t.retrieve_indices
    r = torch.nn.functional.pad(r, (0, d - r.shape[2], 0, p - r.shape[1]), value=-1)
    return DraftTree(
        torch.nn.functional.pad(t.tokens, (0, extra), value=0),
        torch.nn.functional.pad(t.parents, (0, extra), value=-1),
        torch.nn.functional.pad(t.depths, (0, extra), value=0),
        eye, r, t.num_nodes,
        torch.nn.functional.pad(t.values, (0, extra), value=0.0),
        torch.nn.functional.pad(t.lookup, (0, extra), value=False),
    )


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N] parents -> [B, N, N] bool: each node sees itself and its ancestors.

    anc(i) = {i} | anc(parent(i)); each round adds one level, so max_depth rounds suffice.
    """
    num_b, num_n = parents.shape
    eye = torch.eye(num_n, dtype=torch.bool, device=parents.device).expand(num_b, num_n, num_n)
    has_parent = (parents >= 0)[:, :, None]  # [B, N, 1]
    up = parents.clamp(min=0)[:, :, None].expand(num_b, num_n, num_n)
    mask = eye.clone()
    for _ in range(max_depth):
        mask = eye | (torch.gather(mask, 1, up) & has_parent)
    return mask


def retrieve_paths(tree_mask: torch.Tensor, parents: torch.Tensor,
                   num_nodes: torch.Tensor) -> torch.Tensor:
    """Root-to-leaf node indices [B, P, D + 1] (-1 padded) from the ancestor mask.

    A leaf is a valid node that is nobody's parent. Because nodes are in depth order, a
    leaf's ancestors sorted by index are its path from the root.
    """
    num_n = parents.shape[1]
    idx = torch.arange(num_n, device=parents.device)
    valid = idx[None, :] < num_nodes[:, None]  # [B, N]
    is_parent = torch.zeros_like(valid)
    is_parent.scatter_(1, parents.clamp(min=0), parents >= 0)
    leaf = valid & ~is_parent  # [B, N]
    num_paths = int(leaf.sum(1).max())
    depth = int(tree_mask.sum(-1).max())  # nodes on the longest path
    # leaves first (stable, in node order), then non-leaves
    order = torch.sort((~leaf).to(torch.uint8), dim=1, stable=True).indices[:, :num_paths]
    rows = torch.gather(tree_mask, 1, order[:, :, None].expand(-1, -1, num_n))  # [B, P, N]
    keyed = torch.where(rows, idx, num_n)  # ancestors keep their index, others sort last
    path = torch.sort(keyed, dim=-1).values[:, :, :depth]
    path = torch.where(path < num_n, path, -1)
    real = torch.gather(leaf, 1, order)  # [B, P] a padded row is not a leaf
    return torch.where(real[:, :, None], path, -1)


def build_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
               cand_scores: torch.Tensor, cand_depths: torch.Tensor, num_nodes: int,
               cand_values: torch.Tensor | None = None,
               cand_lookup: torch.Tensor | None = None) -> DraftTree:
    """Rerank candidates globally and flatten (docs/DESIGN.md "Draft tree").

    root: [B]; cand_*: [B, C] in depth order, parents index the candidate list (-1 = root),
    depths start at 1, scores -inf for entries that are not candidates. Keeps the best
    min(candidates, num_nodes - 1) of each row (rows with fewer candidates are padded).
    cand_values: the tree's values (default exp(scores)); cand_lookup: the tree's lookup flags.
    E.g. scores [-.1, -.5, -.2, -.9] (first two depth 1), keep 2 -> candidates 0 and 2.
    """
    num_b, num_c = cand_tokens.shape
    dev = root.device
    keep = min(num_c, num_nodes - 1)
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :keep]
    real = torch.gather(cand_scores, 1, order) > float("-inf")  # [B, keep] sorted: real first
    chosen = torch.sort(torch.where(real, order, num_c), dim=1).values  # depth order, pads last
    kept = real.sum(1)  # [B]
    keep = int(kept.max()) if num_b else 0
    chosen = chosen[:, :keep]
    valid = chosen < num_c
    chosen = torch.where(valid, chosen, 0)
    # map candidate index -> node index (root is node 0, chosen[b, j] is node j + 1); padding
    # writes to a spare last column
    node_of = torch.full((num_b, num_c + 1), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, torch.where(valid, chosen, num_c),
                     torch.arange(1, keep + 1, device=dev).expand(num_b, -1).clone())
    cand_parent = torch.gather(cand_parents, 1, chosen)  # [B, keep]
    parent_node = torch.where(
        cand_parent >= 0, torch.gather(node_of, 1, cand_parent.clamp(min=0)), 0)
    assert bool(((cand_parent < 0) | (parent_node > 0) | ~valid).all()), \
        "reranked tree is disconnected"
    if cand_values is None:
        cand_values = cand_scores.float().exp()
    if cand_lookup is None:
        cand_lookup = torch.zeros_like(cand_tokens, dtype=torch.bool)
    zero = torch.zeros(num_b, 1, dtype=torch.long, device=dev)

    def pick(x: torch.Tensor, pad) -> torch.Tensor:
        return torch.where(valid, torch.gather(x, 1, chosen), pad)

    tokens = torch.cat([root[:, None], pick(cand_tokens, 0)], 1)
    parents = torch.cat([zero - 1, torch.where(valid, parent_node, -1)], 1)
    depths = torch.cat([zero, pick(cand_depths, 0)], 1)
    values = torch.cat([zero + 1.0, pick(cand_values.float(), 0.0)], 1)
    lookup = torch.cat([zero > 0, pick(cand_lookup, False)], 1)
    return finish_tree(tokens, parents, depths, kept + 1, values, lookup)


def finish_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                num_nodes: torch.Tensor | None = None, values: torch.Tensor | None = None,
                lookup: torch.Tensor | None = None) -> DraftTree:
    """Derive the mask and retrieve paths from tokens/parents/depths [B, N] (depth order).

    values [B, N] default to 1 for every valid node (unknown: nothing to choose by); lookup
    [B, N] to False (head nodes)."""
    num_b, num_n = tokens.shape
    if num_nodes is None:
        num_nodes = torch.full((num_b,), num_n, dtype=torch.long, device=tokens.device)
    if values is None:
        idx = torch.arange(num_n, device=tokens.device)
        values = (idx[None, :] < num_nodes[:, None]).float()
    if lookup is None:
        lookup = torch.zeros_like(tokens, dtype=torch.bool)
    max_depth = int(depths.max()) if num_n else 0
    mask = ancestor_mask(parents, max(max_depth, 1))
    return DraftTree(tokens, parents, depths, mask, retrieve_paths(mask, parents, num_nodes),
                     num_nodes, values, lookup)


def prune_tree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """Keep each tree's root and its best keep[b] - 1 other nodes by value: [B] -> N' = max keep.

    A child's value never exceeds its parent's and parents come first in node order, so a
    stable descending sort ranks every parent before its children: the kept set is connected.
    E.g. values [1, .9, .2, .6] (node 3 a child of node 1), keep 3 -> nodes 0, 1, 3.
    """
    num_b, num_n = tree.tokens.shape
    dev = tree.tokens.device
    keep = torch.minimum(keep.to(dev), tree.num_nodes)
    width = int(keep.max())
    idx = torch.arange(num_n, device=dev)
    ranked = torch.where(idx[None, :] < tree.num_nodes[:, None], tree.values,
                         torch.tensor(-1.0, device=dev))
    ranked[:, 0] = 2.0  # the root always stays first
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :width]
    chosen = torch.sort(order, dim=1).values  # [B, N'] back in depth order
    valid = torch.arange(width, device=dev)[None, :] < keep[:, None]  # [B, N']
    chosen = torch.where(valid, chosen, 0)
    # old node index -> new one (-1: dropped); invalid rows write to a spare last column
    node_of = torch.full((num_b, num_n + 1), -1, dtype=torch.long, device=dev)
    node_of.scatter_(1, torch.where(valid, chosen, num_n),
                     torch.arange(width, device=dev).expand(num_b, -1).clone())
    old_parent = torch.gather(tree.parents, 1, chosen)
    parents = torch.where(old_parent >= 0, torch.gather(node_of, 1, old_parent.clamp(min=0)), -1)
    parents = torch.where(valid, parents, -1)
    parents[:, 0] = -1
    assert bool(((old_parent < 0) | (parents >= 0) | ~valid).all()), "pruned tree is disconnected"
    tokens = torch.where(valid, torch.gather(tree.tokens, 1, chosen), 0)
    depths = torch.where(valid, torch.gather(tree.depths, 1, chosen), 0)
    values = torch.where(valid, torch.gather(tree.values, 1, chosen), 0.0)
    lookup = valid & torch.gather(tree.lookup, 1, chosen)
    return finish_tree(tokens, parents, depths, keep, values, lookup)


def root_only(root: torch.Tensor) -> DraftTree:
    """The one-node tree of plain decoding: [B] -> N = 1 (what `finish_tree` derives for it,
    built directly: every plain step of every request takes this path)."""
    tokens = root[:, None]
    ones = torch.ones_like(tokens, dtype=torch.bool)
    return DraftTree(tokens, torch.full_like(tokens, -1), torch.zeros_like(tokens),
                     ones[:, :, None], torch.zeros_like(tokens)[:, :, None],
                     torch.ones_like(root), ones.float(), ~ones)


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """A chain root -> t1 -> t2 ... over [B, N] tokens."""
    num_b, num_n = tokens.shape
    idx = torch.arange(num_n, device=tokens.device)
    return finish_tree(tokens, (idx - 1).expand(num_b, num_n).clone(),
                       idx.expand(num_b, num_n).clone())


# The EAGLE-1 default tree (mc_sim_7b_63): each path lists child ranks from the root.
EAGLE1_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


def static_shape(total_tokens: int, paths=EAGLE1_TREE) -> list[list[tuple[int, int]]]:
    """The static tree cut to total_tokens - 1 nodes, per level as (parent slot, rank).

    parent slot indexes the previous level's node list (level 1: the root, slot 0). Paths are
    taken in their listed order, skipping any whose prefix was cut.
    """
    kept: list[tuple[int, ...]] = []
    for path in paths:
        if len(kept) == total_tokens - 1:
            break
        if len(path) == 1 or path[:-1] in kept:
            kept.append(path)
    levels: list[list[tuple[int, ...]]] = []
    for path in sorted(kept, key=lambda p: (len(p), p)):
        while len(levels) < len(path):
            levels.append([])
        levels[len(path) - 1].append(path)
    shape = []
    for d, level in enumerate(levels):
        prev = levels[d - 1] if d else [()]
        shape.append([(prev.index(p[:-1]), p[-1]) for p in level])
    return shape
