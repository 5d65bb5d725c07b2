"""Draft trees as pure tensor functions (docs/draft-tree.md "Draft tree"): rerank and flatten.

A tree is built from a flat list of C candidates in depth order (all depth-1 candidates, then
all depth-2 ones, ...), each with a token, a parent (an index into the same list, -1 for the
root) and a score (sum of draft log-probs along its path; -inf: not a candidate). `build_tree`
keeps the `num_nodes - 1` best candidates (ties: the shallower, i.e. earlier, one) and flattens
them with the root first. A child's score never exceeds its parent's (log-probs are <= 0) and a
parent always comes earlier in the list, so a stable descending sort ranks every parent before
its children and the kept set is connected; `build_tree` asserts this.
"""

from __future__ import annotations

from array import array
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


# Where the engine keeps its trees and does the budget's math (Python lists and small tensors
# read with .tolist()): trees built from lists are made here, and trees from a drafter arrive
# here (`to_device`), whatever device the head runs on.
HOST = torch.device("cpu")


def to_device(x, device: torch.device | str):
    """The one conversion point for tensors that cross between the head, the engine and the
    target (or its ranks): a tensor, a DraftTree, or a tuple / list of them (None kept) on
    `device`, the receiving side's. Nothing is copied that is there already. E.g. the engine
    takes a drafted tree to HOST for the budget, the runner takes it to the target's device.
    """
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, DraftTree):  # its fields live on one device
        if x.tokens.device == torch.device(device):
            return x
        return DraftTree(*(t.to(device) for t in x._fields()))
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(t, device) for t in x)
    raise TypeError(f"cannot move a {type(x).__name__} to a device")


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


# Trees are small (tens of nodes, a few rows on a CPU), and each torch operation on such tensors
# costs 3-10 us: the functions below work on Python lists, row by row, and make each output
# tensor once (build + prune + mask + paths took ~0.9 ms a step as ~60 tensor operations, a
# few percent of a batch-1 step on a 2-core CPU).

# array typecodes of the dtypes `rows_tensor` reads through a buffer
_TYPECODES = {torch.long: "q", torch.float32: "f", torch.bool: "b"}


def rows_tensor(rows: list[list], dtype: torch.dtype, device: torch.device | str = HOST
                ) -> torch.Tensor:
    """Equal-length rows of Python numbers -> [len(rows), len(rows[0])] on `device`, read
    from one flat array (`torch.frombuffer`): torch.tensor over nested lists took ~2x as long
    for ints and floats ([32, 60]: ~100 against ~50 us) and ~15x for bools."""
    width = len(rows[0]) if rows else 0
    code = _TYPECODES.get(dtype)
    if code is None:
        return torch.tensor(rows, dtype=dtype, device=device).view(len(rows), width)
    return _read_buffer(array(code, [x for row in rows for x in row]), dtype,
                        (len(rows), width), device)


def _read_buffer(buf: array | bytearray, dtype: torch.dtype, shape: tuple[int, ...],
                 device: torch.device | str) -> torch.Tensor:
    """A filled buffer of `dtype` items as a tensor of `shape` on `device` (a copy: torch
    would otherwise share the buffer's memory)."""
    if not len(buf):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(buf, dtype=dtype).view(shape).clone().to(device)


def _mask_and_paths(parents: list[list[int]], counts: list[int], device: torch.device | str
                    ) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Rows of parents (depth order, -1 for the root and padding) and valid node counts ->
    the ancestor masks [B, N, N] bool on `device` (each node sees itself and its ancestors)
    and the root-to-leaf paths [B][P][D + 1] (-1 padded): one per leaf (a valid node that is
    no valid node's parent), in node order, D + 1 the most nodes on any node's path. The
    masks are written as bytes (torch.tensor over nested lists of bools cost ~0.6 ms for
    [32, 16, 16], every step at batch 32; the bytes ~0.04 ms)."""
    num_b, num_n = len(parents), len(parents[0]) if parents else 0
    masks = bytearray(num_b * num_n * num_n)
    paths, longest = [], 1
    for b, (par, count) in enumerate(zip(parents, counts, strict=True)):
        ancestors: list[list[int]] = []
        for i, p in enumerate(par):
            line = [*ancestors[p], i] if p >= 0 else [i]  # parents come first: ascending
            ancestors.append(line)
            row = (b * num_n + i) * num_n
            for j in line:
                masks[row + j] = 1
            longest = max(longest, len(line))
        has_child = [False] * num_n
        for p in par[:count]:
            if p >= 0:
                has_child[p] = True
        paths.append([ancestors[i] for i in range(count) if not has_child[i]])
    width = max(map(len, paths), default=0)
    padded = [[[*p, *[-1] * (longest - len(p))] for p in row] +
              [[-1] * longest] * (width - len(row)) for row in paths]
    return _read_buffer(masks, torch.bool, (num_b, num_n, num_n), device), padded


def tree_from_rows(rows: list[tuple[list, list, list, list, list]],
                   device: torch.device | str = HOST) -> DraftTree:
    """Per row (tokens, parents, depths, values, lookup flags) of its valid nodes, root first,
    depth order -> the padded DraftTree on `device`."""
    num_n = max(len(r[0]) for r in rows)
    counts = [len(r[0]) for r in rows]
    pads = (0, -1, 0, 0.0, False)
    cols = [[[*col, *[pad] * (num_n - len(col))] for col in c]
            for c, pad in zip(zip(*rows, strict=True), pads, strict=True)]
    mask, paths = _mask_and_paths(cols[1], counts, device)

    return DraftTree(rows_tensor(cols[0], torch.long, device),
                     rows_tensor(cols[1], torch.long, device),
                     rows_tensor(cols[2], torch.long, device), mask,
                     torch.tensor(paths, dtype=torch.long, device=device),
                     torch.tensor(counts, dtype=torch.long, device=device),
                     rows_tensor(cols[3], torch.float32, device),
                     rows_tensor(cols[4], torch.bool, device))


def _keep_best(ranked: list[float], keep: int) -> list[int]:
    """Indices of the `keep` highest of `ranked` (ties: the earlier), back in index order."""
    return sorted(sorted(range(len(ranked)), key=ranked.__getitem__, reverse=True)[:keep])


def host_lists(tensors: list[torch.Tensor]) -> list[list]:
    """Each tensor's `.tolist()`, with one read from a device (those on the CPU: each
    directly). Off the CPU they cross packed as float64, which holds token ids, indices,
    counts and fp32 / bf16 values exactly (ids below 2^53), and each is cast back to its
    dtype on the host, so the lists equal the tensors' own."""
    far = [t for t in tensors if t.device.type != "cpu"]
    if not far:
        return [t.tolist() for t in tensors]
    packed = torch.cat([t.reshape(-1).to(torch.float64) for t in far]).cpu()  # one read
    out, at = [], 0
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t.tolist())
            continue
        out.append(packed[at: at + t.numel()].view(t.shape).to(t.dtype).tolist())
        at += t.numel()
    return out


def build_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parents: torch.Tensor,
               cand_scores: torch.Tensor, cand_depths: torch.Tensor, num_nodes: int,
               cand_values: torch.Tensor | None = None,
               cand_lookup: torch.Tensor | None = None,
               device: torch.device | str | None = None) -> DraftTree:
    """Rerank candidates globally and flatten (docs/draft-tree.md "Draft tree").

    root: [B]; cand_*: [B, C] in depth order, parents index the candidate list (-1 = root),
    depths start at 1, scores -inf for entries that are not candidates. Keeps the best
    min(candidates, num_nodes - 1) of each row (rows with fewer candidates are padded).
    cand_values: the tree's values (default exp(scores)); cand_lookup: the tree's lookup flags.
    device: where the tree goes (default: root's); the candidates cross to the host once
    (`host_lists`), where the rerank runs.
    E.g. scores [-.1, -.5, -.2, -.9] (first two depth 1), keep 2 -> candidates 0 and 2.
    """
    num_b, num_c = cand_tokens.shape
    keep = min(num_c, num_nodes - 1)
    if cand_values is None:
        cand_values = cand_scores.float().exp()
    if cand_lookup is None:
        cand_lookup = torch.zeros_like(cand_tokens, dtype=torch.bool)
    roots, *cols = host_lists([root, cand_tokens, cand_parents, cand_scores, cand_depths,
                               cand_values.float(), cand_lookup])
    rows = []
    for b in range(num_b):
        tok, par, score, dep, val, look = (c[b] for c in cols)
        chosen = [i for i in _keep_best(score, keep) if score[i] > float("-inf")]
        node_of = {c: j + 1 for j, c in enumerate(chosen)}
        parents = [-1]
        for c in chosen:
            assert par[c] < 0 or par[c] in node_of, "reranked tree is disconnected"
            parents.append(node_of[par[c]] if par[c] >= 0 else 0)
        rows.append(([roots[b], *(tok[c] for c in chosen)], parents,
                     [0, *(dep[c] for c in chosen)], [1.0, *(val[c] for c in chosen)],
                     [False, *(look[c] for c in chosen)]))
    return tree_from_rows(rows, root.device if device is None else device)


def finish_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                num_nodes: torch.Tensor | None = None, values: torch.Tensor | None = None,
                lookup: torch.Tensor | None = None) -> DraftTree:
    """Derive the mask and retrieve paths from tokens/parents/depths [B, N] (depth order).

    values [B, N] default to 1 for every valid node (unknown: nothing to choose by); lookup
    [B, N] to False (head nodes)."""
    num_b, num_n = tokens.shape
    dev = tokens.device
    if num_nodes is None:
        num_nodes = torch.full((num_b,), num_n, dtype=torch.long, device=dev)
    if values is None:
        values = (torch.arange(num_n, device=dev)[None, :] < num_nodes[:, None]).float()
    if lookup is None:
        lookup = torch.zeros_like(tokens, dtype=torch.bool)
    mask, paths = _mask_and_paths(parents.tolist(), num_nodes.tolist(), dev)
    return DraftTree(tokens, parents, depths, mask,
                     torch.tensor(paths, dtype=torch.long, device=dev), num_nodes, values,
                     lookup)


def prune_tree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """Keep each tree's root and its best keep[b] - 1 other nodes by value: [B] -> N' = max keep.

    A child's value never exceeds its parent's and parents come first in node order, so a
    stable descending sort ranks every parent before its children: the kept set is connected.
    E.g. values [1, .9, .2, .6] (node 3 a child of node 1), keep 3 -> nodes 0, 1, 3.
    """
    counts = tree.num_nodes.tolist()
    keep = [min(k, n) for k, n in zip(keep.tolist(), counts, strict=True)]
    cols = [x.tolist() for x in (tree.tokens, tree.parents, tree.depths, tree.values,
                                 tree.lookup)]
    rows = []
    for b, n in enumerate(counts):
        tok, par, dep, val, look = (c[b] for c in cols)
        chosen = _keep_best([2.0, *val[1:n]], keep[b])  # the root always stays first
        node_of = {c: j for j, c in enumerate(chosen)}
        parents = [-1]
        for c in chosen[1:]:
            assert par[c] in node_of, "pruned tree is disconnected"
            parents.append(node_of[par[c]])
        rows.append(([tok[c] for c in chosen], parents, [dep[c] for c in chosen],
                     [val[c] for c in chosen], [look[c] for c in chosen]))
    return tree_from_rows(rows, tree.tokens.device)


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
