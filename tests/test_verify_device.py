"""Sampling and rejection on the logits' device, all requests' walks at once, level by level
(`verify.verify_sampling`, `verify_batch`, `first_tokens`), against the sequential per-node
walk they replaced, kept here as the slow reference (`ref_*`: the old code, whose uniforms are
handed in: node c's test reads u[c], the last draw u[0], where it drew them from the
generator in walk order). Lazy (the CPU's: only the walks still going) and eager (every walk
at every level, no read until the end) must agree with it alike.

Hand-made trees with exact expected acceptance probabilities and outputs (duplicate sibling
tokens, top-k and top-p rows, a batch mixing greedy and sampled requests); random trees where
the fast path must pick exactly the reference's path and token given the same uniforms; a
histogram test that the outputs follow the target's processed distribution (and catches a bonus
drawn from the raw softmax); and a check that only token-sized reads leave the device (eager:
one a step; lazy: besides it, which walks go on, a level).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from eagle2.config import SamplingParams
from eagle2.tree import DraftTree, tree_from_rows
from eagle2.verify import (
    RowParams,
    children_lists,
    first_tokens,
    processed_probs,
    processed_rows,
    repeated_tokens,
    try_children,
    uniforms,
    verify_batch,
    verify_greedy,
    verify_sampling,
)

# --- the reference: the old sequential verifier, one request, node by node on the host ---------


def ref_processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the processed distribution p (fp64), temperature > 0."""
    x = logits.double() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)


def ref_draw(p: torch.Tensor, u: float) -> int:
    cdf = p.cumsum(0)
    total = cdf[-1]
    i = int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64) * total, right=True))
    if i >= len(cdf):
        i = int(torch.searchsorted(cdf, total))
    return i


def ref_verify_sampling(tree_tokens: list[int], children: list[list[int]], logits: torch.Tensor,
                        params: SamplingParams, u: list[float]) -> tuple[list[int], list[int]]:
    node, nodes, out = 0, [0], []
    while True:
        p = ref_processed_probs(logits[node].cpu(), params)
        kids = children[node]
        for child in kids:
            x = tree_tokens[child]
            if u[child] < p[x] / p.sum():
                nodes.append(child)
                out.append(x)
                node = child
                break
            p[x] = 0.0
        else:
            out.append(ref_draw(p, u[0]))
            return nodes, out


def ref_acceptance(tree_tokens: list[int], children: list[list[int]], logits: torch.Tensor,
                   params: SamplingParams) -> tuple[list[float], list[float]]:
    """Per node, the probability that the sequential walk accepts it when it tries it, and the
    mass of p left when it does (the probability that it is tried, its parent accepted)."""
    acc, left = [0.0] * len(tree_tokens), [0.0] * len(tree_tokens)
    for node, kids in enumerate(children):
        p = ref_processed_probs(logits[node], params)
        for child in kids:
            x = tree_tokens[child]
            acc[child], left[child] = float(p[x] / p.sum()), float(p.sum())
            p[x] = 0.0
    return acc, left


# --- trees ----------------------------------------------------------------------------------


def make_tree(rows: list[tuple[list[int], list[int]]]) -> DraftTree:
    """Rows of (tokens, parents), root first, depth order -> a padded DraftTree."""
    full = []
    for tokens, parents in rows:
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        full.append((tokens, parents, depths, [1.0] * len(tokens), [False] * len(tokens)))
    return tree_from_rows(full)


def random_tree(g: torch.Generator, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """n nodes level by level, each under a random node of the level above; siblings' tokens
    distinct but now and then one repeating an earlier sibling's (as no drafter makes them,
    but the verifier must not care)."""
    parents, levels = [-1], [[0]]
    while len(parents) < n:
        size = min(n - len(parents), int(torch.randint(1, 5, (), generator=g)))
        above = levels[-1]
        level = sorted(above[int(torch.randint(0, len(above), (), generator=g))]
                       for _ in range(size))
        levels.append(list(range(len(parents), len(parents) + size)))
        parents += level
    tokens = [int(torch.randint(0, vocab, (), generator=g))]
    for i in range(1, n):
        sibs = [tokens[j] for j in range(1, i) if parents[j] == parents[i]]
        if sibs and float(torch.rand((), generator=g)) < 0.15:
            tokens.append(sibs[int(torch.randint(0, len(sibs), (), generator=g))])
            continue
        free = [t for t in range(vocab) if t not in sibs]
        tokens.append(free[int(torch.randint(0, len(free), (), generator=g))])
    return tokens, parents


def run_sampling(tree: DraftTree, logits: torch.Tensor, params: list[SamplingParams],
                 u: torch.Tensor, lazy: bool | None = None, bonus_from_raw: bool = False
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """verify_sampling on every row -> per row (nodes, output tokens)."""
    path, token = verify_sampling(logits, tree.tokens, tree.parents, tree.num_nodes,
                                  tree.retrieve_indices.shape[-1] - 1,
                                  RowParams.of(params), u, lazy, bonus_from_raw)
    toks = tree.tokens.tolist()
    nodes = [[n for n, on in enumerate(row) if on] for row in path.tolist()]
    return nodes, [[toks[b][n] for n in ns[1:]] + [t] for b, (ns, t) in
                   enumerate(zip(nodes, token.tolist(), strict=True))]


def node_acceptance(tree: DraftTree, logits: torch.Tensor,
                    params: list[SamplingParams]) -> torch.Tensor:
    """`try_children` at every node of every row at once -> [S, N]: each node's probability of
    acceptance when tried (0 at the root and padding)."""
    num_s, num_n, vocab = logits.shape
    valid = torch.arange(num_n)[None, :] < tree.num_nodes[:, None]
    child = valid & (tree.parents >= 0)
    at = torch.arange(num_n)[None, :, None]  # [1, N(a), 1]
    kids = child[:, None, :] & (tree.parents[:, None, :] == at)  # [S, N(a), N(c)]
    p = processed_rows(logits.reshape(num_s * num_n, vocab),
                       RowParams.of(params, repeat=num_n))

    def per_row(x):
        return x[:, None, :].expand(num_s, num_n, num_n).reshape(num_s * num_n, num_n)

    accept = try_children(p, kids.reshape(num_s * num_n, num_n), per_row(tree.tokens),
                          per_row(repeated_tokens(tree.tokens, tree.parents, valid)))
    return accept.reshape(num_s, num_n, num_n).sum(1)  # one parent a node


def probs_logits(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax at temperature 1 is each given distribution."""
    return torch.tensor(rows, dtype=torch.float64).log()


T1 = SamplingParams(temperature=1.0)


# --- hand-made trees, exact expected values -------------------------------------------------

# root: children 1 (token 0), 2 (token 1), 3 (token 0 again), 4 (token 3); node 1: child 5 (2)
HAND = ([3, 0, 1, 0, 3, 2], [-1, 0, 0, 0, 0, 1])
HAND_LOGITS = probs_logits([.4, .3, .2, .1], [.1, .2, .3, .4], [.7, .1, .1, .1], [.25] * 4,
                           [.25] * 4, [.25] * 4)


def test_hand_made_acceptance_probabilities():
    """p(x) / (1 - mass of the earlier siblings' distinct tokens); a repeated token 0."""
    tree = make_tree([HAND])
    accept = node_acceptance(tree, HAND_LOGITS[None], [T1])[0]
    expected = torch.tensor([0, .4, .3 / .6, 0, .1 / .3, .3], dtype=torch.float64)
    torch.testing.assert_close(accept, expected, rtol=1e-13, atol=1e-15)
    ref, _ = ref_acceptance(HAND[0], children_lists(HAND[1], 6), HAND_LOGITS, T1)
    torch.testing.assert_close(accept, torch.tensor(ref, dtype=torch.float64), rtol=1e-13,
                               atol=1e-15)


@pytest.mark.parametrize("u, nodes, tokens", [
    # every child of the root rejected (the repeat at u = 0 too): the residual keeps token 2
    ([0.0, .99, .99, 0.0, .99, .0], [0], [2]),
    # 1 accepted (.3 < .4), then 5 (.29 < .3): the bonus at leaf 5, .6 of a uniform p -> 2
    ([.6, .3, .99, .99, .99, .29], [0, 1, 5], [0, 2, 2]),
    # 1 rejected, 2 accepted (.45 < .5): the bonus at leaf 2 (p .7 .1 .1 .1) at u .75 -> 1
    ([.75, .5, .45, 0.0, .2, .0], [0, 2], [1, 1]),
    # 1 accepted, 5 rejected: the residual of node 1 is .1 .2 0 .4; .5 of it -> 3
    ([.5, .1, .0, .0, .0, .9], [0, 1], [0, 3]),
    # 1 and 2 rejected, 4 accepted (.33 < 1/3) although 5 (under 1) would accept: 5 unreached
    ([.6, .41, .55, .0, .33, .0], [0, 4], [3, 2]),
])
def test_hand_made_walks(u, nodes, tokens):
    tree = make_tree([HAND])
    got = run_sampling(tree, HAND_LOGITS[None], [T1], torch.tensor([u], dtype=torch.float64))
    assert got == ([nodes], [tokens])
    assert ref_verify_sampling(HAND[0], children_lists(HAND[1], 6), HAND_LOGITS, T1,
                               u) == (nodes, tokens)


def test_processed_rows_exact_top_k_and_top_p():
    """p = .5 .2 .15 .1 .05: top-k 2 keeps .5 .2; top-p .8 keeps the tokens whose mass before
    them is under .8 (.5 .2 .15); both: top-k first; temperature 2 flattens before both."""
    logits = probs_logits([.05, .5, .2, .15, .1])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=.8),
              SamplingParams(temperature=1.0, top_k=2, top_p=.6),
              SamplingParams(temperature=1.0, top_k=5, top_p=1.0),
              SamplingParams(temperature=2.0, top_k=3)]
    got = processed_rows(logits.expand(5, 5), RowParams.of(params))
    sq = torch.tensor([.05, .5, .2, .15, .1], dtype=torch.float64).sqrt()
    expected = torch.tensor([[0, .5 / .7, .2 / .7, 0, 0], [0, .5 / .85, .2 / .85, .15 / .85, 0],
                             [0, 1, 0, 0, 0], [.05, .5, .2, .15, .1],
                             [0, *(sq[1:4] / sq[1:4].sum()).tolist(), 0]],
                            dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-15)
    for row, p in zip(got, params, strict=True):
        torch.testing.assert_close(row, ref_processed_probs(logits[0], p), rtol=1e-13, atol=0)
        torch.testing.assert_close(processed_probs(logits[0], p), row, rtol=1e-13, atol=0)


def test_filtered_tokens_are_never_accepted_and_the_batch_mixes_greedy_and_sampled():
    """Three requests of different sizes in one padded batch: greedy, top-k 2, top-p .8, p at
    the root .05 .5 .2 .15 .1. Under top-k 2 the root keeps tokens 1 and 2: a child of token
    3 has p 0 (never accepted, and rejecting it removes nothing), its sibling of token 1 is
    accepted with p .5 / .7; under top-p .8 the root keeps 1 2 3 (token 1: .5 / .85) and node
    1 (.9 .025 ...) keeps token 0 alone (accepted for sure). Greedy rows are
    `verify_greedy`'s; each sampled row equals its own unpadded tree verified alone and the
    reference walk at the same uniforms."""
    root = [.05, .5, .2, .15, .1]
    logits = torch.stack([
        probs_logits(root, [.1, .1, .6, .1, .1], root, root),
        probs_logits(root, root, root, root),
        probs_logits(root, [.9, .025, .025, .025, .025], root, root),
    ]).float()  # [3, 4, 5]
    tree = make_tree([([4, 2, 1, 2], [-1, 0, 0, 1]), ([4, 3, 1], [-1, 0, 0]),
                      ([4, 1, 0], [-1, 0, 1])])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=2),
              SamplingParams(temperature=1.0, top_p=.8)]
    accept = node_acceptance(tree.select(torch.tensor([1, 2])), logits[1:], params[1:])
    expected = torch.tensor([[0, 0, .5 / .7, 0], [0, .5 / .85, 1.0, 0]], dtype=torch.float64)
    torch.testing.assert_close(accept, expected, rtol=1e-6, atol=1e-7)  # fp32 logits
    outcomes = {1: set(), 2: set()}
    for seed in range(40):
        gens = [None, torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)]
        got = verify_batch(tree, logits, params, gens)
        # greedy: the root's argmax is 1 (node 2), whose own argmax 1 is the bonus
        assert (got.nodes[0], got.tokens[0]) == ([0, 2], [1, 1])
        greedy = verify_greedy(tree, logits)
        assert (greedy.nodes[0], greedy.tokens[0]) == ([0, 2], [1, 1])
        for b in (1, 2):
            outcomes[b].add((tuple(got.nodes[b]), tuple(got.tokens[b])))
            own = int(tree.num_nodes[b])
            alone = make_tree([(tree.tokens[b, :own].tolist(), tree.parents[b, :own].tolist())])
            single = verify_batch(alone, logits[b:b + 1, :own], [params[b]],
                                  [torch.Generator().manual_seed(seed)])
            assert (single.nodes[0], single.tokens[0]) == (got.nodes[b], got.tokens[b])
            u = uniforms(torch.Generator().manual_seed(seed), own).tolist()
            kids = children_lists(alone.parents[0].tolist(), own)
            assert ref_verify_sampling(alone.tokens[0].tolist(), kids, logits[b, :own],
                                       params[b], u) == (got.nodes[b], got.tokens[b])
    # top-k: node 2 accepted, the bonus at it 1 or 2; else the residual is token 2 alone
    assert outcomes[1] == {((0, 2), (1, 1)), ((0, 2), (1, 2)), ((0,), (2,))}
    # top-p: node 1 accepted, then node 2 surely, the bonus 1 2 or 3; else the residual 2 or 3
    assert outcomes[2] <= {((0, 1, 2), (1, 0, t)) for t in (1, 2, 3)} | {((0,), (2,)),
                                                                          ((0,), (3,))}
    assert ((0,), (2,)) in outcomes[2] and any(len(n) == 3 for n, _ in outcomes[2])


# --- random trees: the same path and token as the reference, given the same uniforms ---------


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_random_trees_match_the_sequential_walk(seed, lazy):
    """Lazy (the walks still going, as on the CPU) and eager (every walk at every level, as
    elsewhere): both pick the reference's path and token."""
    g = torch.Generator().manual_seed(seed)
    vocab, num_b = 40, 6
    shapes = [random_tree(g, int(torch.randint(1, 16, (), generator=g)), vocab)
              for _ in range(num_b)]
    tree = make_tree(shapes)
    num_n = tree.size
    # logits spread out so that a good share of nodes is accepted
    logits = (torch.randn(num_b, num_n, vocab, generator=g) * 3).float()
    for b, (toks, par) in enumerate(shapes):  # make the drafts likely: boost the children
        for c in range(1, len(toks)):
            logits[b, par[c], toks[c]] += float(torch.rand((), generator=g)) * 6
    choices = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
               SamplingParams(temperature=1.3, top_p=0.7),
               SamplingParams(temperature=0.9, top_k=8, top_p=0.9),
               SamplingParams(temperature=1.0, top_k=1)]
    params = [choices[int(torch.randint(0, len(choices), (), generator=g))]
              for _ in range(num_b)]
    accept = node_acceptance(tree, logits, params)
    for trial in range(4):
        u = torch.rand(num_b, num_n, generator=g, dtype=torch.float64)
        nodes, tokens = run_sampling(tree, logits, params, u, lazy)
        for b, (toks, par) in enumerate(shapes):
            kids = children_lists(par, len(toks))
            ref = ref_verify_sampling(toks, kids, logits[b], params[b], u[b].tolist())
            assert (nodes[b], tokens[b]) == ref, (b, trial)
            if trial == 0:
                # nan: unreachable, the earlier siblings held all of p (0 / 0 there; 0 here).
                # The fast path's 1 - (earlier mass) is exact to ~1e-16 absolute, so compare
                # the probability of being tried and accepted, accept x left
                want, left = (torch.tensor(x, dtype=torch.float64) for x in
                              ref_acceptance(toks, kids, logits[b], params[b]))
                torch.testing.assert_close(accept[b, :len(toks)] * left,
                                           want.nan_to_num(0.0) * left, rtol=1e-12, atol=1e-15)
                close = (accept[b, :len(toks)] - want).abs() < 1e-9
                assert (close | want.isnan()).all()


def test_uniforms_do_not_depend_on_the_padding():
    """Node c's uniform and the generator's next state are the same whatever the batch's
    widest tree, so a seeded request samples the same beside any other."""
    a, b = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    assert torch.equal(uniforms(a, 3), uniforms(b, 17)[:3])
    assert torch.equal(a.get_state(), b.get_state())  # one draw a step either way
    assert not torch.equal(uniforms(a, 3), uniforms(a, 3))  # and the next step's differ


# --- the distribution: outputs follow the target's processed p ---------------------------------


def lossless_outcomes(tokens: list[int], parents: list[int], p: torch.Tensor) -> dict:
    """The exact probability of every output (a token tuple) when tokens are drawn one by one
    from the target's processed p (p [N, V]) and the walk moves to the first child of the
    drawn token, stopping at a token that is no child's: what a lossless verifier must give,
    independent of how it rejects."""
    kids = children_lists(parents, len(tokens))
    out: dict = {}

    def walk(node, prefix, prob):
        first: dict = {}
        for c in kids[node]:
            first.setdefault(tokens[c], c)
        for x, px in enumerate(p[node].tolist()):
            if px > 0:
                if x in first:
                    walk(first[x], (*prefix, x), prob * px)
                else:
                    out[(*prefix, x)] = prob * px

    walk(0, (), 1.0)
    return out


def chi_square(counts: dict, probs: dict, n: int) -> float:
    """p-value of the counts against probs (cells under 5 expected pooled); a count outside
    probs' support fails at once."""
    assert set(counts) <= set(probs), set(counts) - set(probs)
    big = [s for s in probs if probs[s] * n >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [probs[s] * n for s in big]
    rest = n - sum(obs)
    if rest or n - sum(exp) > 1e-6:
        obs.append(rest)
        exp.append(n - sum(exp))
    return float(chisquare(obs, exp).pvalue)


# a root with children 0, 1, 0 (a repeat), 3; node 1 (token 0) has children 5 (token 2) and 6
# (token 4); node 7 (token 5) under node 5
DIST_TREE = ([0, 0, 1, 0, 3, 2, 4, 5], [-1, 0, 0, 0, 0, 1, 1, 5])
DIST_PARAMS = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=3),
               SamplingParams(temperature=1.0, top_p=0.8)]


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("bug", [False, True])
def test_outputs_follow_the_processed_distribution(bug, lazy):
    """12,000 draws a parameter set of one 8-node tree over a 6-token vocabulary (one batch
    row each, own uniforms) against the exact lossless probabilities of every output; with
    the bonus drawn from the raw softmax (`bonus_from_raw`) the filtered rows must fail."""
    vocab, reps = 6, 12_000
    g = torch.Generator().manual_seed(7)
    toks, par = DIST_TREE
    num_n = len(toks)
    tree = make_tree([DIST_TREE]).select(torch.zeros(reps, dtype=torch.long))  # reps rows
    pvalues = []
    for k, params in enumerate(DIST_PARAMS):
        logits = torch.randn(num_n, vocab, generator=g) * 1.5  # [N, V]
        for c in range(1, num_n):
            logits[par[c], toks[c]] += 1.0
        u = torch.rand(reps, num_n, generator=g, dtype=torch.float64)
        _, outs = run_sampling(tree, logits.expand(reps, num_n, vocab), [params] * reps, u,
                               lazy, bonus_from_raw=bug)
        counts: dict = {}
        for o in outs:
            counts[tuple(o)] = counts.get(tuple(o), 0) + 1
        probs = lossless_outcomes(toks, par, ref_processed_probs(logits, params))
        assert abs(sum(probs.values()) - 1) < 1e-12
        if bug and k > 0:  # raw-softmax bonuses put tokens outside the filters' support
            with pytest.raises(AssertionError):
                chi_square(counts, probs, reps)
            continue
        pvalues.append(chi_square(counts, probs, reps))
    if not bug:
        assert min(pvalues) > 1e-3, pvalues
    else:
        assert pvalues[0] < 1e-5, pvalues  # temperature 0.8 vs the raw softmax's 1


def test_first_tokens_follow_the_processed_distribution():
    """The token after a prompt: 8,000 one-node draws (a batch of 8,000 requests, each its own
    generator) of a top-k and a top-p row, and a greedy row's argmax among them."""
    vocab, reps = 7, 4000
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, vocab, generator=g) * 2
    params = [SamplingParams(temperature=0.9, top_k=4), SamplingParams(temperature=1.1, top_p=.85)]
    rows = torch.cat([logits[:1].expand(reps, vocab), logits[1:].expand(reps, vocab),
                      logits[:1]])
    ps = [params[0]] * reps + [params[1]] * reps + [SamplingParams()]
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(2 * reps)] + [None]
    out = first_tokens(rows, ps, gens)
    assert out[-1] == int(logits[0].argmax())
    for k in range(2):
        p = ref_processed_probs(logits[k], params[k])
        counts = torch.bincount(torch.tensor(out[k * reps:(k + 1) * reps]), minlength=vocab)
        assert int(counts[p == 0].sum()) == 0
        keep = p > 0
        assert chisquare(counts[keep].numpy(), (p[keep] * reps).numpy()).pvalue > 1e-3


# --- nothing vocabulary-sized reaches the host ---------------------------------------------------


class OnDevice(torch.Tensor):
    """Marks tensors as device-resident: whatever torch derives from them stays marked, and
    every read of a marked tensor by the host is recorded (numel) in READS."""

    def tolist(self):
        READS.append(self.numel())
        return super().tolist()

    def item(self):
        READS.append(self.numel())
        return super().item()

    def cpu(self, *args, **kwargs):
        READS.append(self.numel())
        return super().cpu(*args, **kwargs)

    def numpy(self, *args, **kwargs):
        READS.append(self.numel())
        return super().numpy(*args, **kwargs)

    def __int__(self):
        READS.append(self.numel())
        return super().__int__()

    def __float__(self):
        READS.append(self.numel())
        return super().__float__()

    def __bool__(self):
        READS.append(self.numel())
        return super().__bool__()

    def __index__(self):
        READS.append(self.numel())
        return super().__index__()


READS: list[int] = []


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


@pytest.mark.parametrize("lazy", [False, True])
def test_only_token_sized_reads_leave_the_device(lazy):
    """verify_batch over a batch mixing greedy and sampled rows, and first_tokens, with the
    logits and the tree marked as device tensors: eager (as off the CPU), one host read each,
    of token-sized data (tokens, paths, argmaxes, path flags and drawn tokens); lazy (as on
    the CPU), besides it one read a level of which walks go on. Never a vocabulary-sized one."""
    g = torch.Generator().manual_seed(2)
    vocab = 4096
    shapes = [random_tree(g, n, vocab) for n in (9, 5, 12, 1)]
    tree = make_tree(shapes)
    logits = torch.randn(4, tree.size, vocab, generator=g) * 3
    for b, (toks, par) in enumerate(shapes):  # first children the target likes
        for c in range(1, len(toks)):
            if par[c] not in par[1:c]:
                logits[b, par[c], toks[c]] += 15.0
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    expected = verify_batch(tree, logits, params, gens, lazy=not lazy)
    assert max(len(n) for n in expected.nodes) > 2
    marked = DraftTree(*(on_device(t) for t in tree._fields()))
    READS.clear()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    got = verify_batch(marked, on_device(logits), params, gens, lazy=lazy)
    assert got == expected
    num_b, num_n = tree.tokens.shape
    paths = tree.retrieve_indices[0].numel()
    assert READS[-1] <= num_b * (2 * num_n + paths + 1) < vocab
    if lazy:  # which of the (at most 3) sampled walks go on, a level
        assert 1 < len(READS) <= tree.retrieve_indices.shape[-1] + 1, READS
        assert max(READS[:-1]) <= 3, READS
    else:
        assert len(READS) == 1, READS
    READS.clear()
    first_tokens(on_device(logits[:, 0]), params, gens)
    assert READS == [4], READS  # one level: nothing to be lazy about


def test_verify_sampling_returns_token_sized_tensors_on_the_logits_device():
    tree = make_tree([HAND, ([3, 1], [-1, 0])])
    logits = torch.randn(2, tree.size, 4)
    path, token = verify_sampling(on_device(logits), tree.tokens, tree.parents, tree.num_nodes,
                                  2, RowParams.of([T1, T1]),
                                  torch.rand(2, tree.size, dtype=torch.float64), lazy=False)
    assert path.shape == (2, tree.size) and path.dtype == torch.bool
    assert token.shape == (2,) and token.dtype == torch.long
    assert isinstance(path, OnDevice) and isinstance(token, OnDevice)


def test_greedy_verification_on_a_gpu_backend_reads_back_only_the_argmaxes():
    """The torch backends' greedy head (GPUs): the argmax at every node in one call, with the
    tree left on the host, so the one read from the device is the [B, N] argmax table (no node
    counts, no tree, no logits); acceptance equals the walk over the full logits' argmax."""
    from conftest import tiny_target

    from eagle2.backend import Backend, TargetOutput
    from eagle2.runner import LocalRunner
    from eagle2.verify import verify_greedy_tokens

    g = torch.Generator().manual_seed(3)
    target = tiny_target(vocab=64)
    target.backend = Backend()
    runner = LocalRunner(target, 4, 64)
    tree = make_tree([random_tree(g, n, 64) for n in (9, 5, 12, 1)])
    num_b, num_n = tree.tokens.shape
    hidden = torch.randn(num_b, num_n, target.config.hidden_size, generator=g)
    for b, (toks, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(),
                                        strict=True)):  # the target agrees with a few nodes
        for c in range(1, int(tree.num_nodes[b])):
            if c % 2:
                hidden[b, par[c]] = target.lm_head.weight[toks[c]].float() * 4
    pred = target.logits(hidden).argmax(-1)
    pred[torch.arange(num_n)[None] >= tree.num_nodes[:, None]] = -1
    expected = verify_greedy_tokens(tree, pred)
    assert max(len(n) for n in expected.nodes) > 1
    READS.clear()
    got, feats = runner.verified(tree, TargetOutput(on_device(hidden), on_device(hidden)),
                                 [SamplingParams()] * num_b, [None] * num_b)
    assert got == expected
    assert READS == [num_b * num_n], READS
    assert feats.shape[:2] == (num_b, max(len(n) for n in got.nodes))
