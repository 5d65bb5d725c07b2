"""Lossless verification of a draft tree (docs/draft-tree.md "Verification").

Terms: p is the target's processed distribution at a node (temperature, then top-k, then
top-p, the order of HF `generate`); the draft tokens are deterministic top-k picks, i.e.
one-hot proposals q tried without replacement. A draft token is *accepted* when it becomes
output; the *bonus* token is the target's own pick after the last accepted node; when every
child of a node is rejected the next token is drawn from the *residual* (p with the rejected
children removed, renormalised).

Greedy: accept a node while its token equals the target's argmax at its parent; take the
longest root-to-leaf path; the bonus is the argmax after it.

Sampling (multi-draft recursive rejection sampling with one-hot proposals): at an accepted
node, try its children in draft order; accept child x with probability p(x) / sum(p); on
rejection set p(x) = 0; if all are rejected draw from the residual; if the path ends in an
accepted leaf, draw the bonus from the processed p there. The result is an exact sample of
the target's processed distribution (SpecInfer / EAGLE-2 Appendix; vLLM "recovered tokens").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch

from eagle2.config import SamplingParams
from eagle2.tree import DraftTree


@dataclass(frozen=True)
class Verified:
    """Per request: nodes to commit (root first) and the tokens that become output."""

    nodes: list[list[int]]  # [B][a + 1] tree-node indices to keep, root first
    tokens: list[list[int]]  # [B][a + 1] accepted draft tokens + the bonus/residual token


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the processed distribution p (fp64), temperature > 0."""
    x = logits.double() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verified:
    """Longest path whose tokens equal the target's argmax at their parents. logits [B, N, V]."""
    return verify_greedy_tokens(tree, logits.argmax(-1))


def verify_greedy_tokens(tree: DraftTree, pred: torch.Tensor) -> Verified:
    """`verify_greedy` given the target's argmax at every node, pred [B, N]."""
    return _longest_paths(tree.retrieve_indices.tolist(), tree.tokens.tolist(), pred.tolist())


def _longest_paths(paths: list[list[list[int]]], tokens: list[list[int]],
                   pred: list[list[int]]) -> Verified:
    """Per request, the first of its root-to-leaf paths (retrieve_indices, -1 padded) that
    accepts the most nodes (a node is accepted while its token is pred at its parent; pred
    -1: not computed, so never equal), and its tokens and bonus. In Python on the lists: as
    ~12 tensor operations (gather, cumprod, argmax) it had cost ~0.15 ms a step at batch 1,
    more than a walk over a few paths."""
    nodes, out = [], []
    for rows, toks, preds in zip(paths, tokens, pred, strict=True):
        best, best_path = -1, rows[0]
        for path in rows:
            accepted = 0
            for parent, node in pairwise(path):
                if node < 0 or toks[node] != preds[parent]:
                    break
                accepted += 1
            if accepted > best:
                best, best_path = accepted, path
        path = best_path[: best + 1]
        nodes.append(path)
        out.append([toks[n] for n in path[1:]] + [preds[path[-1]]])
    return Verified(nodes, out)


def verify_greedy_lazily(tree: DraftTree, argmax: Callable[[list[int], list[int]], torch.Tensor],
                         first_rows: int = 0) -> Verified:
    """`verify_greedy_tokens` with the target's argmax computed only where acceptance reaches:
    first at every root and its children, then, level by level, at the accepted nodes not
    yet computed (a node is accepted when its parent is and its token is the parent's
    argmax). argmax(batch rows, node indices) -> their tokens. Nodes off the accepted subtree
    get -1, which no path reads (acceptance along a path stops at them), so the result is
    `verify_greedy_tokens`'s with every argmax computed. For `GreedyArgmax`, whose cost grows
    with the rows for more than two of them: a 4-node chain whose first token is rejected
    needs the argmax at 2 nodes, not 4. A round of one node also takes its first child, in
    case it is accepted (a second row costs GreedyArgmax ~5% of the first, a round ~1.4 ms on
    the AVX2 EPYC): a 6-node chain accepted whole takes 3 rounds, not 5.

    first_rows: the first round also takes the other nodes most likely accepted (`tree.values`,
    highest first: a node below is never worth more than its parent, so they hang together)
    until it has that many rows, where rows are cheap up to a count (the AMX tiles' int8 pass
    costs about the same for 9-16 rows as 8) and each later round reads the whole int8 lm_head
    again (~1.4 ms): a 15-token lookup chain accepted whole takes 1 round, not 8."""
    num_b, num_n = tree.tokens.shape
    pred = torch.full((num_b, num_n), -1, dtype=torch.long)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    counts = tree.num_nodes.tolist()
    kids = [children_lists(parents[b], counts[b]) for b in range(num_b)]
    todo = [(b, n) for b in range(num_b) for n in [0, *kids[b][0]]]
    if first_rows > len(todo):
        values = tree.values.tolist()
        taken = set(todo)
        more = sorted(((values[b][n], -b, -n) for b in range(num_b) for n in range(counts[b])
                       if (b, n) not in taken), reverse=True)  # (ties: the earlier node)
        todo += [(-b, -n) for _, b, n in more[:first_rows - len(todo)]]
    accepted = [(b, 0) for b in range(num_b)]  # accepted nodes whose argmax is not yet known
    while todo:
        rows, nodes = [b for b, _ in todo], [n for _, n in todo]
        pred[rows, nodes] = argmax(rows, nodes).to(torch.long).cpu()
        known = pred.tolist()
        waiting = []
        while accepted:  # follow accepted nodes down to those whose argmax is unknown
            b, n = accepted.pop()
            if known[b][n] < 0:
                waiting.append((b, n))
                continue
            accepted += [(b, c) for c in kids[b][n] if tokens[b][c] == known[b][n]]
        todo, accepted = waiting, list(waiting)
        if len(waiting) == 1:  # a lone node: its first child too, a row almost for free
            b, n = waiting[0]
            todo = waiting + [(b, c) for c in kids[b][n][:1]]
    return _longest_paths(tree.retrieve_indices.tolist(), tokens, known)


def verify_sampling(tree_tokens: list[int], children: list[list[int]], logits: torch.Tensor,
                    params: SamplingParams, generator: torch.Generator,
                    bonus_from_raw: bool = False) -> tuple[list[int], list[int]]:
    """One request: walk the tree from the root. logits [N, V] (any device).

    Returns (nodes kept, output tokens). `bonus_from_raw` reproduces the reference's old bug
    (bonus drawn from the unprocessed softmax); it exists only so a test can prove the
    distribution test catches it.
    """
    node, nodes, out = 0, [0], []
    while True:
        p = processed_probs(logits[node].cpu(), params)
        kids = children[node]
        for child in kids:
            x = tree_tokens[child]
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if u < p[x] / p.sum():
                nodes.append(child)
                out.append(x)
                node = child
                break
            p[x] = 0.0
        else:
            if bonus_from_raw and not kids:  # the bug: bonus from the raw softmax
                p = torch.softmax(logits[node].cpu().double(), -1)
            out.append(draw(p, generator))
            return nodes, out


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the unnormalised distribution p [V] (fp64, >= 0, some positive): the
    inverse of its cumulative sum at one uniform draw. (`torch.multinomial` drew V
    exponentials for one sample: 1.3 ms a token for SmolLM2's 49,152 here, ~6% of a sampled
    decoding step, plain or speculative; this draws one number.) A token of zero probability
    is never drawn: the first index whose cumulative sum passes u x total has p > 0."""
    cdf = p.cumsum(0)
    total = cdf[-1]
    i = int(torch.searchsorted(cdf, torch.rand((), generator=generator, dtype=torch.float64)
                               * total, right=True))
    if i >= len(cdf):  # u x total rounded up to the total: the last token of positive p
        i = int(torch.searchsorted(cdf, total))
    return i


def children_lists(parents: list[int], num_nodes: int) -> list[list[int]]:
    """Children of every node in node order (= draft order within a parent)."""
    kids: list[list[int]] = [[] for _ in range(num_nodes)]
    for i in range(1, num_nodes):
        kids[parents[i]].append(i)
    return kids


def verify_batch(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> Verified:
    """Every request of a batch: greedy rows by `verify_greedy`, sampled rows by
    `verify_sampling` with their own generator. logits [B, N, V]; params, generators [B]."""
    greedy = verify_greedy(tree, logits) if any(p.greedy for p in params) else None
    parents = tree.parents.tolist()
    tree_tokens = tree.tokens.tolist()
    nodes, tokens = [], []
    for b, p in enumerate(params):
        if p.greedy:
            nodes.append(greedy.nodes[b])
            tokens.append(greedy.tokens[b])
            continue
        kids = children_lists(parents[b], int(tree.num_nodes[b]))
        kept, toks = verify_sampling(tree_tokens[b], kids, logits[b], p, generators[b])
        nodes.append(kept)
        tokens.append(toks)
    return Verified(nodes, tokens)


def first_tokens(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """The token after each prompt: argmax, or a sample of the processed p. logits [B, V]."""
    out = []
    for b, p in enumerate(params):
        if p.greedy:
            out.append(int(logits[b].argmax()))
        else:
            out.append(verify_sampling([0], [[]], logits[b][None], p, generators[b])[1][0])
    return out
