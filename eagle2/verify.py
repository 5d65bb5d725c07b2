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

The sampling walk runs on the logits' device for all sampled requests at once
(`verify_sampling`), level by level: at each level every request's current node gets its
processed p (one [S, V] batch), each of its children c (token x) its probability of acceptance
when tried, p(x) / (1 - p's mass at the distinct tokens of c's earlier siblings) (exactly the
sequential zeroing; a child repeating an earlier sibling's token: 0, p(x) is already zeroed),
and its own uniform u_c: the walk moves to the first child with u_c under it, or ends there and
one more uniform draws the residual (p less all of the node's children) or, at a leaf, the
bonus (p). The uniforms come from each request's own generator on the host (token-sized), so a
seed gives the same sample on any device. On the CPU the walk computes only the requests still
walking, the rows the sequential walk computed; elsewhere every request at every level (fixed
shapes, no read until the end). Only token-sized results leave the device, in one read a step
(`verify_batch`, `first_tokens`); probabilities are fp64 on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from eagle2.config import SamplingParams
from eagle2.tree import DraftTree


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's own log-probabilities at one output position (the log-softmax of its
    logits there, before temperature, top-k and top-p): the output token's, and the most
    likely tokens' (id, log-probability), most likely first. Under speculation the position's
    logits are those of the accepted node before it, the row plain decoding computes."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Verified:
    """Per request: nodes to commit (root first) and the tokens that become output."""

    nodes: list[list[int]]  # [B][a + 1] tree-node indices to keep, root first
    tokens: list[list[int]]  # [B][a + 1] accepted draft tokens + the bonus/residual token
    # [B] each token's TokenLogprobs where the request asked (SamplingParams.logprobs), else
    # None; None: no request asked
    logprobs: list[list[TokenLogprobs] | None] | None = None


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters of [R, V] logits, as host lists (which filters run, and
    whether to divide at all, is decided without reading the device). Every row samples
    (temperature > 0)."""

    temperature: list[float]  # [R]
    top_k: list[int]  # [R] 0: off
    top_p: list[float]  # [R] 1.0: off
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(params: list[SamplingParams], repeat: int = 1) -> RowParams:
        """Rows of requests' params, each repeated `repeat` times (e.g. a request's N nodes)."""
        rows = [p for p in params for _ in range(repeat)]
        return RowParams([p.temperature for p in rows], [p.top_k for p in rows],
                         [p.top_p for p in rows])

    def select(self, rows: list[int] | None) -> RowParams:
        """Some of the rows; None: all (this one, with what it has on the device)."""
        if rows is None:
            return self
        return RowParams([self.temperature[r] for r in rows], [self.top_k[r] for r in rows],
                         [self.top_p[r] for r in rows])

    def on(self, device: torch.device, name: str, values: list, dtype: torch.dtype
           ) -> torch.Tensor:
        """values [R'] (derived from the params, named) on the device, copied once: the
        levels of an eager walk share them."""
        key = (name, device)
        if key not in self._on_device:
            # host: made here, copied to the device by _h2d
            self._on_device[key] = _h2d(torch.tensor(values, dtype=dtype), device)
        return self._on_device[key]


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the processed distribution p (fp64), temperature > 0."""
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    return processed_rows(rows, RowParams.of([params], rows.shape[0])).reshape(logits.shape)


def processed_logits(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """logits [R, V] -> fp64 [R, V]: divided by each row's temperature, then -inf outside each
    row's top-k, then outside its top-p (HF order). Their softmax is p, the processed
    distribution (`processed_rows`). Top-k keeps ties with the k-th value; top-p drops a
    token when the mass strictly before it (in descending order) already reaches top_p, so
    it keeps >= 1."""
    dev = logits.device
    x = logits.to(torch.float64)  # [R, V]
    if x is logits:  # fp64 logits: not in place
        x = x.clone()
    if any(t != 1.0 for t in rp.temperature):
        x.div_(rp.on(dev, "temperature", rp.temperature, torch.float64)[:, None])
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in rp.top_k]
    if any(ks):
        k = rp.on(dev, "top_k", ks, torch.long)  # [R]
        top = x.topk(max(ks), dim=-1).values  # [R, kmax] descending
        kth = top.gather(-1, (k - 1).clamp_min(0)[:, None])  # [R, 1] each row's k-th value
        kth = kth.masked_fill(k[:, None] == 0, float("-inf"))
        x.masked_fill_(x < kth, float("-inf"))
    rows = [r for r, p in enumerate(rp.top_p) if p < 1.0]
    if rows:
        idx = None if len(rows) == x.shape[0] else rp.on(dev, "top_p_rows", rows, torch.long)
        sub = x if idx is None else x.index_select(0, idx)  # [R', V]
        top_p = rp.on(dev, "top_p", [rp.top_p[r] for r in rows], torch.float64)  # [R']
        sorted_x, order = sub.sort(dim=-1, descending=True)  # [R', V]
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]  # [R', V] in sorted order
        drop = drop.scatter(-1, order, drop)  # [R', V] in token order
        if idx is None:
            x.masked_fill_(drop, float("-inf"))
        else:
            x.index_copy_(0, idx, sub.masked_fill(drop, float("-inf")))
    return x


def processed_rows(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """logits [R, V] -> p [R, V] fp64, each row processed with its own params."""
    return processed_logits(logits, rp).softmax(-1)


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


def draw_rows(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of the unnormalised distributions p [R, V] (fp64, >= 0, some positive
    a row) at the uniforms u [R] (fp64, [0, 1)): the inverse of each row's cumulative sum, on
    p's device. -> [R] long. A token of zero probability is never drawn: the first index whose
    cumulative sum passes u x total has p > 0; where u x total rounds up to the total, the
    last token of positive p. (`torch.multinomial` drew V exponentials for one sample.)"""
    cdf = p.cumsum(-1)  # [R, V]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    i = torch.searchsorted(cdf, u[:, None] * total, right=True)  # [R, 1]
    last = torch.searchsorted(cdf, total)  # [R, 1] the last token of positive p
    return torch.where(i >= cdf.shape[-1], last, i)[:, 0]


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the unnormalised distribution p [V] (fp64, >= 0, some positive) at one
    uniform of `generator` (`draw_rows`)."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return int(draw_rows(p[None], u.reshape(1).to(p.device))[0])


def uniforms(generator: torch.Generator | None, n: int) -> torch.Tensor:
    """The n uniforms [n] (fp64, host) of one request's sampled step: u[0] draws the residual
    or bonus token, u[c] tries node c. The request's generator gives one 32-bit seed a step
    and the uniforms follow from it, so the generator advances the same whatever the padding
    n (a batch's widest tree) and node c's uniform does not depend on n either."""
    seed = int(torch.randint(0, 2**32, (), generator=generator))
    step = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=step, dtype=torch.float64)


def repeated_tokens(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor
                    ) -> torch.Tensor:
    """[S, N] bool: the node repeats the token of an earlier sibling (drafters make none, but a
    repeat must be rejected: the sequential walk zeroed p there when it rejected the first).
    tokens, parents, valid [S, N]."""
    idx = torch.arange(tokens.shape[1], device=tokens.device)
    child = valid & (parents >= 0)  # [S, N]
    earlier = (child[:, :, None] & child[:, None, :] & (parents[:, :, None] == parents[:, None, :])
               & (idx[None, :] < idx[:, None]))  # [S, N, N] [s, c, j]: j an earlier sibling of c
    return (earlier & (tokens[:, :, None] == tokens[:, None, :])).any(-1)


def try_children(p: torch.Tensor, kids: torch.Tensor, tokens: torch.Tensor,
                 repeat: torch.Tensor) -> torch.Tensor:
    """The probability that each child of a node is accepted when tried (the node accepted, its
    earlier siblings rejected): p(x) / (1 - p's mass at the distinct tokens of its earlier
    siblings), 0 for a repeated token and off the children. p [R, V] the processed p at R
    nodes (fp64, each row summing to 1); kids [R, N] bool the nodes' children (draft order =
    node order); tokens, repeat [R, N] -> [R, N] fp64.

    Where the earlier siblings hold almost all of p, 1 - their mass is exact to ~1e-16 absolute
    only, not relative; the probability of being tried is that same remainder, so a child's
    chance of being tried and accepted stays exact to ~1e-16."""
    fresh = torch.where(kids & ~repeat, p.gather(-1, tokens), 0.0)  # [R, N] mass each removes
    left = 1.0 - (fresh.cumsum(-1) - fresh)  # [R, N] mass left when each is tried
    return (fresh / left.clamp_min(torch.finfo(p.dtype).tiny)).clamp_max(1.0)


def verify_sampling(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    num_nodes: torch.Tensor, depth: int, rp: RowParams, u: torch.Tensor,
                    lazy: bool | None = None, bonus_from_raw: bool = False,
                    batch_rows: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled requests' trees, on the logits' device: logits [S, N, V] (or [B, N, V] with
    batch_rows [S], the requests' rows in it: no copy of theirs); tokens, parents [S, N]
    (depth order); num_nodes [S]; depth: the deepest node's depth (or more); rp: S rows; u
    [S, N] fp64 uniforms on the device (`uniforms`: u[:, c] tries node c, u[:, 0] draws the
    last token). -> (path [S, N] bool: the accepted nodes, root included; token [S] long: the
    residual or bonus token after the path's last node), token-sized, on the device.

    lazy (default: on the CPU, where reading the device costs nothing): after each level read
    which walks go on and compute only theirs; else every walk at every level (a walk that
    ended stays at its node, which gives the same p and the same rejections again).
    `bonus_from_raw` reproduces the reference's old bug (the bonus at an accepted non-root leaf
    drawn from the unprocessed softmax); it exists only so a test can prove the distribution
    test catches it."""
    num_s, num_n = tokens.shape
    vocab = logits.shape[-1]
    dev = logits.device
    lazy = (dev.type == "cpu" if lazy is None else lazy) and depth > 0  # one level: no choice
    flat = logits.reshape(-1, vocab)  # [B N, V] row b * N + n: node n of batch row b
    base = (torch.arange(num_s, device=dev) if batch_rows is None else batch_rows) * num_n
    idx = torch.arange(num_n, device=dev)
    valid = idx[None, :] < num_nodes[:, None]  # [S, N]
    child = valid & (parents >= 0)  # [S, N]
    repeat = repeated_tokens(tokens, parents, valid)  # [S, N]
    cur = torch.zeros(num_s, dtype=torch.long, device=dev)  # [S] each walk's current node
    path = (idx == 0)[None, :].expand(num_s, num_n)  # [S, N]
    end_p = None  # [S, V] p where each walk ended
    going = list(range(num_s))  # the walks to compute at this level (lazy: those going on)
    for _ in range(depth + 1):
        rows = None if len(going) == num_s else going
        index = None if rows is None else torch.tensor(rows, device=dev)
        at = _take(cur, index)  # [R]
        p = processed_rows(flat.index_select(0, _take(base, index) + at),
                           rp.select(rows))  # [R, V] p at each walk's node
        kids = _take(child, index) & (_take(parents, index) == at[:, None])  # [R, N]
        accept = try_children(p, kids, _take(tokens, index), _take(repeat, index))  # [R, N]
        tried = kids & (_take(u, index) < accept)  # [R, N]
        goes = tried.any(-1)  # [R] a child accepted: the walk goes on to the first
        nxt = torch.where(goes, tried.to(torch.uint8).argmax(-1), at)  # [R]
        moved = _take(path, index) | ((idx[None, :] == nxt[:, None]) & goes[:, None])
        cur, path = _put(cur, index, nxt), _put(path, index, moved)
        if not lazy:
            end_p = p  # a walk that ended recomputes its last node's p: the last level's is it
            continue
        flags = goes.tolist()  # lazy: the host is the device
        ended = [r for r, f in zip(going, flags, strict=True) if not f]
        if len(ended) == num_s:  # every walk ended at the first level
            end_p = p
        elif ended:
            if end_p is None:
                end_p = p.new_empty(num_s, vocab)  # every row written once its walk ends
            local = torch.tensor([i for i, f in enumerate(flags) if not f], device=dev)
            end_p.index_copy_(0, torch.tensor(ended, device=dev), p.index_select(0, local))
        going = [r for r, f in zip(going, flags, strict=True) if f]
        if not going:
            break
    assert end_p is not None and (not lazy or not going), "a walk went deeper than `depth`"
    kids = child & (parents == cur[:, None])  # [S, N] all rejected where the walk ended
    # p less the kids' tokens (amin: a token both a kid's and another node's still goes)
    keep = torch.where(kids, 0.0, end_p.gather(1, tokens))  # [S, N]
    residual = end_p.scatter_reduce(1, tokens, keep, "amin")  # [S, V]
    # rounding only: the rejected children held all of p (exactly, no walk ends there)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, end_p)
    if bonus_from_raw:  # the bug: the bonus from the raw softmax
        raw = flat.index_select(0, base + cur).to(torch.float64).softmax(-1)  # [S, V]
        bug = (~kids.any(-1) & (cur > 0))[:, None]  # [S, 1] accepted non-root leaves
        residual = torch.where(bug, raw, residual)
    return path, draw_rows(residual, u[:, 0])


def children_lists(parents: list[int], num_nodes: int) -> list[list[int]]:
    """Children of every node in node order (= draft order within a parent)."""
    kids: list[list[int]] = [[] for _ in range(num_nodes)]
    for i in range(1, num_nodes):
        kids[parents[i]].append(i)
    return kids


def verify_batch(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], lazy: bool | None = None,
                 bonus_from_raw: bool = False) -> Verified:
    """Every request of a batch: greedy rows by their argmax and `_longest_paths`, sampled rows
    by `verify_sampling` with their own generator's uniforms, all on the logits' device; the
    token-sized results come to the host in one read. logits [B, N, V]; params, generators
    [B]. lazy, `bonus_from_raw`: see `verify_sampling`."""
    dev = logits.device
    num_b, num_n = tree.tokens.shape
    greedy = [b for b, p in enumerate(params) if p.greedy]
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    tokens = tree.tokens.to(dev)  # [B, N]
    parts = [tokens.reshape(-1)]
    paths_shape = tree.retrieve_indices.shape[1:]
    if greedy:
        rows = _rows(greedy, num_b, dev)
        parts.append(_take(tree.retrieve_indices.to(dev), rows).reshape(-1))  # [G, P, D]
        parts.append(_take(logits, rows).argmax(-1).reshape(-1))  # [G, N]
    if sampled:
        rows = _rows(sampled, num_b, dev)
        u = _h2d(torch.stack([uniforms(generators[b], num_n) for b in sampled]), dev)  # [S, N]
        path, token = verify_sampling(
            logits, _take(tokens, rows), _take(tree.parents.to(dev), rows),
            _take(tree.num_nodes.to(dev), rows), tree.retrieve_indices.shape[-1] - 1,
            RowParams.of([params[b] for b in sampled]), u, lazy, bonus_from_raw, rows)
        parts += [path.to(torch.long).reshape(-1), token]
    flat = torch.cat(parts).tolist()  # the one read from the device: token-sized
    toks = _split(flat, num_b * num_n, num_n)
    nodes: list[list[int]] = [[] for _ in range(num_b)]
    out: list[list[int]] = [[] for _ in range(num_b)]
    if greedy:
        width = paths_shape[0] * paths_shape[1]
        paths = [_split(row, width, paths_shape[1])
                 for row in _split(flat, len(greedy) * width, width)]
        preds = _split(flat, len(greedy) * num_n, num_n)
        found = _longest_paths(paths, [toks[b] for b in greedy], preds)
        for i, b in enumerate(greedy):
            nodes[b], out[b] = found.nodes[i], found.tokens[i]
    if sampled:
        on_path = _split(flat, len(sampled) * num_n, num_n)
        drawn = _split(flat, len(sampled), 1)
        for i, b in enumerate(sampled):
            nodes[b] = [n for n, on in enumerate(on_path[i]) if on]
            out[b] = [toks[b][n] for n in nodes[b][1:]] + drawn[i]
    assert not flat, "verify_batch read more than it used"
    return Verified(nodes, out)


def logprobs_at(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """TokenLogprobs of rows logits [R, V] (fp32 or wider) whose output tokens are `tokens`,
    with the `top` most likely of each; one read."""
    if not tokens:
        return []
    dev = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    rows = torch.arange(len(tokens), device=dev)
    chosen = lp[rows, torch.tensor(tokens, device=dev)]  # [R]
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    flat = torch.cat([chosen.double(), values.double().reshape(-1),
                      ids.double().reshape(-1)]).tolist()  # ids < 2^53: exact in fp64
    num = len(tokens)
    vals, idx = flat[num:num + num * top], flat[num + num * top:]
    return [TokenLogprobs(flat[r], tuple((int(idx[r * top + i]), vals[r * top + i])
                                         for i in range(top)))
            for r in range(num)]


def with_logprobs(verified: Verified, logits: torch.Tensor,
                  params: list[SamplingParams]) -> Verified:
    """`verified` with each asking request's TokenLogprobs: output token j of request b
    comes from the logits at its accepted node j - 1 (the root first), the row plain
    decoding computes at that position. logits [B, N, V]."""
    dev = logits.device
    out = _asked_logprobs(params, lambda b: logits[b, torch.tensor(verified.nodes[b],
                                                                   device=dev)],
                          lambda b: verified.tokens[b])
    return verified if out is None else Verified(verified.nodes, verified.tokens, out)


def first_logprobs(logits: torch.Tensor, first: list[int], params: list[SamplingParams]
                   ) -> list[TokenLogprobs | None] | None:
    """Each asking request's TokenLogprobs of its first token (logits [B, V] at its prompt's
    last position); None where none asks."""
    out = _asked_logprobs(params, lambda b: logits[b:b + 1], lambda b: [first[b]])
    return None if out is None else [None if e is None else e[0] for e in out]


def _asked_logprobs(params: list[SamplingParams], rows_of: Callable[[int], torch.Tensor],
                    tokens_of: Callable[[int], list[int]]
                    ) -> list[list[TokenLogprobs] | None] | None:
    """[B] the TokenLogprobs of tokens_of(b) from its logits rows_of(b) [n, V] for each
    request b that asks (SamplingParams.logprobs), cut to its own k, else None; one read for
    all of them. None: no request asks."""
    asking = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return None
    tokens = [tokens_of(b) for b in asking]
    found = iter(logprobs_at(torch.cat([rows_of(b) for b in asking]),
                             [t for ts in tokens for t in ts],
                             max(params[b].logprobs for b in asking)))
    out: list[list[TokenLogprobs] | None] = [None] * len(params)
    for b, ts in zip(asking, tokens, strict=True):
        k = params[b].logprobs
        out[b] = [TokenLogprobs(e.logprob, e.top[:k]) for e in (next(found) for _ in ts)]
    return out


def first_tokens(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """The token after each prompt: argmax, or a sample of the processed p (`verify_sampling`
    on one-node trees), on the logits' device; one read. logits [B, V]."""
    dev = logits.device
    num_b = logits.shape[0]
    greedy = [b for b, p in enumerate(params) if p.greedy]
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    parts = []
    if greedy:
        parts.append(_take(logits, _rows(greedy, num_b, dev)).argmax(-1))  # [G]
    if sampled:
        rows = _rows(sampled, num_b, dev)
        num_s = len(sampled)
        u = _h2d(torch.stack([uniforms(generators[b], 1) for b in sampled]), dev)  # [S, 1]
        one = torch.ones(num_s, dtype=torch.long, device=dev)
        _, token = verify_sampling(
            logits[:, None], torch.zeros(num_s, 1, dtype=torch.long, device=dev),
            torch.full((num_s, 1), -1, device=dev), one, 0,
            RowParams.of([params[b] for b in sampled]), u, batch_rows=rows)
        parts.append(token)
    flat = torch.cat(parts).tolist()  # the one read: B tokens
    out = [0] * num_b
    for b, t in zip(greedy + sampled, flat, strict=True):
        out[b] = t
    return out


def _rows(rows: list[int], num_b: int, dev: torch.device) -> torch.Tensor | None:
    """An index of some batch rows on the device; None: all of them in order (no copy)."""
    # host: made here, copied to the device by _h2d
    return None if rows == list(range(num_b)) else _h2d(torch.tensor(rows), dev)


def _h2d(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small host tensor on the device without waiting for the device (a plain copy to a
    GPU first waits for everything queued there, the target's forward included): on CUDA
    through pinned memory, asynchronously."""
    if dev.type == "cuda" and torch.cuda.is_available():
        return x.pin_memory().to(dev, non_blocking=True)
    return x.to(dev)


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put(x: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """x with its rows replaced by values (all of it where rows is None)."""
    return values if rows is None else x.index_copy(0, rows, values)


def _split(flat: list[int], count: int, width: int) -> list[list[int]]:
    """Take the first `count` items off `flat` (in place) as rows of `width`."""
    head = flat[:count]
    del flat[:count]
    return [head[i:i + width] for i in range(0, count, width)]
