"""Padded (CUDA-graph) steps of the serving engine: eagle2.buckets and eagle2.cuda_graphs.

On a CPU the padded steps run eagerly, exactly the inputs, masks and layers a graph captures on
CUDA: here they are checked against the unpadded forward (the torch backend's) across buckets,
random trees, per-row cache lengths and non-contiguous slots; the KV cache of the real rows
against the unpadded step's; the real outputs against other padding contents (bitwise); and
whole engine runs against plain decoding. The capture and replay themselves need CUDA
(`test_graphs_replay_equals_eager_on_cuda`, marked gpu).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import random_prompts, run, tiny_target

import eagle2.drafter as drafter_mod
from eagle2.backend import Backend
from eagle2.buckets import Buckets, PaddedStep, bucket_up, pad_nodes, pad_step, unpad
from eagle2.config import SamplingParams, TreeConfig
from eagle2.cuda_graphs import (
    GraphCache,
    GraphedLevels,
    GraphedRunner,
    graphs_choice,
    make_runner,
    padded_forward,
    padded_wanted,
    runner_class,
)
from eagle2.drafter import Drafter
from eagle2.engine import Engine
from eagle2.head import new_head
from eagle2.runner import LocalRunner

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TREES = {
    "eagle2": TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, budget="fixed"),
    "static": TreeConfig("static", total_tokens=26, budget="fixed"),
    "chain": TreeConfig("chain", depth=4, budget="fixed"),
}
ATOL = 1e-5


def torch_target(**kw):
    """A tiny fp32 target on the torch backend (SDPA over the dense mask): what the padded
    steps serve (the CPU backend keeps its own kernels)."""
    target = tiny_target(**kw)
    target.backend = Backend()
    return target


def tree_mask_of(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """parents (node 0 the root, -1) -> tree_mask [N, N] (itself and its ancestors), depths [N]."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depths[i] = depths[parents[i]] + 1
    return mask, depths


def random_step(gen: torch.Generator, lengths: torch.Tensor, slots: torch.Tensor, num_n: int,
                vocab: int):
    """tokens, positions [B, N] and tree masks [B, N, N] of random trees, one per row."""
    masks, depths = [], []
    for _ in range(len(slots)):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_n)]
        mask, depth = tree_mask_of(parents)
        masks.append(mask)
        depths.append(depth)
    tokens = torch.randint(0, vocab, (len(slots), num_n), generator=gen)
    positions = lengths[slots][:, None] + torch.stack(depths)
    return tokens, positions, torch.stack(masks)


def fill_caches(gen: torch.Generator, plain: LocalRunner, padded: GraphedRunner,
                lengths: torch.Tensor) -> None:
    """The same random K/V and lengths in both runners' real slots (random in the scratch
    slot too)."""
    for kv in (padded.cache.k, padded.cache.v):
        kv.copy_(torch.randn(kv.shape, generator=gen))
    slots = plain.cache.k.shape[1]
    plain.cache.k.copy_(padded.cache.k[:, :slots])
    plain.cache.v.copy_(padded.cache.v[:, :slots])
    plain.cache.lengths.copy_(lengths)
    padded.lengths.copy_(lengths)


# ----- buckets ----------------------------------------------------------------------------
def test_buckets_round_up_and_stop_at_the_largest():
    assert [bucket_up(v, (1, 2, 4, 8)) for v in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    b = Buckets()
    assert [b.batch_for(n, 64) for n in (1, 3, 5, 33, 64)] == [1, 4, 8, 64, 64]
    assert b.batch_for(5, 6) == 6  # a bucket past the cache's slots is the slot count
    assert b.batch_for(7, 6) is None and b.batch_for(65, 100) is None and b.batch_for(0, 4) is None
    assert [b.nodes_for(n) for n in (1, 9, 64, 65)] == [1, 16, 64, None]
    assert [b.keys_for(n, 1000) for n in (1, 256, 257, 600, 1000)] == [256, 256, 512, 1000, 1000]
    assert b.keys_for(1001, 1000) is None
    assert Buckets(batch=(1, 3)).batch_for(2, 8) == 3
    for bad in ((), (2, 1), (0, 1), (1, 1)):
        with pytest.raises(ValueError, match="ascending"):
            Buckets(nodes=bad)


def test_pad_step_layout_and_unpad():
    tokens, positions = torch.tensor([[5, 6]]), torch.tensor([[3, 4]])
    mask = torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    step = pad_step(tokens, positions, mask, torch.tensor([2]), 2, 4, scratch_slot=9)
    assert step.tokens.tolist() == [[5, 6, 0, 0], [0, 0, 0, 0]]
    assert step.positions.tolist() == [[3, 4, 0, 0], [0, 0, 0, 0]]
    assert step.slots.tolist() == [2, 9] and (step.num_b, step.num_n) == (1, 2)
    want = torch.eye(4, dtype=torch.bool).repeat(2, 1, 1)
    want[0, 1, 0] = True
    assert torch.equal(step.tree_mask, want)
    # a draft level: two earlier scratch entries, then the level's own (padded past it)
    anc = torch.tensor([[[1, 0, 1, 0], [0, 1, 0, 1]]], dtype=torch.bool)  # [1, 2, T=4]
    step = pad_step(tokens, positions, anc, torch.tensor([0]), 2, 3, scratch_slot=9)
    assert step.tree_mask.shape == (2, 3, 5)
    assert step.tree_mask[0, :2].int().tolist() == [[1, 0, 1, 0, 0], [0, 1, 0, 1, 0]]
    assert step.tree_mask[0, 2].int().tolist() == [0, 0, 0, 0, 1]
    assert step.tree_mask[1].int().tolist() == [[0, 0, 1, 0, 0], [0, 0, 0, 1, 0],
                                               [0, 0, 0, 0, 1]]
    # into buffers: the same result, whatever the buffers held
    bufs = PaddedStep.empty(2, 3, 5, 9, "cpu")
    for t in (bufs.tokens, bufs.positions):
        t.fill_(7)
    bufs.tree_mask.fill_(True)
    bufs.slots.fill_(1)
    again = pad_step(tokens, positions, anc, torch.tensor([0]), 2, 3, 9, out=bufs)
    assert again is bufs
    for name in ("tokens", "positions", "tree_mask", "slots"):
        assert torch.equal(getattr(again, name), getattr(step, name)), name
    with pytest.raises(ValueError, match="exceeds"):
        pad_step(tokens, positions, mask, torch.tensor([0]), 1, 1, 9)
    with pytest.raises(ValueError, match="not the bucket"):
        pad_step(tokens, positions, mask, torch.tensor([0]), 2, 4, 9, out=bufs)
    x = torch.arange(24.0).view(2, 3, 4)
    padded = pad_nodes(x, 3, 5, fill=-1)
    assert padded.shape == (3, 5, 4) and torch.equal(padded[:2, :3], x)
    assert (padded[2] == -1).all() and (padded[:, 3:] == -1).all()
    out = unpad(padded, 2, 3)
    assert torch.equal(out, x) and out.data_ptr() != padded.data_ptr()
    assert unpad(padded, 2, 3, copy=False).data_ptr() == padded.data_ptr()


# ----- the target's padded forward --------------------------------------------------------
@pytest.mark.parametrize("num_b", [1, 2, 3, 4, 5])
def test_padded_forward_equals_unpadded_and_keeps_the_real_rows_cache(num_b):
    """B rows of random trees of 1..9 nodes over different committed lengths, in
    contiguous and shuffled slots, padded to (B, N) buckets and several key lengths."""
    target = torch_target(seed=3)
    num_slots, max_len = 6, 96
    plain = LocalRunner(target, num_slots, max_len)
    padded = GraphedRunner(target, num_slots, max_len, buckets=Buckets(min_keys=16))
    gen = torch.Generator().manual_seed(num_b)
    for num_n in range(1, 10):
        lengths = torch.randint(0, 60, (num_slots,), generator=gen)
        fill_caches(gen, plain, padded, lengths)
        if num_n % 2:
            slots = torch.arange(num_b)  # the engine's verification steps
        else:
            slots = torch.randperm(num_slots, generator=gen)[:num_b]
        tokens, positions, mask = random_step(gen, lengths, slots, num_n, target.vocab_size)
        want = plain.target_forward(tokens, positions, mask, slots)
        got = padded.target_forward(tokens, positions, mask, slots)
        assert got.hidden.shape == (num_b, num_n, 64)
        torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=ATOL)
        assert padded.cache.lengths.tolist() == lengths.tolist() + [0]
        bucket_n = padded.buckets.nodes_for(num_n)
        for s in range(num_slots):
            base = int(lengths[s])
            for kv_p, kv_g in ((plain.cache.k, padded.cache.k), (plain.cache.v, padded.cache.v)):
                if s not in slots.tolist():  # not in the step: untouched
                    assert torch.equal(kv_g[:, s], kv_p[:, s]), (num_n, s)
                    continue
                assert torch.equal(kv_g[:, s, :, :base], kv_p[:, s, :, :base])  # committed
                tree = slice(base, base + num_n)
                torch.testing.assert_close(kv_g[:, s, :, tree], kv_p[:, s, :, tree],
                                           atol=ATOL, rtol=ATOL)
                # padded entries land past the tree, inside the bucket's scratch region only
                past = base + bucket_n
                assert torch.equal(kv_g[:, s, :, past:], kv_p[:, s, :, past:])
    assert padded.counts == {"padded": 9}


def paged_pair(target, num_slots: int, max_len: int, gen: torch.Generator,
               lengths: torch.Tensor, block_size: int = 16, **kw):
    """An unpadded and a padded runner over paged caches holding the same random K/V, with
    the same shuffled blocks for each real slot (all it can hold) and lengths."""
    per_slot = -(-max_len // block_size)
    num_blocks = num_slots * per_slot + 3
    plain = LocalRunner(target, num_slots, max_len, num_blocks=num_blocks,
                        block_size=block_size)
    padded = GraphedRunner(target, num_slots, max_len, num_blocks=num_blocks,
                           block_size=block_size, **kw)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for s in range(num_slots):
        for r in (plain, padded):
            r.set_blocks(s, order[s * per_slot:(s + 1) * per_slot])
    for kv_p, kv_g in ((plain.cache.k, padded.cache.k), (plain.cache.v, padded.cache.v)):
        kv_g.copy_(torch.randn(kv_g.shape, generator=gen))
        kv_p.copy_(kv_g)
    plain.cache.lengths.copy_(lengths)
    padded.lengths.copy_(lengths)
    return plain, padded


@pytest.mark.parametrize("num_b", [1, 3])
def test_padded_forward_over_a_paged_cache_equals_unpadded(num_b):
    """As above over paged caches (shuffled blocks): the same outputs, the real rows' committed
    entries untouched and their trees' K/V written through the tables, other slots untouched,
    the scratch slot's table null (its padded rows write only the null block)."""
    target = torch_target(seed=7)
    num_slots, max_len = 5, 96
    gen = torch.Generator().manual_seed(10 + num_b)
    for num_n in range(1, 10, 2):
        lengths = torch.randint(0, 60, (num_slots,), generator=gen)
        plain, padded = paged_pair(target, num_slots, max_len, gen, lengths,
                                   buckets=Buckets(min_keys=16))
        slots = torch.arange(num_b) if num_n % 4 == 1 else \
            torch.randperm(num_slots, generator=gen)[:num_b]
        tokens, positions, mask = random_step(gen, lengths, slots, num_n, target.vocab_size)
        want = plain.target_forward(tokens, positions, mask, slots)
        got = padded.target_forward(tokens, positions, mask, slots)
        torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=ATOL)
        assert padded.counts == {"padded": 1}
        assert (padded.cache.block_tables[num_slots] == padded.cache.null_block).all()
        for layer in range(target.num_layers):
            every = torch.arange(num_slots)
            kp, vp = plain.cache.gather(layer, every, max_len)
            kg, vg = padded.cache.gather(layer, every, max_len)
            for s in range(num_slots):
                base = int(lengths[s])
                end = base + num_n if s in slots.tolist() else max_len
                assert torch.equal(kg[s, :, :base], kp[s, :, :base])
                assert torch.equal(vg[s, :, :base], vp[s, :, :base])
                torch.testing.assert_close(kg[s, :, base:end], kp[s, :, base:end],
                                           atol=ATOL, rtol=ATOL)
                torch.testing.assert_close(vg[s, :, base:end], vp[s, :, base:end],
                                           atol=ATOL, rtol=ATOL)


def test_real_outputs_are_bitwise_the_same_whatever_the_padding_holds():
    """In one bucket the real rows' outputs and K/V are bitwise independent of the padding:
    its tokens and positions, the scratch slot, other slots and the scratch past the trees."""
    target = torch_target(seed=4)
    num_slots, max_len = 8, 64
    runner = GraphedRunner(target, num_slots, max_len, buckets=Buckets(min_keys=16))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 0, 9, 3, 12, 7, 1, 2])
    fill_caches(gen, LocalRunner(target, num_slots, max_len), runner, lengths)
    for slots in (torch.arange(3), torch.tensor([6, 2, 4])):
        num_b, num_n = 3, 5
        tokens, positions, mask = random_step(gen, lengths, slots, num_n, target.vocab_size)
        base_cache = (runner.cache.k.clone(), runner.cache.v.clone())
        outs, caches = [], []
        for trial in range(2):
            runner.cache.k.copy_(base_cache[0])
            runner.cache.v.copy_(base_cache[1])
            step = pad_step(tokens, positions, mask, slots, 4, 8, runner.scratch_slot)
            if trial:  # other padding: tokens, positions, and every cache entry no real row reads
                pad_b = torch.ones(4, 8, dtype=torch.bool)
                pad_b[:num_b, :num_n] = False
                step.tokens[pad_b] = torch.randint(0, 64, (int(pad_b.sum()),), generator=gen)
                step.positions[pad_b] = torch.randint(0, 40, (int(pad_b.sum()),), generator=gen)
                for kv in (runner.cache.k, runner.cache.v):
                    free = [s for s in range(num_slots + 1) if s not in slots.tolist()]
                    kv[:, free] = torch.randn(kv[:, free].shape, generator=gen)
                    for s in slots.tolist():
                        start = int(lengths[s]) + num_n
                        kv[:, s, :, start:] = torch.randn(kv[:, s, :, start:].shape,
                                                          generator=gen)
            contiguous = slots.tolist() == list(range(num_b))
            with torch.inference_mode():
                out = padded_forward(target, runner.cache, step, runner.rope, 32, contiguous)
            outs.append(unpad(out.hidden, num_b, num_n))
            caches.append([kv[:, s, :, : int(lengths[s]) + num_n].clone()
                           for kv in (runner.cache.k, runner.cache.v) for s in slots.tolist()])
        assert torch.equal(outs[0], outs[1])
        for a, b in zip(*caches, strict=True):
            assert torch.equal(a, b)


def test_steps_past_the_buckets_or_the_cache_run_the_targets_own_forward():
    target = torch_target(seed=5)
    plain = LocalRunner(target, 4, 40)
    padded = GraphedRunner(target, 4, 40, buckets=Buckets(batch=(1, 2), nodes=(1, 2, 4, 16),
                                                          min_keys=8))
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 30, 0, 4])
    fill_caches(gen, plain, padded, lengths)
    cases = [(torch.arange(3), 2, "eager"),  # a batch past the largest bucket
             (torch.tensor([0, 3]), 17, "eager"),  # a tree past the largest bucket
             (torch.tensor([1]), 9, "eager"),  # 30 + a 16-node bucket > 40 cache entries
             (torch.tensor([0, 3]), 3, "padded")]
    for slots, num_n, how in cases:
        before = padded.counts[how]
        tokens, positions, mask = random_step(gen, lengths, slots, num_n, target.vocab_size)
        want = plain.target_forward(tokens, positions, mask, slots)
        got = padded.target_forward(tokens, positions, mask, slots)
        torch.testing.assert_close(got.features, want.features, atol=ATOL, rtol=ATOL)
        assert padded.counts[how] == before + 1, (slots, num_n, how)


def test_eagle3_features_come_out_padded_too():
    target = torch_target(seed=6, layers=4)
    target.set_feature_layers((0, 2, 3))
    plain, padded = LocalRunner(target, 3, 48), GraphedRunner(target, 3, 48)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.tensor([4, 9, 0])
    fill_caches(gen, plain, padded, lengths)
    slots = torch.tensor([2, 0])
    tokens, positions, mask = random_step(gen, lengths, slots, 5, target.vocab_size)
    want = plain.target_forward(tokens, positions, mask, slots)
    got = padded.target_forward(tokens, positions, mask, slots)
    assert got.features.shape == (2, 5, 3 * 64)
    torch.testing.assert_close(got.features, want.features, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=ATOL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a capture that fails: no CUDA")
def test_a_failed_capture_falls_back_to_the_targets_own_forward(caplog):
    """Graphs asked for where capturing fails (here: no CUDA at all): logged, and from then
    on the target's own forward; strict: the failure is raised."""
    target = torch_target(seed=7)
    plain, runner = LocalRunner(target, 2, 32), GraphedRunner(target, 2, 32)
    runner.graphs = GraphCache()  # what a CUDA runner has
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 5])
    fill_caches(gen, plain, runner, lengths)
    slots = torch.arange(2)
    for _ in range(2):
        tokens, positions, mask = random_step(gen, lengths, slots, 3, target.vocab_size)
        want = plain.target_forward(tokens, positions, mask, slots)
        got = runner.target_forward(tokens, positions, mask, slots)
        torch.testing.assert_close(got.hidden, want.hidden, atol=ATOL, rtol=ATOL)
    assert runner.counts == {"eager": 2} and runner.graphs.graphs == {}
    assert runner.graphs.failed and "capture" in caplog.text
    assert not runner.info["cuda_graphs"]
    runner.graphs = GraphCache(strict=True)
    with pytest.raises(Exception):  # noqa: B017  (whatever the capture raised)
        runner.target_forward(tokens, positions, mask, slots)


# ----- choosing the runner ----------------------------------------------------------------
def test_the_choice_of_runner(monkeypatch):
    monkeypatch.delenv("EAGLE2_CUDA_GRAPHS", raising=False)
    assert graphs_choice() == "auto" and graphs_choice(True) == "on"
    assert graphs_choice(False) == "off" and graphs_choice("off") == "off"
    monkeypatch.setenv("EAGLE2_CUDA_GRAPHS", "on")
    assert graphs_choice() == "on" and graphs_choice("auto") == "auto"
    monkeypatch.setenv("EAGLE2_CUDA_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="EAGLE2_CUDA_GRAPHS"):
        graphs_choice()
    monkeypatch.delenv("EAGLE2_CUDA_GRAPHS")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert runner_class(cpu) is LocalRunner and runner_class(cuda) is GraphedRunner
    assert runner_class(cpu, "on") is GraphedRunner and runner_class(cuda, False) is LocalRunner
    # the CPU backend keeps its kernels: auto leaves it alone, on is refused
    cpu_target = tiny_target(seed=1)
    assert cpu_target.backend.name == "cpu"
    assert not padded_wanted("auto", cpu, cpu_target.backend)
    assert type(make_runner(cpu_target, 2, 32)) is LocalRunner
    with pytest.raises(ValueError, match="CPU backend"):
        make_runner(cpu_target, 2, 32, cuda_graphs=True)
    with pytest.raises(ValueError, match="CPU backend"):
        GraphedRunner(cpu_target, 2, 32)
    # the torch backend on a CPU: padded (eagerly) when asked, never graphs
    target = torch_target(seed=1)
    assert type(make_runner(target, 2, 32)) is LocalRunner
    runner = make_runner(target, 2, 32, cuda_graphs="on")
    assert isinstance(runner, GraphedRunner) and runner.graphs is None
    assert runner.lengths.shape == (2,) and runner.cache.k.shape[1] == 3
    assert runner.info["padded_steps"] and not runner.info["cuda_graphs"]
    with pytest.raises(ValueError, match="need a CUDA"):
        GraphedRunner(target, 2, 32, graphs=True)


# ----- engines ----------------------------------------------------------------------------
def make_engine(target, runner_cls, head_seed: int | None = 0, max_batch: int = 3,
                max_context: int = 256, buckets: Buckets | None = None,
                levels: bool = False) -> Engine:
    """conftest.make_engine with the runner class given (GraphedRunner: padded steps) and, with
    levels, the drafter's tree levels padded too (`GraphedLevels`)."""
    drafter = None
    if head_seed is not None:
        head = new_head(target.config, seed=head_seed).to(target.device)
        drafter = Drafter(head, target.embed, target.lm_head, max_slots=max_batch,
                          max_len=max_context, cuda_graphs="on" if levels else "off")
    max_len = max_context + Engine.tree_margin
    runner = runner_cls(target, max_batch, max_len) if buckets is None else \
        runner_cls(target, max_batch, max_len, buckets=buckets)
    return Engine(runner, drafter, max_batch=max_batch, max_context=max_context)


@pytest.fixture
def torch_heads(monkeypatch):
    """Drafters on the torch backend (the head's module path; on a CPU it would get the CPU
    backend's head kernels): what padded levels serve."""
    monkeypatch.setattr(drafter_mod, "backend_for", lambda device, dtype: Backend())


def test_engine_with_padded_steps_equals_plain_decoding(torch_heads):
    """More requests than slots (so prefills go to slots past 0), every tree mode: the padded
    runner (and padded draft levels) give plain decoding's greedy tokens, as the unpadded
    runner does; steps past the buckets (long prompts, big trees) run eagerly in the same run."""
    target = torch_target(vocab=48, seed=11)
    prompts = random_prompts(5, 48, seed=1)
    vanilla = run(make_engine(target, LocalRunner, None), prompts, GREEDY,
                  TreeConfig("vanilla"))
    engine = make_engine(target, GraphedRunner, None)
    assert run(engine, prompts, GREEDY, TreeConfig("vanilla")) == vanilla
    assert engine.runner.counts["padded"] > 0 and engine.runner.counts["eager"] == 0
    small = Buckets(batch=(1, 2), nodes=(1, 2, 4, 8, 16), min_keys=32)
    padded_small = mixed = 0
    for name, tree in TREES.items():
        unpadded = run(make_engine(target, LocalRunner), prompts, GREEDY, tree)
        assert unpadded == vanilla, name
        for buckets, levels in ((None, False), (small, True)):
            engine = make_engine(target, GraphedRunner, buckets=buckets, levels=levels)
            assert run(engine, prompts, GREEDY, tree) == vanilla, (name, buckets, levels)
            counts = engine.runner.counts
            mixed += engine.stats.mixed_steps  # newcomers read in a tree step: unpadded
            if buckets is small:  # batch 3, prompts of 17+ tokens, 26-node trees: eager
                assert counts["eager"] > 0
                assert engine.drafter.levels.counts["padded"] > 0
                padded_small += counts["padded"]
            else:
                assert counts["padded"] > 0
    assert padded_small > 0 and mixed > 0


def test_padded_levels_draft_the_unpadded_trees(torch_heads):
    """Drafter.draft with padded levels (batch and width buckets, shuffled draft slots) =
    without: the same trees, values within float tolerance."""
    target = torch_target(vocab=48, seed=12)
    head = new_head(target.config, seed=3)
    gen = torch.Generator().manual_seed(0)
    drafters = [Drafter(head, target.embed, target.lm_head, max_slots=5, max_len=64,
                        cuda_graphs=on) for on in ("off", "on")]
    assert drafters[0].levels is None and isinstance(drafters[1].levels, GraphedLevels)
    assert drafters[1].cache.k.shape[1] == 6  # the scratch slot
    ids = ["a", "b", "c", "d", "e"]
    for d in drafters:  # occupy the slots out of order, then free two
        d._slots(["x", "d", "y", "b", "a"])
        d.release("x")
        d.release("y")
    for config in (TreeConfig("eagle2", total_tokens=10, depth=3, top_k=3, budget="fixed"),
                   TreeConfig("static", total_tokens=26, budget="fixed")):
        feats = torch.randn(5, 4, 64, generator=gen)
        tokens = torch.randint(0, 48, (5, 4), generator=gen)
        counts = torch.tensor([4, 1, 3, 2, 4])
        trees = [d.draft(ids, feats, tokens, counts, config) for d in drafters]
        for name in ("tokens", "parents", "depths", "tree_mask", "num_nodes", "lookup"):
            assert torch.equal(getattr(trees[1], name), getattr(trees[0], name)), name
        torch.testing.assert_close(trees[1].values, trees[0].values, atol=1e-5, rtol=1e-5)
    assert drafters[1].levels.counts["padded"] > 0
    assert drafters[1].cache.lengths.tolist() == drafters[0].cache.lengths.tolist() + [0]


# ----- CUDA -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dev", ["cuda", pytest.param("cuda:1", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs a second GPU"))])
def test_graphs_replay_equals_eager_on_cuda(dev):
    """Capture per bucket, replay, and compare with the same padded step run eagerly and with
    the unpadded forward; the engine through graphs equals plain decoding. On cuda:1 too,
    while cuda:0 stays the current device (the graphs make the model's device current)."""
    target = torch_target(seed=3)
    target.hf.to(dev)
    target = type(target)(target.hf, None, "tiny-cuda")
    target.backend = Backend()
    plain = LocalRunner(target, 6, 96)
    eager = GraphedRunner(target, 6, 96, graphs=False)
    graphed = GraphedRunner(target, 6, 96, strict=True)
    assert graphed.graphs is not None
    gen = torch.Generator().manual_seed(0)
    for num_b, num_n in ((1, 1), (3, 5), (5, 9), (3, 5)):
        lengths = torch.randint(0, 60, (6,), generator=gen)
        fill_caches(gen, plain, graphed, lengths)
        for a, b in ((eager.cache.k, graphed.cache.k), (eager.cache.v, graphed.cache.v),
                     (eager.cache.lengths, graphed.cache.lengths)):
            a.copy_(b)
        slots = torch.arange(num_b)
        tokens, positions, mask = random_step(gen, lengths, slots, num_n, target.vocab_size)
        args = [t.to(dev) for t in (tokens, positions, mask, slots)]
        want = plain.target_forward(*args)
        padded = eager.target_forward(*args)
        got = graphed.target_forward(*args)
        torch.testing.assert_close(got.hidden, padded.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    assert graphed.graphs.counts["captured"] == 3 and graphed.graphs.counts["replayed"] == 4
    prompts = random_prompts(3, 64, seed=2)
    vanilla = run(make_engine(target, LocalRunner, None), prompts, GREEDY,
                  TreeConfig("vanilla"))
    engine = make_engine(target, GraphedRunner, levels=True)
    assert run(engine, prompts, GREEDY, TREES["eagle2"]) == vanilla
    assert engine.runner.counts["graph"] > 0 and engine.drafter.levels.counts["graph"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_graphs_replay_with_each_steps_block_tables_on_cuda():
    """One graph of a bucket replayed over other block tables and lengths each time (the
    tables are read where they live): equal to the unpadded paged forward every time."""
    target = torch_target(seed=8)
    target.hf.to("cuda")
    target = type(target)(target.hf, None, "tiny-cuda")
    target.backend = Backend()
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 60, (4,), generator=gen)
    plain, graphed = paged_pair(target, 4, 96, gen, lengths, strict=True)
    assert graphed.graphs is not None
    per_slot = plain.cache.block_tables.shape[1]
    for _ in range(3):
        order = torch.randperm(plain.paged[0], generator=gen).tolist()
        lengths = torch.randint(0, 60, (4,), generator=gen)
        for r in (plain, graphed):
            for s in range(4):
                r.set_blocks(s, order[s * per_slot:(s + 1) * per_slot])
            r.lengths.copy_(lengths)
        slots = torch.arange(3)
        tokens, positions, mask = random_step(gen, lengths, slots, 5, target.vocab_size)
        args = [t.to("cuda") for t in (tokens, positions, mask, slots)]
        want = plain.target_forward(*args)
        got = graphed.target_forward(*args)
        torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    assert graphed.graphs.counts["captured"] == 1 and graphed.graphs.counts["replayed"] == 3


def test_a_full_graph_cache_says_so_once_and_leaves_new_buckets_eager(caplog):
    """Past max_graphs a new bucket gets no graph (the caller's eager step runs it): the
    first such bucket is logged, every one counted."""
    cache = GraphCache(max_graphs=0)
    with caplog.at_level(logging.WARNING, logger="eagle2.cuda_graphs"):
        for key in ((1, 1, 256, True), (2, 4, 256, True)):
            assert cache.run(key, make=None, fill=None, fn=None) is None
    assert cache.counts["full"] == 2 and cache.counts["captured"] == 0
    assert caplog.text.count("CUDA graphs kept") == 1 and "(1, 1, 256, True)" in caplog.text
