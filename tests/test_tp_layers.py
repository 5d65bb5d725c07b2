"""Tensor-parallel layers as the production engines build them (eagle2.tp), on real gloo ranks.

Two processes each build the same tiny random Llama and take their shard of it (`apply_tp`):
merged column-parallel q|k|v and gate|up, row-parallel o / down, a vocabulary-parallel lm_head
whose vocabulary does not split evenly. Against the unsharded model in this process: the same
features and logits (fp32 tolerance), the same greedy tokens; per forward exactly two
all-reduces a layer and nothing else, over the CPU ranks' socket group (`eagle2.tp_comm`; the
gloo process group carries none); greedy tokens cross the ranks as (max, index) pairs, never
as vocabulary-sized tensors. The socket group's collectives themselves: every rank gets the
same bits, for tp 2 and 3.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle2.tp_channel import free_port

VOCAB, LAYERS = 63, 3  # 63 rows over 2 ranks: 32 and 31, the second padded


def _inputs():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=g)  # [B, N]: a prefix, then a tree
    positions = torch.arange(7).expand(2, 7).contiguous()
    mask = torch.tril(torch.ones(7, 7, dtype=torch.bool)).expand(2, 7, 7).contiguous()
    return tokens, positions, mask


def _run(target):
    """features, logits, greedy tokens of a prefix forward, then of a 3-node tree after it."""
    from eagle2.runner import LocalRunner

    runner = LocalRunner(target, num_slots=2, max_len=64)
    tokens, positions, mask = _inputs()
    slots = torch.arange(2)
    out = []
    feats, logits = runner.forward(tokens, positions, mask, slots)
    out.append((feats, logits, target.greedy_tokens(feats)))
    runner.commit(slots, torch.arange(7).expand(2, 7), torch.tensor([7, 7]))
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    feats, logits = runner.forward(tokens[:, :3], positions[:, :3] + 7,
                                   tree.expand(2, 3, 3).contiguous(), slots)
    out.append((feats, logits, target.greedy_tokens(feats)))
    return out


def _send(queue, obj) -> None:
    """Tensors by value: a multiprocessing queue would pass their storage as a file descriptor
    that the parent fetches from the child later, and a child that has exited by then leaves
    the parent a FileNotFoundError (seen in CI)."""
    queue.put(pickle.dumps(obj))


def _receive(queue, timeout: float):
    return pickle.loads(queue.get(timeout=timeout))


def _rank(rank: int, port: int, queue) -> None:
    from conftest import tiny_target

    from eagle2.tp import VocabParallelLMHead, apply_tp, init_tp
    from eagle2.tp_comm import SocketGroup

    torch.set_num_threads(1)
    init_tp(rank, 2, "127.0.0.1", port, backend="gloo")
    counts = {"all_reduce": 0, "gather": 0, "gathered": [], "gloo": 0}
    reduce, gather = SocketGroup.all_reduce, SocketGroup.gather
    gloo_reduce, gloo_gather = dist.all_reduce, dist.all_gather

    def counted_reduce(self, t):
        counts["all_reduce"] += 1
        return reduce(self, t)

    def counted_gather(self, t):
        counts["gather"] += 1
        counts["gathered"].append(t.shape[-1])
        return gather(self, t)

    def gloo(*a, **k):
        counts["gloo"] += 1

    target = apply_tp(tiny_target(vocab=VOCAB, layers=LAYERS, seed=3), 2, rank)
    attn = target.layers[0].self_attn
    assert attn.qkv_proj.weight.shape[0] == sum(attn.qkv_sizes)
    assert isinstance(target.lm_head, VocabParallelLMHead)
    SocketGroup.all_reduce, SocketGroup.gather = counted_reduce, counted_gather
    dist.all_reduce, dist.all_gather = gloo, gloo
    try:
        out = _run(target)
        # a forward's features alone: the layers' all-reduces only
        before = dict(counts)
        tokens, positions, mask = _inputs()
        cache = target.allocate_cache(2, 64)
        target.forward(tokens, positions, mask, cache, torch.arange(2))
        layer_reduces = counts["all_reduce"] - before["all_reduce"]
        layer_gathers = counts["gather"] - before["gather"]
    finally:
        SocketGroup.all_reduce, SocketGroup.gather = reduce, gather
        dist.all_reduce, dist.all_gather = gloo_reduce, gloo_gather
    assert counts["gloo"] == 0
    if rank == 0:
        _send(queue, (out, layer_reduces, layer_gathers, counts["gathered"],
                      tuple(target.lm_head.weight.shape)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_tp2_layers_equal_the_whole_model_with_two_all_reduces_a_layer():
    from conftest import tiny_target

    expected = _run(tiny_target(vocab=VOCAB, layers=LAYERS, seed=3))
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got, reduces, gathers, gathered, head_shape = _receive(queue, 240)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert head_shape == (32, 64)  # rank 0's half of the 63-token vocabulary
    assert reduces == 2 * LAYERS and gathers == 0
    for (f, lg, tok), (ef, elg, etok) in zip(got, expected, strict=True):
        torch.testing.assert_close(f, ef, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lg, elg, rtol=1e-5, atol=1e-5)
        assert torch.equal(tok, etok)
    # logits gathered rows of 32 (a rank's vocabulary); greedy tokens pairs of 2 values
    assert set(gathered) == {32, 2} and gathered.count(2) == 2


def _decode(runner, prompts) -> list[list[int]]:
    """Plain greedy decoding of `prompts` together through an engine over `runner`."""
    from conftest import run

    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.engine import Engine

    engine = Engine(runner, None, max_batch=len(prompts), max_context=48, tree_margin=8)
    return run(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True),
               TreeConfig("vanilla"))


def _graphed_rank(rank: int, port: int, queue) -> None:
    from conftest import random_prompts, tiny_target

    from eagle2.backend import Backend
    from eagle2.cuda_graphs import GraphedRunner
    from eagle2.tp import apply_tp, init_tp

    torch.set_num_threads(1)
    init_tp(rank, 2, "127.0.0.1", port, backend="gloo")
    target = apply_tp(tiny_target(vocab=VOCAB, layers=LAYERS, seed=3), 2, rank)
    target.backend = Backend()  # the torch backend's layers, as on a GPU
    # 3 requests in a batch bucket of 4: a padded row, its slot the scratch one
    runner = GraphedRunner(target, 3, 64, num_blocks=16, block_size=16, graphs=False)
    tokens = _decode(runner, random_prompts(3, VOCAB, seed=4))
    _send(queue, (rank, tokens, dict(runner.counts)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_tp2_ranks_through_padded_steps_decode_as_the_whole_model():
    """Each rank's shard through `GraphedRunner`'s padded steps (what a GPU rank replays as
    CUDA graphs, run eagerly here: torch backend, paged cache, a padded batch row), its
    all-reduces and the vocabulary-parallel lm_head's gather inside them: both ranks decode
    the whole model's plain greedy tokens."""
    from conftest import random_prompts, tiny_target

    from eagle2.backend import Backend
    from eagle2.runner import LocalRunner

    whole = tiny_target(vocab=VOCAB, layers=LAYERS, seed=3)
    whole.backend = Backend()
    expected = _decode(LocalRunner(whole, 3, 64), random_prompts(3, VOCAB, seed=4))
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_graphed_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted((_receive(queue, 240) for _ in range(2)), key=lambda x: x[0])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for _, tokens, counts in got:
        assert tokens == expected
        assert counts.get("padded", 0) > 0, counts  # the steps went through the padded path


def _collectives(rank: int, world: int, port: int, queue, transport: str) -> None:
    import socket

    import eagle2.tp_comm
    from eagle2.tp import init_tp
    from eagle2.tp_comm import SocketGroup

    # "mixed": rank 0 listens on TCP (as where abstract sockets are refused), the others on
    # Unix sockets: each connects to a peer by the family of its address
    mine = "tcp" if transport == "mixed" and rank == 0 else transport.replace("mixed", "unix")
    eagle2.tp_comm.TRANSPORT = mine
    init_tp(rank, world, "127.0.0.1", port, backend="gloo")
    group = SocketGroup()
    if transport != "mixed":
        family = socket.AF_UNIX if transport == "unix" else socket.AF_INET
        assert {s.family for s in group.peers.values()} == {family}
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(3, 5, generator=g)  # rank-dependent values
    summed = mine.clone()
    group.all_reduce(summed)
    strided = mine.clone().t()  # not contiguous: summed all the same, in place
    group.all_reduce(strided)
    assert torch.equal(strided.t(), summed)
    big = torch.full((1 << 20,), float(rank + 1))  # 4 MiB: more than a socket buffer holds
    # small tensors go to every peer first, big ones pair by pair: both ways are taken here
    assert summed.numel() * 4 <= group.eager_bytes < big.numel() * 4
    group.all_reduce(big)
    again = mine.clone()  # a shape seen before, after the inbox grew for the big one
    group.all_reduce(again)
    assert torch.equal(again, summed)
    parts = [p.clone() for p in group.gather(torch.tensor([rank, -rank], dtype=torch.bfloat16))]
    _send(queue, (rank, mine, summed, big[:2].clone(), parts))
    dist.barrier()
    group.close()
    dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,transport", [
    (2, "unix"), (2, "tcp"), (3, "mixed"), pytest.param(3, "unix", marks=pytest.mark.slow)])
def test_socket_group_sums_and_gathers_the_same_bits_on_every_rank(world, transport):
    """Over Unix sockets (the default on Linux), over TCP (elsewhere), and mixed (a rank
    whose Unix socket was refused listens on TCP)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_collectives, args=(r, world, port, queue, transport))
             for r in range(world)]
    for p in procs:
        p.start()
    got = sorted((_receive(queue, 240) for _ in range(world)), key=lambda x: x[0])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    expected = got[0][1].clone()
    for r in range(1, world):
        expected += got[r][1]  # rank order, as every rank sums
    for _, _, summed, big, parts in got:
        assert torch.equal(summed, expected)  # bitwise, on every rank
        assert torch.equal(big, torch.full((2,), float(sum(range(1, world + 1)))))
        assert [p.tolist() for p in parts] == [[r, -r] for r in range(world)]


def _silent_peer(rank: int, port: int, queue) -> None:
    import time

    from eagle2.tp import init_tp
    from eagle2.tp_comm import SocketGroup

    init_tp(rank, 2, "127.0.0.1", port, backend="gloo")
    group = SocketGroup(timeout_s=1.5)
    if rank == 1:  # joins the group, then never takes part in an op
        queue.get(timeout=60)
        return
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
        queue.put(("returned", None))
    except TimeoutError as e:
        queue.put((str(e), time.monotonic() - start))


@pytest.mark.timeout(120)
def test_socket_group_op_fails_with_timeout_error_when_a_peer_is_silent():
    """A peer that joined but never sends fails the op within the group's timeout (the
    kernel's socket timeouts), with TimeoutError naming the peer, instead of waiting forever."""
    ctx = mp.get_context("spawn")
    results, release, port = ctx.Queue(), ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_silent_peer, args=(0, port, results)),
             ctx.Process(target=_silent_peer, args=(1, port, release))]
    for p in procs:
        p.start()
    message, waited = results.get(timeout=90)
    release.put("done")
    for p in procs:
        p.join(30)
    assert message == "rank 0: rank 1 neither sent nor took bytes within 1.5 s"
    assert 1.0 < waited < 10
