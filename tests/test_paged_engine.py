"""The engine over a paged cache (docs/kv-cache.md "Paged cache"): the same tokens as over
slotted caches, with prefix caching on or off, and with a block pool too small for all
requests (preemption); a prompt sharing a cached prefix prefills fewer tokens."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import random_prompts, run, tiny_target
from test_lossless_greedy import bf16_target, needs_exact_bf16

from eagle2.backend import Backend
from eagle2.config import SamplingParams, TreeConfig
from eagle2.cuda_graphs import GraphedRunner
from eagle2.drafter import Drafter
from eagle2.engine import Engine, Request
from eagle2.head import new_head
from eagle2.runner import LocalRunner
from eagle2.target import TargetModel

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
TREES = {
    "vanilla": TreeConfig("vanilla"),
    "eagle2": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed"),
    "chain": TreeConfig("chain", depth=5, budget="fixed"),
}


def paged_engine(target, num_blocks: int | None, max_running: int = 8, max_context: int = 256,
                 prefix_caching: bool = True, block_size: int = 16,
                 runner_cls: type[LocalRunner] = LocalRunner) -> Engine:
    """num_blocks None: the slotted cache. runner_cls: `GraphedRunner` for padded steps."""
    target.set_feature_layers(None)
    head = new_head(target.config, seed=0)
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=max_running,
                      max_len=max_context)
    runner = runner_cls(target, max_running, max_context + Engine.tree_margin, num_blocks,
                        block_size)
    assert (runner.paged is not None) == (num_blocks is not None)
    return Engine(runner, drafter, max_running=max_running, max_context=max_context,
                  prefix_caching=prefix_caching)


def shared_prefix_prompts(num: int, vocab: int, prefix_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
    return [prefix + p for p in random_prompts(num, vocab, seed=seed + 1)]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_paged_greedy_equals_slotted_in_every_mode(caching):
    target = tiny_target(vocab=48, seed=31)
    prompts = shared_prefix_prompts(6, 48, 40, seed=3) + random_prompts(2, 48, seed=4)
    for name, tree in TREES.items():
        slotted = run(paged_engine(target, None), prompts, GREEDY, tree)
        engine = paged_engine(target, 200, prefix_caching=caching)
        assert run(engine, prompts, GREEDY, tree) == slotted, name
        assert engine.stats.preemptions == 0
        assert engine.paging.blocks.num_free == 200  # every block back in the pool



@needs_exact_bf16
def test_native_bf16_operators_page_cache_prefixes_and_preempt_with_the_slotted_tokens():
    """bf16 with the CPU's native operators (the default CPU service's kernels): over a paged
    cache, with room (prefix-cache hits) and with a pool too small (preemptions), every mode
    gives the slotted cache's tokens; the slotted eagle2 and chain runs equal plain decoding."""
    target = bf16_target(38)  # the runner fuses it: the native operators
    prompts = shared_prefix_prompts(5, 48, 40, seed=5) + random_prompts(3, 48, seed=6)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    slotted = {name: run(paged_engine(target, None, max_context=128), prompts, params, tree)
               for name, tree in TREES.items()}
    assert slotted["eagle2"] == slotted["chain"] == slotted["vanilla"]
    for num_blocks in (400, 18):
        for name, tree in TREES.items():
            engine = paged_engine(target, num_blocks, max_context=128)
            assert engine.runner.info["attention"] == "native-exact"
            got = run(engine, prompts[:1], params, tree)  # its prompt's blocks cached first
            assert got + run(engine, prompts[1:], params, tree) == slotted[name], \
                (name, num_blocks)
            assert engine.paging.blocks.num_free == num_blocks
            if num_blocks == 400:
                assert engine.stats.prefix_hit_tokens > 0 and engine.stats.preemptions == 0
            else:
                assert engine.stats.preemptions > 0

def test_small_block_pool_preempts_and_keeps_every_output():
    """A pool that holds one request of the whole context (and little more): requests wait
    for blocks and the newest is preempted mid-decoding; every output equals the one with
    enough blocks."""
    target = tiny_target(vocab=48, seed=32)
    prompts = random_prompts(8, 48, seed=5)
    tree = TREES["eagle2"]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    roomy = run(paged_engine(target, 400, max_context=128), prompts, params, tree)
    small = paged_engine(target, 18, max_context=128)  # 258 entries: 17 blocks of 16
    assert run(small, prompts, params, tree) == roomy
    assert small.stats.preemptions > 0
    assert small.paging.blocks.num_free == 18


def test_padded_cuda_graph_steps_page_preempt_and_cache_prefixes():
    """The CUDA-graph runner's padded steps (eager here: the same step a graph replays) over a
    paged cache: with room, prefix-cache hits; with a pool too small, preemptions; every
    output plain decoding's, every block back in the pool."""
    target = tiny_target(vocab=48, seed=36)
    target.backend = Backend()  # the torch backend: what padded steps serve
    prompts = shared_prefix_prompts(4, 48, 40, seed=8) + random_prompts(4, 48, seed=9)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    vanilla = run(paged_engine(target, None, max_context=128), prompts, params,
                  TREES["vanilla"])
    for num_blocks in (400, 18):
        engine = paged_engine(target, num_blocks, max_context=128, runner_cls=GraphedRunner)
        assert engine.runner.paged == (num_blocks, 16) and engine.paging is not None
        # the first request alone: its prompt's blocks are cached when the others arrive
        got = run(engine, prompts[:1], params, TREES["eagle2"])
        assert got + run(engine, prompts[1:], params, TREES["eagle2"]) == vanilla, num_blocks
        assert engine.runner.counts["padded"] > 0
        assert engine.paging.blocks.num_free == num_blocks
        if num_blocks == 400:
            assert engine.stats.prefix_hit_tokens > 0 and engine.stats.preemptions == 0
        else:
            assert engine.stats.preemptions > 0
    # the scratch slot (padded rows) never holds a block
    assert (engine.runner.cache.block_tables[-1] == engine.runner.cache.null_block).all()


def test_preempted_sampled_vanilla_requests_keep_their_samples():
    """A resumed request takes no sample in its recomputation: seeded vanilla samples equal
    the unpreempted run's."""
    target = tiny_target(vocab=48, seed=33)
    prompts = random_prompts(6, 48, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    seeds = list(range(100, 106))
    roomy = run(paged_engine(target, 400, max_context=128), prompts, params, TREES["vanilla"],
                seeds)
    small = paged_engine(target, 18, max_context=128)
    assert run(small, prompts, params, TREES["vanilla"], seeds) == roomy
    assert small.stats.preemptions > 0


def test_shared_prefix_is_prefilled_once():
    target = tiny_target(vocab=48, seed=34)
    engine = paged_engine(target, 200)
    prompts = shared_prefix_prompts(2, 48, 100, seed=7)
    tree = TREES["eagle2"]
    one = SamplingParams(max_tokens=1)  # ends at its prefill: the prompt's blocks are cached
    first = run(engine, prompts[:1], one, tree)
    computed = engine.stats.prefill_tokens
    assert computed == len(prompts[0])
    second = run(engine, prompts[1:], GREEDY, tree)
    # the 100-token prefix is 6 full blocks of 16 (96 tokens) found cached
    assert engine.stats.prefill_tokens - computed == len(prompts[1]) - 96
    assert engine.stats.prefix_hit_tokens == 96
    assert engine.stats.prefix_hit_rate == pytest.approx(96 / (len(prompts[0]) + len(prompts[1])))
    off = paged_engine(target, 200, prefix_caching=False)
    assert run(off, prompts[:1], one, tree) == first
    assert run(off, prompts[1:], GREEDY, tree) == second
    assert off.stats.prefill_tokens == len(prompts[0]) + len(prompts[1])


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_cached_prefix_counts_nothing_against_the_step_prompt_budget(caching):
    """While a request decodes, a 110-token prompt whose first 96 tokens are cached reads its
    14 others whole in the step it arrives (budget 24); without the cache it is chunked over
    5 steps. The same tokens."""
    target = tiny_target(vocab=48, seed=41)
    engine = paged_engine(target, 200, prefix_caching=caching)
    engine.prefill_chunk = 24
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 48, (100,), generator=gen).tolist()
    late = tuple(prefix + torch.randint(0, 48, (10,), generator=gen).tolist())
    run(engine, [prefix + [1, 2, 3]], SamplingParams(max_tokens=1), TREES["eagle2"])
    engine.add(Request("s", (5, 6, 7), SamplingParams(max_tokens=30, ignore_eos=True),
                       TREES["eagle2"]))
    engine.step()
    engine.add(Request("late", late, GREEDY, TREES["eagle2"]))
    out, steps = [], 0
    while not out:
        before = engine.stats.prefill_tokens
        out += [t for e in engine.step() if e.seq_id == "late" for t in e.token_ids]
        assert engine.stats.prefill_tokens - before <= 24
        steps += 1
    assert steps == (1 if caching else 5)
    while engine.has_work():
        out += [t for e in engine.step() if e.seq_id == "late" for t in e.token_ids]
    alone = paged_engine(target, 200, prefix_caching=False)
    assert out == run(alone, [list(late)], GREEDY, TREES["eagle2"])[0]


def test_pool_must_hold_one_whole_request_and_cancel_frees_blocks():
    target = tiny_target(vocab=48, seed=35)
    with pytest.raises(ValueError, match="less than one request"):
        paged_engine(target, 10, max_context=256)  # 386 entries need 25 blocks
    engine = paged_engine(target, 40)
    engine.add(Request("a", tuple(range(1, 40)), GREEDY, TREES["eagle2"]))
    engine.step()
    assert engine.paging.blocks.num_free < 40
    engine.cancel("a")
    assert engine.paging.blocks.num_free == 40 and not engine.has_work()


def _late_long_prompt(engine: Engine) -> tuple[dict[str, list[int]], list[set[str]], int]:
    """Three short requests decode, then a 200-token prompt arrives. -> (outputs, the ids
    with tokens in each step after it arrived, until its first token; that step count)."""
    tree, params = TREES["eagle2"], SamplingParams(max_tokens=30, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(random_prompts(3, 48, seed=8)):  # still decoding after the prefill
        engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=100, ignore_eos=True),
                           tree))
        out[f"s{i}"] = []
    log: list[set[str]] = []
    gen = torch.Generator().manual_seed(9)
    long_prompt = tuple(torch.randint(0, 48, (200,), generator=gen).tolist())
    for step in range(200):
        if step == 2:
            engine.add(Request("long", long_prompt, params, tree))
            out["long"] = []
        events = engine.step()
        if step >= 2 and not out["long"]:
            log.append({e.seq_id for e in events if e.token_ids})
        for e in events:
            out[e.seq_id].extend(e.token_ids)
        if not engine.has_work():
            break
    return out, log, len(log)


@pytest.mark.parametrize("mix", [True, False], ids=["mixed", "own-forward"])
@pytest.mark.parametrize("num_blocks", [None, 200], ids=["slotted", "paged"])
def test_long_prompt_is_prefilled_in_chunks_while_others_decode(num_blocks, mix):
    """Chunks in the running requests' verification forward (mix) or in one of their own:
    the outputs of a whole prefill either way."""
    target = tiny_target(vocab=48, seed=36)
    whole = paged_engine(target, num_blocks, max_context=384)
    whole.prefill_chunk = 10**6  # the prompt in one prefill step
    expected, _, steps = _late_long_prompt(whole)
    assert steps == 1
    chunked = paged_engine(target, num_blocks, max_context=384)
    chunked.prefill_chunk, chunked.mix_prompts = 48, mix
    got, log, steps = _late_long_prompt(chunked)
    assert got == expected
    assert steps == 5  # 200 tokens in chunks of 48
    assert chunked.stats.mixed_steps == (5 if mix else 0)
    # every step of its prefill, each running stream got tokens
    assert all({"s0", "s1", "s2"} <= ids for ids in log)
    assert chunked.stats.prefill_tokens == whole.stats.prefill_tokens


@needs_exact_bf16
@pytest.mark.parametrize("num_blocks", [None, 400], ids=["slotted", "paged"])
def test_mixed_chunks_are_bitwise_their_own_forwards_in_bf16(num_blocks):
    """bf16 with the CPU's native operators: prompts read in the trees' forward give the
    running requests and the chunked ones the same tokens as chunks read alone (every
    feature bitwise), a seeded sampled newcomer (vanilla) among them."""
    target = TargetModel(bf16_target(37).hf, name="tiny-bf16-37").fuse()
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    late = {2: ("long", tuple(i % 48 for i in range(7, 207)), GREEDY, TREES["eagle2"]),
            4: ("sampled", tuple(i % 48 for i in range(3, 140)), sampled, TREES["vanilla"]),
            6: ("tail", tuple(i % 47 for i in range(5, 90)), GREEDY, TREES["chain"])}
    runs = {}
    for mix in (True, False):
        engine = paged_engine(target, num_blocks, max_context=384)
        engine.prefill_chunk, engine.mix_prompts = 32, mix
        out: dict[str, list[int]] = {}
        for i, p in enumerate(random_prompts(3, 48, seed=8)):
            engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=120,
                                                                 ignore_eos=True),
                               TREES["eagle2"]))
        step = 0
        while engine.has_work() or step <= max(late):
            if step in late:
                engine.add(Request(*late[step]))
            for e in engine.step():
                out.setdefault(e.seq_id, []).extend(e.token_ids)
            step += 1
        runs[mix] = (out, engine.stats.accepted, engine.stats.prefill_tokens)
        assert len(out) == 6 and len(out["sampled"]) == 20
        assert (engine.stats.mixed_steps >= 12) == mix  # 200 + 137 + 85 tokens by 32
    assert runs[True] == runs[False]


@pytest.mark.parametrize("num_blocks", [None, 400, 18], ids=["slotted", "paged", "preempting"])
def test_newcomers_are_read_in_the_running_requests_forward(num_blocks):
    """Requests arriving while others decode are prefilled inside their verification forward:
    no step leaves a running request without tokens (with `mix_prompts` off, each arrival
    takes a prefill step of its own in which nobody decodes), and every output, a seeded
    sampled newcomer's included, is the one of prefill steps of their own (with a pool too
    small for all: preemptions, and resumed requests recomputed in tree steps too)."""
    target = tiny_target(vocab=48, seed=38)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    prompts = random_prompts(7, 48, seed=12, lo=5, hi=30)
    runs = {}
    for mix in (True, False):
        engine = paged_engine(target, num_blocks, max_context=128)
        engine.mix_prompts = mix
        out: dict[str, list[int]] = {}
        stalls = 0
        for step in range(400):
            if step < 7:  # one arrival a step
                params = sampled if step == 3 else SamplingParams(max_tokens=70,
                                                                  ignore_eos=True)
                tree = TREES["vanilla"] if step == 3 else TREES["eagle2"]
                engine.add(Request(f"r{step}", tuple(prompts[step]), params, tree))
            running = {s.req.seq_id for s in engine.seqs}
            events = engine.step()
            stalls += bool(running - {e.seq_id for e in events if e.token_ids})
            for e in events:
                out.setdefault(e.seq_id, []).extend(e.token_ids)
            if not engine.has_work():
                break
        runs[mix] = out
        assert len(out) == 7 and len(out["r3"]) == 30
        if mix:
            assert engine.stats.mixed_steps > 0
            if num_blocks != 18:  # (a preemption's resume may find no free row to mix into)
                assert stalls == 0
        else:
            assert stalls > 0 and engine.stats.mixed_steps == 0
        if num_blocks == 18:
            assert engine.stats.preemptions > 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("num_blocks", [None, 400, 24], ids=["slotted", "paged", "preempting"])
def test_a_step_reads_at_most_its_prompt_budget_shared_by_chunks_and_newcomers(num_blocks):
    """While requests run, a step reads at most `prefill_chunk` prompt tokens: the chunked
    prompt's next piece, newcomers whole while they fit, the next one's first piece (a
    prompt's last piece and the next one's first in one forward, the new chunk moved to the
    top row after it). Outputs, a seeded sampled newcomer's included, equal the policy before
    (`newcomers_in_budget` off: a burst of arrivals read in one step, beyond the budget)."""
    target = tiny_target(vocab=48, seed=40)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=25, ignore_eos=True)
    gen = torch.Generator().manual_seed(4)
    burst = [torch.randint(0, 48, (n,), generator=gen).tolist() for n in (30, 9, 45, 20, 14)]
    runs = {}
    for shared in (True, False):
        engine = paged_engine(target, num_blocks, max_context=128)
        engine.prefill_chunk, engine.newcomers_in_budget = 24, shared
        moved = []
        chunk_on = engine._chunk_on
        engine._chunk_on = lambda ch, moved=moved, on=chunk_on: moved.append(ch.row) or on(ch)
        out: dict[str, list[int]] = {}
        read = []  # prompt tokens read in each step that began with requests running
        for i, p in enumerate(random_prompts(3, 48, seed=8)):
            engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=60,
                                                                 ignore_eos=True),
                               TREES["eagle2"]))
        for step in range(300):
            if step == 2:
                for j, p in enumerate(burst):
                    params, tree = (sampled, TREES["vanilla"]) if j == 3 else (GREEDY,
                                                                               TREES["chain"])
                    engine.add(Request(f"b{j}", tuple(p), params, tree))
            running, before = bool(engine.seqs), engine.stats.prefill_tokens
            for e in engine.step():
                out.setdefault(e.seq_id, []).extend(e.token_ids)
            if running:
                read.append(engine.stats.prefill_tokens - before)
            if not engine.has_work():
                break
        runs[shared] = out
        assert len(out) == 8 and len(out["b3"]) == 25
        if num_blocks == 24:
            assert engine.stats.preemptions > 0
        if shared:
            assert max(read) <= 24 and engine.stats.mixed_steps > 0
            assert engine.max_batch - 2 in moved  # the 30-token prompt's last piece beside
            # the 45-token one's first
        else:
            assert max(read) > 24
    assert runs[True] == runs[False]


def test_prompts_admitted_together_run_no_padding_through_the_layers():
    """Prompts of 5, 40 and 12 tokens admitted together (an idle engine) are read one group
    each in one forward: 57 tokens through the layers, not 3 x 40 right-padded (with
    `mix_prompts` off); the same outputs."""
    target = tiny_target(vocab=48, seed=39)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 48, (n,), generator=gen).tolist() for n in (5, 40, 12)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens: list[int] = []  # through the layers, per forward
    forward, forward_parts = target.forward, target.forward_parts
    target.forward = lambda t, *a, **k: tokens.append(t.numel()) or forward(t, *a, **k)
    target.forward_parts = lambda parts, *a, **k: tokens.append(
        sum(p.tokens.numel() for p in parts)) or forward_parts(parts, *a, **k)
    outs, seen = {}, {}
    try:
        for mix in (True, False):
            engine = paged_engine(target, 200)
            engine.mix_prompts = mix
            tokens.clear()
            outs[mix] = run(engine, prompts, params, TREES["vanilla"])
            seen[mix] = tokens[0]
    finally:
        del target.forward, target.forward_parts
    assert outs[True] == outs[False]
    assert seen == {True: 57, False: 120}


@pytest.mark.parametrize("mix", [True, False], ids=["mixed", "own-forwards"])
def test_blocks_running_out_beside_a_chunked_prompt_preempt_the_newer_of_the_two(mix):
    """A request runs out of blocks while a newer long prompt is chunked beside it (holding
    its prompt's blocks): the chunked prompt, the newest, is preempted (its request back at
    the head of the queue, read again once blocks are free), not the request decoding beside
    it, which would be recomputed and preempted again at every step while the chunk held the
    blocks. Every output equals a roomy pool's."""
    target = tiny_target(vocab=48, seed=42)
    target.set_feature_layers(None)
    prompt = tuple(random_prompts(1, 48, seed=9, lo=20, hi=21)[0])
    long_prompt = tuple(i % 48 for i in range(3, 63))  # 60 tokens: 4 blocks of 16

    def go(num_blocks: int):
        runner = LocalRunner(target, 4, 96 + 24, num_blocks, 16)
        drafter = Drafter(new_head(target.config, seed=0), target.embed, target.lm_head,
                          max_slots=4, max_len=96)
        engine = Engine(runner, drafter, max_running=4, max_context=96, tree_margin=24)
        engine.prefill_chunk, engine.mix_prompts = 2, mix  # "b" chunked over 30 steps
        out: dict[str, list[int]] = {}
        engine.add(Request("a", prompt, SamplingParams(max_tokens=76, ignore_eos=True),
                           TREES["vanilla"]))
        while engine.has_work():
            if "b" not in out and len(out.get("a", ())) >= 44:  # "a" holds 5 blocks of 9
                engine.add(Request("b", long_prompt, GREEDY, TREES["eagle2"]))
                out["b"] = []
            for e in engine.step():
                out.setdefault(e.seq_id, []).extend(e.token_ids)
        return out, engine

    roomy, plenty = go(400)
    small, engine = go(9)
    assert small == roomy and len(small["a"]) == 76 and len(small["b"]) == 36  # (context)
    assert engine.stats.preemptions == 1 and plenty.stats.preemptions == 0
    # "a" never recomputed; of "b", what it had read past its last full block (its first two
    # blocks, 32 tokens, came back from the prefix cache)
    assert 0 < engine.stats.prefill_tokens - plenty.stats.prefill_tokens < 16
    assert engine.stats.prefix_hit_tokens == 32
    assert engine.paging.blocks.num_free == 9


@pytest.mark.parametrize("mix", [True, False], ids=["mixed", "own-forwards"])
def test_the_running_requests_preempted_beside_an_older_chunked_prompt_resume_exactly(mix):
    """A preempted request resuming in chunks is older than the request running beside it:
    when blocks run out (here: taken from the pool, as another tenant's memory would be) the
    running one is preempted and the chunk goes on alone, one piece a step. Every output
    equals a run without the pressure."""
    target = tiny_target(vocab=48, seed=43)
    prompts = random_prompts(2, 48, seed=12, lo=30, hi=31)
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    def go(pressure: bool):
        engine = paged_engine(target, 60, max_context=128)
        engine.prefill_chunk, engine.mix_prompts = 4, mix
        for i, p in enumerate(prompts):
            engine.add(Request(f"r{i}", tuple(p), params, TREES["eagle2"]))
        out: dict[str, list[int]] = {}
        hog: list[int] = []
        alone = []  # prompt tokens read in steps that left only the chunk
        for step in range(400):
            if pressure and step == 3:  # the older request preempted, as blocks running out
                engine._preempt(next(s for s in engine.seqs if s.req.seq_id == "r0"))
            ch = engine.chunking
            if pressure and step > 3 and not hog and ch is not None and ch.resumed is not None:
                hog = engine.paging.blocks.pool.take(engine.paging.blocks.num_free)
            before = engine.stats.prefill_tokens
            for e in engine.step():
                out.setdefault(e.seq_id, []).extend(e.token_ids)
            if hog and not engine.seqs and engine.chunking is not None:
                alone.append(engine.stats.prefill_tokens - before)
            if alone and hog != [-1]:
                engine.paging.blocks.pool.release(hog)  # the memory comes back
                hog = [-1]
            if not engine.has_work():
                break
        return out, alone, engine

    calm, _, _ = go(False)
    out, alone, engine = go(True)
    assert alone == [4]  # one piece of the chunk in the step it went on alone
    assert engine.stats.preemptions >= 2
    assert out == calm and all(len(v) == 60 for v in out.values())
    assert engine.paging.blocks.num_free == 60


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_reading_blocks_in_place_pages_preempts_and_caches_prefixes():
    """FlexAttention over the paged cache's blocks where they lie (what compiled kernels do on
    CUDA; eager here): with room, prefix-cache hits; with a pool too small, preemptions; a
    long prompt read in chunks beside the running requests; the CUDA-graph runner's padded
    steps over the same cache; every output plain decoding's."""
    from eagle2.flex import FlexBackend

    target = tiny_target(vocab=48, seed=37)
    prompts = shared_prefix_prompts(4, 48, 40, seed=10) + random_prompts(4, 48, seed=11)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    vanilla = run(paged_engine(target, None, max_context=128), prompts, params,
                  TREES["vanilla"])
    whole = paged_engine(target, 200, max_context=384)
    whole.prefill_chunk = 10**6
    expected, _, _ = _late_long_prompt(whole)
    target.backend = FlexBackend(compiled=False, paged_in_place=True)
    for num_blocks in (120, 18):
        engine = paged_engine(target, num_blocks, max_context=128)
        assert engine.runner.cache.head_runs(0)[0].shape[2] == (num_blocks + 1) * 16
        got = run(engine, prompts[:1], params, TREES["eagle2"])
        assert got + run(engine, prompts[1:], params, TREES["eagle2"]) == vanilla, num_blocks
        assert engine.paging.blocks.num_free == num_blocks
        if num_blocks == 120:
            assert engine.stats.prefix_hit_tokens > 0
        else:
            assert engine.stats.preemptions > 0
    chunked = paged_engine(target, 64, max_context=384)
    chunked.prefill_chunk, chunked.mix_prompts = 48, True
    assert _late_long_prompt(chunked)[0] == expected
    assert chunked.stats.mixed_steps == 5
    # CUDA's runner: padded steps by SDPA over entries gathered from the heads-outer blocks,
    # or (graph attention "flex") by FlexAttention over the blocks in place
    for attention in ("sdpa", "flex"):
        graphed = paged_engine(target, 120, max_context=128,
                               runner_cls=functools.partial(GraphedRunner, attention=attention))
        assert run(graphed, prompts[5:], params, TREES["eagle2"]) == vanilla[5:], attention
        assert graphed.runner.counts["padded"] > 0
        assert graphed.runner.info["graph_attention"] == attention
    with pytest.raises(ValueError, match="paged cache"):
        GraphedRunner(target, 2, 64, attention="flex")  # slotted: nothing to read in place
