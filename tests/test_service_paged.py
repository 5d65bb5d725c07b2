"""The service over a paged target cache (docs/kv-cache.md "In the service"): the config's
cache fields, what a K/V budget buys (`runner.cache_layout`: blocks where the target pages,
else the slots that fit), and a real service whose block pool is too small for its requests:
every output is still plain greedy decoding's, requests were preempted, and a prompt sharing a
cached prefix reads it from the prefix cache."""

from __future__ import annotations

import grpc
import pytest
import torch
from conftest import random_prompts, run, save_tiny_target, tiny_target

from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Engine
from eagle2.runner import LocalRunner, cache_layout
from services.config import ServiceConfig

GIB = 1 << 30
# tiny_target's K/V per cache entry in fp32: 2 layers x 2 KV heads x (K + V of 16) x 4 bytes
TOKEN_BYTES = 2 * 2 * 32 * 4


# ----- the config -------------------------------------------------------------------------------
def test_max_batch_size_is_the_older_name_of_max_running():
    assert ServiceConfig().max_running == 64
    assert ServiceConfig(max_batch_size=4).max_running == 4  # existing configs keep theirs
    assert ServiceConfig(max_running=12).max_running == 12
    assert ServiceConfig(max_running=4, max_batch_size=4).max_running == 4
    with pytest.raises(ValueError, match="older name of max_running"):
        ServiceConfig(max_running=8, max_batch_size=4)
    with pytest.raises(ValueError):
        ServiceConfig(max_running=1025)


def test_kv_cache_memory_fractions_need_gpus_and_defaults_follow_the_device():
    with pytest.raises(ValueError, match="needs use_gpu"):
        ServiceConfig(kv_cache_memory=0.5)
    with pytest.raises(ValueError):
        ServiceConfig(kv_cache_memory=0)
    assert ServiceConfig(use_gpu=True, kv_cache_memory=0.5).kv_cache_budget() == 0.5
    assert ServiceConfig().kv_cache_budget() == GIB
    assert ServiceConfig(use_gpu=True).kv_cache_budget() == 0.9
    # beside a draft worker at a 0.1 share: 0.9 of the rank's 0.9
    assert ServiceConfig(use_gpu=True, draft_gpu_fraction=0.1).kv_cache_budget() == 0.81
    # bytes are all ranks' together: each rank holds its share of the KV heads
    assert ServiceConfig(tp_size=4, kv_cache_memory=8 * GIB).rank_kv_cache_memory() == 2 * GIB
    assert ServiceConfig(tp_size=4, use_gpu=True,
                         kv_cache_memory=0.8).rank_kv_cache_memory() == 0.8


@pytest.mark.parametrize("size", [0, 8, 24, 2048])
def test_block_size_must_be_a_multiple_of_16(size):
    with pytest.raises(ValueError, match="block_size"):
        ServiceConfig(block_size=size)
    assert ServiceConfig(block_size=48).block_size == 48


# ----- what a budget buys -----------------------------------------------------------------------
def test_prefill_chunk_defaults_follow_the_device():
    """Chunked prefill's tokens a step: 32 on CPUs (the running streams' p99 inter-token
    latency within 3x their median, benchmarks/service_cache.py), 2,048 on GPUs, else as set."""
    assert ServiceConfig().resolved_prefill_chunk() == 32
    assert ServiceConfig(use_gpu=True).resolved_prefill_chunk() == 2048
    assert ServiceConfig(prefill_chunk=256).resolved_prefill_chunk() == 256
    with pytest.raises(ValueError, match="prefill_chunk"):
        ServiceConfig(prefill_chunk=8)


def test_a_paged_target_gets_the_blocks_its_budget_holds():
    target = tiny_target(seed=41)
    assert target.kv_bytes_per_token() == TOKEN_BYTES == 512
    # 11 blocks of 32 entries x 512 bytes, one of them the null block
    layout = cache_layout(target, 8, 258, kv_cache_memory=11 * 32 * 512 + 100, block_size=32)
    assert (layout.num_slots, layout.num_blocks, layout.block_size) == (8, 10, 32)
    runner = LocalRunner(target, 8, 258, kv_cache_memory=11 * 32 * 512, block_size=32)
    assert runner.paged == (10, 32)
    assert runner.capacity == {"num_slots": 8, "kv_blocks": 10, "block_size": 32,
                               # K and V of 11 blocks, 8 tables of 9 blocks, 8 lengths
                               "kv_cache_bytes": 11 * 32 * 512 + 8 * 9 * 8 + 8 * 8}


def test_a_slotted_target_gets_the_slots_its_budget_holds():
    """One slot of max_len 258 entries: 512 x 258 = 132,096 bytes (and its length, 8)."""
    target = tiny_target(seed=42)
    slot = 512 * 258 + 8
    for budget, slots in ((1 << 20, 7), (100 * slot, 8), (slot - 1, 1), (3 * slot, 3)):
        layout = cache_layout(target, 8, 258, kv_cache_memory=budget, pages=False)
        assert (layout.num_slots, layout.num_blocks) == (slots, None), budget
    assert cache_layout(target, 8, 258, pages=False).num_slots == 8  # no budget: all


def test_a_slotted_runner_runs_the_slots_it_holds(monkeypatch):
    """A target that cannot page (here: told so) keeps a slotted cache of the slots the budget
    holds, and `capacity` says so; the engine runs that many."""
    target = tiny_target(seed=43)
    monkeypatch.setattr(LocalRunner, "can_page", False)
    runner = LocalRunner(target, 8, 258, kv_cache_memory=3 * (512 * 258 + 8))
    assert runner.paged is None and runner.capacity["num_slots"] == 3
    assert runner.capacity["kv_blocks"] is None and runner.capacity["block_size"] is None


def test_the_cuda_graph_runner_pages_a_memory_budget():
    """The CUDA-graph runner keeps max_running slots (and its padded rows' scratch slot) over
    the blocks the budget holds, as `LocalRunner` does."""
    from eagle2.backend import Backend
    from eagle2.cuda_graphs import GraphedRunner

    target = tiny_target(seed=44)
    target.backend = Backend()  # the torch backend's (the CPU backend's is refused)
    per_block = target.kv_bytes_per_token() * 32
    runner = GraphedRunner(target, 8, 258, kv_cache_memory=20 * per_block, graphs=False)
    assert runner.paged == (19, 32)  # the null block out of 20
    assert runner.capacity["num_slots"] == 8 and runner.cache.lengths.shape[0] == 9
    assert GraphedRunner(target, 8, 258, num_blocks=40, graphs=False).paged == (40, 32)


def test_tensor_parallel_ranks_run_the_slots_and_blocks_every_rank_holds():
    from services.tp_runner import _group_capacity

    ranks = [{"num_slots": 8, "kv_blocks": 120, "block_size": 32, "kv_cache_bytes": 10},
             {"num_slots": 8, "kv_blocks": 117, "block_size": 32, "kv_cache_bytes": 9}]
    assert _group_capacity(ranks) == {**ranks[0], "kv_blocks": 117}
    slotted = [{"num_slots": 5, "kv_blocks": None, "block_size": None, "kv_cache_bytes": 1},
               {"num_slots": 4, "kv_blocks": None, "block_size": None, "kv_cache_bytes": 1}]
    assert _group_capacity(slotted)["num_slots"] == 4


# ----- a real service over a small block pool ---------------------------------------------------
PORT, HTTP_PORT = 19310, 18310
MAX_CONTEXT, MAX_TOKENS, VOCAB = 128, 60, 64
# blocks of 32 entries: one request of 128 + 130 entries takes all 9; three of the requests
# below (2 blocks of prompt, 4 with their output and a tree) do not fit
NUM_BLOCKS = 9


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_target(tiny_target(vocab=VOCAB, seed=45), tmp_path_factory.mktemp("t"))


@pytest.fixture(scope="module")
def paged_service(tiny_model):
    """Router -> engine holding the fp32 tiny target (it pages) and an untrained head in the
    replica; 8 running requests at most over NUM_BLOCKS blocks."""
    pytest.importorskip("ray")
    import ray

    from services.cli_serve import start

    conf = {"target": tiny_model, "draft": "untrained", "dtype": "float32",
            "draft_placement": "inprocess", "engine_threads": 1, "max_running": 8,
            "kv_cache_memory": (NUM_BLOCKS + 1) * 32 * TOKEN_BYTES, "block_size": 32,
            "max_context": MAX_CONTEXT, "max_tokens_limit": MAX_TOKENS + 20,
            "default_max_tokens": 16, "grpc_port": PORT,
            "tree": {"mode": "eagle2", "total_tokens": 8, "depth": 3, "top_k": 4,
                     "budget": "fixed"}}
    handle = start(conf, http_port=HTTP_PORT, address="local")
    yield handle
    ray.shutdown()  # Serve goes with the cluster (its graceful stop, ~7 s: test_serve_shutdown)


@pytest.fixture(scope="module")
def plain_greedy(tiny_model):
    """Plain greedy decoding of the same model, one request at a time, slotted."""
    runner = LocalRunner.load(tiny_model, torch.float32, torch.device("cpu"), 1,
                              MAX_CONTEXT + Engine.tree_margin)
    engine = Engine(runner, None, max_running=1, max_context=MAX_CONTEXT)

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return run(engine, prompts, params, TreeConfig("vanilla"))

    return greedy


def test_small_block_pool_preempts_shares_prefixes_and_keeps_greedy_outputs(paged_service,
                                                                              plain_greedy):
    from services.client import Eagle2Client

    prompts = random_prompts(12, VOCAB, seed=46, lo=40, hi=60)
    with Eagle2Client(f"localhost:{PORT}") as client:
        info = client.model_info()
        assert (info.max_batch_size, info.kv_blocks, info.block_size) == (8, NUM_BLOCKS, 32)
        assert info.prefix_caching
        calls = [client.stub.Generate.future(  # all sent at once
            client.request(p, max_tokens=MAX_TOKENS, ignore_eos=True),
            metadata=client.metadata, timeout=300) for p in prompts]
        try:
            outputs = [list(c.result().token_ids) for c in calls]
        except grpc.RpcError as e:  # say where the engine stands
            stats = paged_service.engine_stats.remote().result()
            pytest.fail(f"{e.code()}: {e.details()}; engine: " + str(
                {k: stats[k] for k in ("steps", "active", "preemptions", "kv_free_blocks",
                                       "loop_alive", "loop_steps")}))
        stats = paged_service.engine_stats.remote().result()
        assert stats["preemptions"] > 0, stats  # 3 requests of ~110 entries > 9 x 32
        assert max(stats["batch_sizes"]) <= 8
        assert stats["kv_blocks"] == stats["kv_free_blocks"] == NUM_BLOCKS  # all returned

        # two prompts sharing 3 full blocks: the second reads them from the prefix cache
        gen = torch.Generator().manual_seed(47)
        prefix = torch.randint(0, VOCAB, (100,), generator=gen).tolist()
        shared = [prefix + [1, 2, 3], prefix + [4, 5]]
        shared_out = [list(client.generate(p, max_tokens=20, ignore_eos=True).token_ids)
                      for p in shared]
        after = paged_service.engine_stats.remote().result()
    assert outputs == plain_greedy(prompts, MAX_TOKENS)
    assert shared_out == plain_greedy(shared, 20)
    assert after["prefix_hit_tokens"] - stats["prefix_hit_tokens"] >= 3 * 32
    assert after["prefix_hit_rate"] > 0


@pytest.mark.parametrize("local_rank0", [False, True], ids=["actors", "rank0-here"])
def test_tensor_parallel_ranks_page_preempt_and_keep_greedy_outputs(paged_service, tiny_model,
                                                                    plain_greedy, local_rank0):
    """Two ranks (actors in the service's Ray cluster, or rank 0 in this process as in the
    engine replica on CPUs) over the same budget: each holds one KV head, kv_cache_memory / 2
    bytes and so the same 9 blocks; block tables reach them with the next step; 4 requests of
    ~110 entries are preempted and every output is plain greedy's."""
    from eagle2.drafter import Drafter
    from eagle2.head import new_head
    from eagle2.target import TargetModel
    from services.tp_runner import ShardedRunner

    cfg = ServiceConfig(tp_size=2, kv_cache_memory=(NUM_BLOCKS + 1) * 32 * TOKEN_BYTES)
    runner = ShardedRunner(2, 4, MAX_CONTEXT + Engine.tree_margin, target=tiny_model,
                           dtype="float32", cpus_per_rank=1, block_size=cfg.block_size,
                           kv_cache_memory=cfg.rank_kv_cache_memory(),
                           local_rank0=local_rank0)
    try:
        assert runner.paged == (NUM_BLOCKS, 32) and runner.capacity["num_slots"] == 4
        target = TargetModel.load(tiny_model, dtype="float32", device="cpu")
        drafter = Drafter(new_head(target.config, seed=0), target.embed, target.lm_head,
                          max_slots=4, max_len=MAX_CONTEXT)
        engine = Engine(runner, drafter, max_running=4, max_context=MAX_CONTEXT)
        prompts = random_prompts(6, VOCAB, seed=48, lo=40, hi=60)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        tree = TreeConfig("eagle2", total_tokens=8, depth=3, top_k=4, budget="fixed")
        assert run(engine, prompts, params, tree) == plain_greedy(prompts, MAX_TOKENS)
        assert engine.stats.preemptions > 0
        assert engine.paging.blocks.num_free == NUM_BLOCKS
        for lengths in runner.rank_lengths():
            assert torch.equal(lengths, runner.lengths)
    finally:
        runner.shutdown()


def test_plan_reports_the_blocks_the_service_allocates():
    """`eagle2 plan --kv-cache-memory` for the 70B deployment (tp 4, 112 GiB of K/V): each
    rank's 28 GiB in blocks of 32 entries of 81,920 bytes (its 2 of 8 KV heads), the null
    block left out, as `runner.num_blocks_for` counts them; 261 blocks a sequence of 8192 +
    the engine's tree margin."""
    from eagle2 import plan

    assert plan.layout.TREE_MARGIN == Engine.tree_margin
    model = plan.PRESETS["llama-3.3-70b"]
    p = plan.plan(plan.PlanRequest(model, num_gpus=8, gpu_mem_gib=80, tp_size=4,
                                   context_len=8192, kv_cache_memory=112 * GIB))
    assert p.kv_bytes_per_token_per_gpu == 81_920
    assert p.kv_blocks_per_gpu == 28 * GIB // (81_920 * 32) - 1 == 11_467
    assert p.paged_max_sequences == 11_467 // -(-(8192 + 130) // 32) == 11_467 // 261 == 43
    fraction = plan.plan(plan.PlanRequest(model, num_gpus=8, gpu_mem_gib=80, tp_size=4,
                                          context_len=8192, kv_cache_memory=0.5))
    assert fraction.kv_budget_bytes_per_gpu == (80 * GIB - p.weight_bytes_per_gpu) // 2
