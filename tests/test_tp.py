"""eagle2.tp + services.tp_runner: the tensor-parallel target is lossless.

See docs/tensor-parallel.md "Tensor parallelism".

Real Ray actors, real sharded loading and real gloo all-reduces on CPU, no mocks: through the
engine, a target sharded over tp ranks gives exactly the greedy tokens of the unsharded target
in this process (LocalRunner), with tree verification (eagle2) and without (vanilla), while
requests of different lengths finish and move cache slots; seeded sampling gives the same
tokens too, and no call result that leaves the ranks holds a vocabulary-sized tensor (rank 0
verifies). Every rank's committed lengths are checked against the driver's mirror after every
step.
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter

import pytest
import torch
from conftest import random_prompts, save_tiny_target, tiny_target

from eagle2.config import SamplingParams, TreeConfig
from eagle2.cpu.kernels import exact_bf16_kernels
from eagle2.cpu.native import cpu_ops
from eagle2.drafter import Drafter
from eagle2.engine import Engine, Request
from eagle2.head import new_head
from eagle2.runner import LocalRunner
from eagle2.target import TargetModel
from eagle2.tp import check_tp_size, shard_target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="needs ray (pip install -e '.[serve]')")

MAX_BATCH, MAX_CONTEXT = 3, 256
MAX_TOKENS = (20, 12, 16)  # different lengths: requests finish apart and slots move
TINY_TREES = {"eagle2": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed"),
              "vanilla": TreeConfig("vanilla")}
SMOL_TREES = {"eagle2": TreeConfig("eagle2", total_tokens=8, depth=3, top_k=3, budget="fixed"),
              "vanilla": TreeConfig("vanilla")}


def make_engine(runner, target: TargetModel) -> Engine:
    """An engine over `runner` whose (untrained) head uses the unsharded target's embeddings."""
    head = new_head(target.config, seed=0)
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=MAX_BATCH,
                      max_len=MAX_CONTEXT)
    return Engine(runner, drafter, max_batch=MAX_BATCH, max_context=MAX_CONTEXT)


def generate(engine: Engine, prompts: list[list[int]], tree: TreeConfig
             ) -> tuple[list[list[int]], Counter]:
    """New tokens per prompt and the accepted-draft-length histogram; checks the ranks' cache
    lengths against the driver's mirror after every step (when the runner is sharded)."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_TOKENS[i], ignore_eos=True)
        engine.add(Request(f"s{i}", tuple(p), params, tree))
        out[f"s{i}"] = []
    accepted: Counter = Counter()
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
            if ev.finished:
                accepted.update(ev.accepted_at_depth)
        if hasattr(engine.runner, "rank_lengths"):
            for lengths in engine.runner.rank_lengths():
                assert torch.equal(lengths, engine.runner.lengths)
    return [out[f"s{i}"] for i in range(len(prompts))], accepted


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The driver shares the cores with the rank actors: multi-threaded matmuls oversubscribed
    that way run many times slower (each actor runs one thread too)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=8, include_dashboard=False)  # logical CPUs: ranks oversubscribe 2 cores
    yield
    ray.shutdown()


# ---------------------------------------------------------------- tp=2, tiny random Llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama (4 heads, 2 KV heads, hidden 128: two 64-wide lm_head grains), saved."""
    target = tiny_target(vocab=32, hidden=128, layers=2, heads=4, kv_heads=2, seed=1)
    return target, save_tiny_target(target, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_tp2(ray_cluster, tiny):
    from services.tp_runner import ShardedRunner

    runner = ShardedRunner(2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin, target=tiny[1],
                           dtype="float32", cpus_per_rank=1)
    yield runner
    runner.shutdown()


def test_tp2_shards_hold_one_kv_head_each(tiny_tp2):
    assert tiny_tp2.info == {"vocab_size": 32, "device": "cpu", "dtype": "torch.float32",
                             "local_kv_heads": 1, "backend": "cpu", "attention": "sdpa",
                             "fused": True, "native": False}


@pytest.mark.parametrize("tensor", [
    torch.arange(6).reshape(2, 3), torch.zeros(0, 5), torch.tensor(3.5),
    torch.full((2, 2), 1.5, dtype=torch.bfloat16), torch.tensor([True, False]),
    torch.arange(12.0).reshape(3, 4)[:, 1:3], torch.arange(8).reshape(2, 4).t()],
    ids=["int64", "empty", "scalar", "bf16", "bool", "sliced", "transposed"])
def test_tensor_wire_round_trip_is_exact_and_writable(tensor):
    """What crosses to and from the ranks (the step channel's frames, and Ray's calls beside
    it, as Ray carries what the serializer gives it): same dtype, shape and values; a tensor
    of its own."""
    import pickle

    from eagle2.tp_channel import dumps, loads

    ray_wire = loads(pickle.loads(pickle.dumps(dumps(tensor), protocol=5)))
    channel, = loads(dumps((tensor,)))  # a step message's tensors
    for back in (ray_wire, channel):
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        assert torch.equal(back, tensor)
        back.zero_()  # the rank writes into what it receives (positions, cache indices)


def test_tp1_rank_is_the_whole_model_with_fused_layers(tiny):
    """One rank holds whole weights: no row-parallel sums, so it runs the fused layers of the
    in-process target (the service's tp_size 1 ranks were 1.35x slower at 8 tree tokens)."""
    from eagle2.tp import load_rank

    rank = LocalRunner(load_rank(tiny[1], 1, 0, torch.float32, "cpu"), 1, 64)
    local = LocalRunner(tiny[0], 1, 64)
    assert rank.target.backend.fused is not None
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    args = (tokens, torch.arange(5)[None], torch.ones(5, 5, dtype=torch.bool).tril()[None],
            torch.tensor([0]))
    torch.testing.assert_close(rank.forward(*args)[1], local.forward(*args)[1])


@pytest.fixture(scope="module")
def tiny_expected(tiny):
    """Plain greedy decoding of the unsharded target in this process."""
    prompts = random_prompts(3, 32, seed=1)
    local = LocalRunner(tiny[0], MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    return prompts, generate(make_engine(local, tiny[0]), prompts, TreeConfig("vanilla"))[0]


@pytest.mark.parametrize("mode", ["eagle2", "vanilla"])
def test_tp2_tiny_llama_equals_unsharded_greedy(tiny, tiny_tp2, tiny_expected, mode):
    prompts, expected = tiny_expected
    got, accepted = generate(make_engine(tiny_tp2, tiny[0]), prompts, TINY_TREES[mode])
    assert got == expected
    assert [len(g) for g in got] == list(MAX_TOKENS)
    if mode == "eagle2":  # some drafts were accepted: commit gathered tree entries on each rank
        assert sum(n for depth, n in accepted.items() if depth > 0) > 0


@pytest.mark.skipif(not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")),
                    reason="bf16 verification is exact only with the CPU's exact bf16 kernels")
def test_tp2_bf16_shards_run_fused_layers_and_speculation_equals_their_plain_decoding(
        ray_cluster, tiny):
    """A bf16 shard runs the CPU backend's fused layers with o and down summed over the ranks
    (`FusedLayer.reduce`) and the native attention over its paged cache, and stays exact:
    tree verification gives its own plain decoding's tokens bit for bit."""
    from services.tp_runner import ShardedRunner

    runner = ShardedRunner(2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin, target=tiny[1],
                           dtype="bfloat16", cpus_per_rank=1, block_size=32,
                           kv_cache_memory=2**22)
    try:
        assert runner.info["fused"] and runner.info["attention"] == (
            "native-exact" if cpu_ops() is not None else "exact")
        assert runner.paged is not None
        prompts = random_prompts(3, 32, seed=5)
        plain, _ = generate(make_engine(runner, tiny[0]), prompts, TINY_TREES["vanilla"])
        spec, accepted = generate(make_engine(runner, tiny[0]), prompts, TINY_TREES["eagle2"])
        assert spec == plain
        assert sum(n for depth, n in accepted.items() if depth > 0) > 0
    finally:
        runner.shutdown()


def test_tp2_greedy_steps_gather_an_argmax_pair_a_row_never_the_logits(tiny, tiny_tp2,
                                                                        tiny_expected):
    """A shard's greedy verification takes the argmax through the vocabulary-parallel lm_head
    (each rank's (max, index) per row: [tp, rows, 2] gathered) in one collective a step, not
    the [rows, V / tp] logits of every rank; the tokens stay the unsharded target's."""
    import ray

    def _count_lm_head_calls(_rank):  # (in a rank actor; nested: Ray sends it by value)
        import eagle2.tp as tp

        head = tp.VocabParallelLMHead
        calls = tp.__dict__.setdefault("_test_calls", {"logits": 0, "greedy": 0})
        if not hasattr(head, "_test_saved"):
            head._test_saved = (head.forward, head.greedy_tokens)
            forward, greedy = head._test_saved

            def counted_forward(self, x):
                calls["logits"] += 1
                return forward(self, x)

            def counted_greedy(self, x):
                calls["greedy"] += 1
                return greedy(self, x)

            head.forward, head.greedy_tokens = counted_forward, counted_greedy
        return dict(calls)

    def _restore_lm_head(_rank):
        import eagle2.tp as tp

        head = tp.VocabParallelLMHead
        head.forward, head.greedy_tokens = head._test_saved
        del head._test_saved
        del tp._test_calls

    ray.get([a.__ray_call__.remote(_count_lm_head_calls) for a in tiny_tp2.actors])
    try:
        steps = tiny_tp2.traffic["steps"]
        prompts, expected = tiny_expected
        got, _ = generate(make_engine(tiny_tp2, tiny[0]), prompts, TINY_TREES["eagle2"])
        assert got == expected
        calls = ray.get(tiny_tp2.actors[0].__ray_call__.remote(_count_lm_head_calls))
        assert calls["logits"] == 0 and calls["greedy"] > 0
        assert calls["greedy"] <= tiny_tp2.traffic["steps"] - steps  # one a runner call
    finally:
        ray.get([a.__ray_call__.remote(_restore_lm_head) for a in tiny_tp2.actors])


def tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors_in(x)]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in tensors_in(getattr(obj, name))]
    return []


def test_tp2_sampling_equals_unsharded_and_no_logits_leave_the_ranks(tiny, tiny_tp2, monkeypatch):
    """Seeded sampling through rank-0 verification gives the in-process tokens; every result
    the ranks return holds token ids, node indices and features [.., H] only."""
    from conftest import run

    prompts = random_prompts(3, 32, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, ignore_eos=True)
    tree = TINY_TREES["eagle2"]
    local = LocalRunner(tiny[0], MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    expected = run(make_engine(local, tiny[0]), prompts, params, tree, seeds=[1, 2, 3])
    results: list = []
    receive = tiny_tp2._receive
    monkeypatch.setattr(tiny_tp2, "_receive", lambda ranks: results.append(receive(ranks))
                        or results[-1])
    before = dict(tiny_tp2.traffic)
    got = run(make_engine(tiny_tp2, tiny[0]), prompts, params, tree, seeds=[1, 2, 3])
    assert got == expected
    shapes = [tuple(t.shape) for r in results for t in tensors_in(r)]
    assert shapes and all(s[-1] != 32 for s in shapes if len(s) >= 2)  # no [.., V] tensor
    assert tiny_tp2.traffic["bytes_in"] > before.get("bytes_in", 0)


def test_tp2_prompts_ride_in_the_verification_forward(tiny, tiny_tp2):
    """A long prompt arriving while a request decodes is read 8 tokens a step inside its
    verification forward on every rank (one message a step), and a short one arriving next is
    prefilled in the forward of its last piece (three groups: the step's budget of 8 prompt
    tokens left 5); their first tokens are sampled (seeded) with the generator states sent
    with them; every token equals in-process."""

    def late_long_prompt(runner) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(runner, tiny[0])
        engine.prefill_chunk = 8
        out: dict[str, list[int]] = {}
        for i, p in enumerate(random_prompts(1, 32, seed=11)):  # (rows: it, short, chunk)
            engine.add(Request(f"s{i}", tuple(p), SamplingParams(max_tokens=24, ignore_eos=True),
                               TINY_TREES["eagle2"]))
        step = 0
        while engine.has_work():
            if step == 1:
                engine.add(Request("long", tuple(i % 32 for i in range(5, 40)),
                                   SamplingParams(temperature=0.9, seed=7, max_tokens=6,
                                                  ignore_eos=True), TINY_TREES["vanilla"]))
            if step == 2:
                engine.add(Request("short", (3, 1, 4, 1, 5),
                                   SamplingParams(temperature=0.9, seed=8, max_tokens=4,
                                                  ignore_eos=True), TINY_TREES["vanilla"]))
            for ev in engine.step():
                out.setdefault(ev.seq_id, []).extend(ev.token_ids)
            step += 1
        return out, engine.stats.mixed_steps

    local = LocalRunner(tiny[0], MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    expected, local_mixed = late_long_prompt(local)
    got, mixed = late_long_prompt(tiny_tp2)
    assert got == expected and len(got["long"]) == 6 and len(got["short"]) == 4
    assert mixed == local_mixed == 5  # 35 tokens in chunks of 8, the short one beside the last


def test_tp2_with_an_eagle3_head_equals_unsharded_greedy(ray_cluster, tiny, tiny_expected):
    """The ranks return the inputs of the head's three layers as features ([.., 3H])."""
    from eagle2.eagle3 import new_eagle3_head
    from services.tp_runner import ShardedRunner

    prompts, expected = tiny_expected
    head = new_eagle3_head(tiny[0].config, seed=0, aux_layer_ids=(-1, 0, 0))
    layers = head.feature_layers(tiny[0].num_layers)
    runner = ShardedRunner(2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin, target=tiny[1],
                           cpus_per_rank=1, feature_layers=layers)
    try:
        drafter = Drafter(head, tiny[0].embed, tiny[0].lm_head, max_slots=MAX_BATCH,
                          max_len=MAX_CONTEXT)
        engine = Engine(runner, drafter, max_batch=MAX_BATCH, max_context=MAX_CONTEXT)
        got, _ = generate(engine, prompts, TINY_TREES["eagle2"])
        feats, _ = runner.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]),
                                  torch.ones(1, 2, 2, dtype=torch.bool), torch.tensor([0]))
    finally:
        runner.shutdown()
    assert got == expected
    assert feats.shape[-1] == 3 * tiny[0].config.hidden_size


def test_tp2_cost_grid_is_timed_through_verify_step_without_logits(tiny_tp2, monkeypatch):
    """The cost grid times the steps' call (`budget.time_grid`): only token ids and accepted
    features come back from rank 0, never the [B, N, V] logits `forward` returns."""
    from eagle2.budget import time_grid

    methods: list[str] = []
    results: list = []
    call, receive = tiny_tp2._all, tiny_tp2._receive
    monkeypatch.setattr(tiny_tp2, "_all", lambda method, *args, **kwargs: methods.append(
        method) or call(method, *args, **kwargs))
    monkeypatch.setattr(tiny_tp2, "_receive", lambda ranks: results.append(receive(ranks))
                        or results[-1])
    grid = time_grid(tiny_tp2, (1, 2), (1, 4), prefix=4, passes=1)
    assert len(grid) == 2 and all(t > 0 for row in grid for t in row)
    assert methods.count("verify_step") == 1 + 4 and "forward" not in methods
    shapes = [tuple(t.shape) for r in results for t in tensors_in(r)]
    assert shapes and all(s[-1] != 32 for s in shapes if len(s) >= 2)  # no [.., V] tensor


def test_steps_make_no_ray_call_and_only_rank_0_replies(tiny, tiny_tp2, tiny_expected,
                                                         monkeypatch):
    """After the start, a step is one frame a rank on the step channel and one reply from
    rank 0: no Ray call, whatever the number of steps (the Ray calls are counted at the
    source: every `.remote` the runner makes to an actor goes through `actors`)."""
    prompts, expected = tiny_expected
    sent: list[str] = []

    class Counted:  # wraps each actor handle: records every method called on it
        def __init__(self, actor):
            self.actor = actor

        def __getattr__(self, name):
            sent.append(name)
            return getattr(self.actor, name)

    checks = []  # `generate` asks every rank for its lengths after each step
    rank_lengths = tiny_tp2.rank_lengths
    monkeypatch.setattr(tiny_tp2, "rank_lengths", lambda: checks.append(1) or rank_lengths())
    actors = tiny_tp2.actors
    tiny_tp2.actors = [Counted(a) for a in actors]
    before = dict(tiny_tp2.traffic)
    try:
        got, _ = generate(make_engine(tiny_tp2, tiny[0]), prompts, TreeConfig("vanilla"))
    finally:
        tiny_tp2.actors = actors
    assert got == expected
    messages = tiny_tp2.traffic["steps"] - before.get("steps", 0)
    assert messages - len(checks) >= max(MAX_TOKENS) and sent == []
    assert tiny_tp2.traffic["frames_out"] - before.get("frames_out", 0) == 2 * messages
    # replies: rank 0's to each step, both ranks' to each lengths check
    assert tiny_tp2.traffic["frames_in"] - before.get("frames_in", 0) == \
        messages + len(checks)


@pytest.mark.slow  # tests/test_service_faults.py covers it through the service
def test_a_killed_rank_fails_the_next_step_and_the_health_check_at_once(ray_cluster, tiny):
    """kill -9 of a rank between steps: the health check sees its connection end (no step,
    no timeout), and a step sent to a group with a killed rank fails with RankFailure within
    seconds, not after the 300 s timeout (its peer's all-reduce reads the closed socket)."""
    import os
    import signal

    import ray

    from services.tp_runner import RankFailure, ShardedRunner

    def pid(actor) -> int:
        return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)

    args = (2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    for check in (True, False):
        runner = ShardedRunner(*args, target=tiny[1], dtype="float32", cpus_per_rank=1,
                               timeout_s=300)
        try:
            engine = make_engine(runner, tiny[0])
            engine.add(Request("a", (1, 2, 3), SamplingParams(max_tokens=50, ignore_eos=True),
                               TreeConfig("vanilla")))
            engine.step()
            runner.check_health()  # all alive: nothing raised
            os.kill(pid(runner.actors[1]), signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RankFailure, match=r"rank \d: "):
                if check:
                    while time.monotonic() - t0 < 30:
                        runner.check_health()
                        time.sleep(0.05)
                else:
                    while engine.has_work():
                        engine.step()
            assert time.monotonic() - t0 < 30
            with pytest.raises(RankFailure, match="failed earlier"):
                runner.rank_lengths()
        finally:
            runner.shutdown()


@pytest.mark.slow  # tests/test_service_faults.py covers it through the service
def test_a_rank_task_that_raises_fails_the_group_at_once(ray_cluster, tiny, tiny_expected):
    """Rank 1 runs out of memory in a step (an injected fault: its task raises before the
    forward) while rank 0 waits for it in the forward's all-reduce: the call fails at once
    with RankFailure naming the rank, every rank is killed (none is left in the collective,
    where gloo would hold it for 30 minutes and the next call would wait out the runner's
    timeout), later calls refuse, and a rebuilt group decodes the unsharded target's tokens.
    Before, the call raised the task's error as it was (INTERNAL to the service, no rebuild)
    and rank 0 stayed in its all-reduce."""
    import ray

    from services.tp_runner import RankFailure, ShardedRunner

    prompts, expected = tiny_expected
    args = (2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    runner = ShardedRunner(*args, target=tiny[1], dtype="float32", cpus_per_rank=1,
                           timeout_s=300)
    try:
        actors = list(runner.actors)
        # calls: prefill, its lengths check, a step, its check, then the step rank 1 fails
        runner.inject_fault(1, after_calls=5)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1: OutOfMemoryError in verify_step"):
            generate(make_engine(runner, tiny[0]), prompts, TINY_TREES["vanilla"])
        assert time.monotonic() - t0 < 60
        for actor in actors:  # gone, not waiting in the all-reduce
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.lengths.remote(), timeout=60)
        with pytest.raises(RankFailure, match="failed earlier"):
            runner.rank_lengths()
    finally:
        runner.shutdown()
    rebuilt = ShardedRunner(*args, target=tiny[1], dtype="float32", cpus_per_rank=1)
    try:
        assert generate(make_engine(rebuilt, tiny[0]), prompts, TINY_TREES["eagle2"])[0] == \
            expected
    finally:
        rebuilt.shutdown()


# ---------------------------------------------------------------- rank 0 in the driver


def local_rank0_runner(tiny, **kw):
    from services.tp_runner import ShardedRunner

    return ShardedRunner(2, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin, target=tiny[1],
                         dtype="float32", cpus_per_rank=1, local_rank0=True, **kw)


def test_rank_0_in_the_driver_equals_unsharded_with_one_frame_a_step(ray_cluster, tiny,
                                                                     tiny_expected):
    """local_rank0 (the service's engine replica on CPUs): rank 0 runs in this process, rank
    1 on an actor. Greedy (tree and plain) and seeded sampling give the unsharded target's
    tokens, and log-probabilities the whole text's; a step is one frame to rank 1 and nothing
    back (its only replies are the lengths checks), and rank 1 follows (its verifications are
    the forward and the gather, from a message without the trees); the process group and the
    socket group are left on shutdown."""
    import ray
    import torch.distributed as dist
    from conftest import run
    from test_logprobs import check as check_logprobs
    from test_logprobs import generate as generate_logprobs
    from test_logprobs import reference

    prompts, expected = tiny_expected
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=10, ignore_eos=True)
    local = LocalRunner(tiny[0], MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    sampled = run(make_engine(local, tiny[0]), prompts, params, TINY_TREES["eagle2"],
                  seeds=[1, 2, 3])
    runner = local_rank0_runner(tiny)
    try:
        assert runner.local is not None and len(runner.actors) == 1 and dist.is_initialized()
        assert runner.info["local_kv_heads"] == 1
        for mode in ("vanilla", "eagle2"):
            checks: list = []
            lengths = runner.rank_lengths
            runner.rank_lengths = lambda: checks.append(1) or lengths()  # noqa: B023
            before = dict(runner.traffic)
            got, accepted = generate(make_engine(runner, tiny[0]), prompts, TINY_TREES[mode])
            del runner.rank_lengths
            assert got == expected
            steps = runner.traffic["steps"] - before.get("steps", 0)
            assert runner.traffic["frames_out"] - before.get("frames_out", 0) == steps
            assert runner.traffic["frames_in"] - before.get("frames_in", 0) == len(checks)
        assert sum(n for depth, n in accepted.items() if depth > 0) > 0
        assert run(make_engine(runner, tiny[0]), prompts, params, TINY_TREES["eagle2"],
                   seeds=[1, 2, 3]) == sampled
        # log-probabilities (the logits' gather, then rank 0 alone reads them) are the
        # target's own: a forward of the whole text through the unsharded model
        asked = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)] * len(prompts)
        for tree in (TINY_TREES["eagle2"], TINY_TREES["vanilla"]):
            got = generate_logprobs(make_engine(runner, tiny[0]), prompts, asked, tree)
            for prompt, (tokens, lps) in zip(prompts, got, strict=True):
                check_logprobs(reference(tiny[0], prompt, tokens), tokens, lps, 3)
        follower, calls = ray.get(runner.actors[0].__ray_call__.remote(
            lambda rank: (rank.runner.follower, dict(rank.calls))))
        assert follower and not runner.local.runner.follower
        assert calls["follow_verify"] > 0 and "verify_step" not in calls
    finally:
        runner.shutdown()
    assert not dist.is_initialized() and runner.local is None


def test_rank_0_in_the_driver_fails_at_once_with_the_rank_that_failed_and_rebuilds(
        ray_cluster, tiny, tiny_expected):
    """Rank 0 in this process waits in its collectives for rank 1; rank 1's step raising
    (out of memory, injected) or its process killed ends that wait at once (rank 0 watches
    the channel: `SocketGroup.watch`) with RankFailure naming rank 1, and rank 0's own error
    names rank 0 (rank 1 is killed, not left in the collective); rank 1 hanging in its step
    fails the call after the runner's timeout (5 s here), not the socket group's 30 minutes.
    Every failure leaves the process group, and a group rebuilt in this same process decodes
    the unsharded tokens."""
    import os
    import signal

    import ray
    import torch.distributed as dist

    from services.tp_runner import RankFailure

    prompts, expected = tiny_expected
    cases = [(1, r"rank 1: OutOfMemoryError in verify_step"),
             (0, r"rank 0: OutOfMemoryError in verify_step"),
             ("kill", r"rank 1: process gone"),
             ("hang", r"no rank answered: TimeoutError in prefill_parts")]
    for fault, message in cases:
        runner = local_rank0_runner(tiny, timeout_s=300)
        actor = runner.actors[0]
        try:
            if fault == "kill":
                engine = make_engine(runner, tiny[0])
                engine.add(Request("a", (1, 2, 3), SamplingParams(max_tokens=50,
                                                                  ignore_eos=True),
                                   TreeConfig("vanilla")))
                engine.step()
                runner.check_health()  # all alive
                pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
                os.kill(pid, signal.SIGKILL)
                run_it = engine.step
            elif fault == "hang":  # rank 1's next call sleeps (set beside its step loop)
                from eagle2.tp import socket_group

                runner.timeout_s = 5.0  # (after the start, which the timeout bounds too)
                socket_group(runner.local.runner.target.hf).watch(runner._channel.sockets, 5.0)
                ray.get(actor.__ray_call__.remote(
                    lambda rank: setattr(rank, "run", lambda *a: time.sleep(3600))), timeout=60)

                def run_it(r=runner):
                    generate(make_engine(r, tiny[0]), prompts, TINY_TREES["vanilla"])
            else:  # prefill, its lengths check, a step, its check, then the failing step
                runner.inject_fault(fault, after_calls=5)

                def run_it(r=runner):
                    generate(make_engine(r, tiny[0]), prompts, TINY_TREES["vanilla"])
            t0 = time.monotonic()
            with pytest.raises(RankFailure, match=message):
                for _ in range(100):
                    run_it()
            assert time.monotonic() - t0 < 30
            assert not dist.is_initialized()
            with pytest.raises(ray.exceptions.RayActorError):  # gone, not in a collective
                ray.get(actor.lengths.remote(), timeout=60)
        finally:
            runner.shutdown()
    rebuilt = local_rank0_runner(tiny)
    try:
        assert generate(make_engine(rebuilt, tiny[0]), prompts, TINY_TREES["eagle2"])[0] == \
            expected
    finally:
        rebuilt.shutdown()


def test_rank_0_in_the_driver_is_refused_on_gpus_and_alone(tiny):
    from services.tp_runner import ShardedRunner

    for kw in ({"use_gpu": True}, {"tp_size": 1}):
        args = {"tp_size": 2, **kw}
        with pytest.raises(ValueError, match="local_rank0 runs rank 0 of a CPU group"):
            ShardedRunner(args.pop("tp_size"), MAX_BATCH, 64, target=tiny[1],
                          local_rank0=True, **args)


# ---------------------------------------------------------------- tp=3, embedded SmolLM2


@pytest.fixture(scope="module")
def smol_target():
    return TargetModel.load(dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def smol_tp3(ray_cluster, smol_target):
    from services.tp_runner import ShardedRunner

    runner = ShardedRunner(3, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin, target=None,
                           dtype="float32", cpus_per_rank=1)
    yield runner
    runner.shutdown()


@pytest.fixture(scope="module")
def smol_expected(smol_target):
    texts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
    prompts = [smol_target.tokenizer(t)["input_ids"] for t in texts]
    local = LocalRunner(smol_target, MAX_BATCH, MAX_CONTEXT + Engine.tree_margin)
    return prompts, generate(make_engine(local, smol_target), prompts, TreeConfig("vanilla"))[0]


@pytest.mark.parametrize("mode", ["eagle2", "vanilla"])
def test_tp3_smollm2_equals_unsharded_greedy(smol_target, smol_tp3, smol_expected, mode):
    assert smol_tp3.info["local_kv_heads"] == 1  # 3 KV heads over 3 ranks
    prompts, expected = smol_expected
    got, _ = generate(make_engine(smol_tp3, smol_target), prompts, SMOL_TREES[mode])
    assert got == expected
    assert [len(g) for g in got] == list(MAX_TOKENS)


# ---------------------------------------------------------------- refused layouts


def test_tp_sizes_that_do_not_split_the_kv_heads_are_refused(smol_target):
    from services.tp_runner import ShardedRunner

    smol = smol_target.config  # 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        check_tp_size(smol, 4)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention / 3 KV"):
        check_tp_size(smol, 2)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        check_tp_size(smol, 0)
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        ShardedRunner(4, 1, 64)  # refused on the driver: no placement group, no actors


def test_shard_target_needs_the_process_group():
    target = tiny_target(hidden=128, heads=4, kv_heads=2)
    assert shard_target(target, 1).local_kv_heads() == 2  # tp=1: the model as it is
    with pytest.raises(ValueError, match="needs init_tp with world_size 2 first"):
        shard_target(target, 2)


def _settled_cpus(quiet_s: float = 1.5, limit_s: float = 30.0) -> float | None:
    """Ray's available CPUs once they have not changed for `quiet_s` (placement group removal
    returns its bundles asynchronously)."""
    import ray

    value, since, deadline = ray.available_resources().get("CPU"), time.monotonic(), \
        time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = ray.available_resources().get("CPU")
        if now != value:
            value, since = now, time.monotonic()
    return value


def test_a_rank_that_fails_to_start_raises_and_releases_its_bundles(ray_cluster, tmp_path):
    import ray

    from services.tp_runner import ShardedRunner

    before = _settled_cpus()  # an earlier test's released group may still be returning
    with pytest.raises(ValueError, match="does not exist"):
        ShardedRunner(1, 1, 64, target=str(tmp_path / "no-such-model.gguf"))
    tables = ray.util.placement_group_table().values()
    assert all(t["state"] == "REMOVED" for t in tables if t["strategy"] == "STRICT_PACK"
               and len(t["bundles"]) == 1)
    deadline = time.monotonic() + 30  # the removal is asynchronous
    while ray.available_resources().get("CPU") != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == before
