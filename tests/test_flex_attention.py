"""Tree attention through FlexAttention (`eagle2.flex`) equals the dense-mask reference.

The reference is `attention.cached_attention` over `attention.step_inputs`' dense mask (SDPA,
fp32). On this CPU FlexAttention runs eagerly (it evaluates the mask_mod over every score and
ignores the block lists), so the block lists are checked on their own against the dense mask,
and once through the compiled CPU kernel, which visits only the listed blocks. See the module
docstring of eagle2/flex.py for what the CPU cannot show about the CUDA kernels.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target

from eagle2.attention import KVCache, cached_attention, causal_mask, step_inputs
from eagle2.backend import Backend
from eagle2.config import SamplingParams, TreeConfig
from eagle2.devices import ATTENTION_ENV, backend_for
from eagle2.flex import (
    BLOCK,
    FlexBackend,
    FlexHeadKernels,
    FlexWindow,
    PagedFlexWindow,
    flex_cached_attention,
    flex_step_inputs,
)

# eager FlexAttention warns once that it is not compiled: that is what these tests ask for
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

HEAD_DIM = 16
ATOL = 2e-6  # fp32: the two kernels sum the same products in different orders


def identity_rope(like: torch.Tensor, positions: torch.Tensor):
    """cos, sin [B, N, Dh] of no rotation (the attention, not RoPE, is under test)."""
    shape = (*positions.shape, HEAD_DIM)
    return torch.ones(shape), torch.zeros(shape)


def random_tree_mask(num_n: int, gen: torch.Generator) -> torch.Tensor:
    """[N, N] ancestor mask (itself included) of a random tree: node i's parent is a random
    earlier node, node 0 the root."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_n)]
    mask = torch.zeros(num_n, num_n, dtype=torch.bool)
    for i in range(num_n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_cache(lengths: list[int], kv_heads: int, max_len: int, seed: int) -> KVCache:
    """One layer's cache of len(lengths) slots with random K/V everywhere (stale entries past
    each length must stay unseen) and these committed lengths."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(1, len(lengths), kv_heads, max_len, HEAD_DIM, torch.float32, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.lengths.copy_(torch.tensor(lengths))
    return cache


def copy_cache(cache: KVCache) -> KVCache:
    return KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())


def compare(lengths: list[int], slots: list[int], num_n: int, heads: int, kv_heads: int,
            window: int | None = None, compiled: bool = False, seed: int = 0,
            max_len: int | None = None) -> FlexWindow:
    """Flex against the dense reference for one batch of trees (random, one per request) after
    these slot lengths: outputs, the cache after the writes, and the block lists."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max_len or max(lengths) + num_n + 3
    cache = random_cache(lengths, kv_heads, max_len, seed)
    flex_cache = copy_cache(cache)
    slot_t = torch.tensor(slots)
    num_b = len(slots)
    tree = torch.stack([random_tree_mask(num_n, gen) for _ in range(num_b)])  # [B, N, N]
    positions = cache.lengths[slot_t][:, None] + tree.sum(-1) - 1  # [B, N] depth positions
    q = torch.randn(num_b, heads, num_n, HEAD_DIM, generator=gen)  # [B, Hq, N, Dh]
    k = torch.randn(num_b, kv_heads, num_n, HEAD_DIM, generator=gen)  # [B, KVH, N, Dh]
    v = torch.randn(num_b, kv_heads, num_n, HEAD_DIM, generator=gen)
    ref_inp = step_inputs(cache, slot_t, tree, positions, identity_rope, q, window)
    ref = cached_attention(q, k, v, cache, 0, ref_inp)  # [B, Hq, N, Dh]
    inp = flex_step_inputs(flex_cache, slot_t, tree, positions, identity_rope, q, window,
                           compiled=compiled)
    assert inp.mask is None  # no dense mask
    out = flex_cached_attention(q, k, v, flex_cache, 0, inp)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    assert torch.equal(flex_cache.k, cache.k) and torch.equal(flex_cache.v, cache.v)
    check_block_lists(inp.window, ref_inp.mask[:, 0], num_n)
    return inp.window


def check_block_lists(found: FlexWindow, dense: torch.Tensor, num_n: int,
                      kv_block: int = BLOCK, kv_len: int | None = None) -> None:
    """The block mask against the dense one (dense: [B, N, S_used] bool): the listed blocks
    are exactly those with a key some query of the query block sees (so the unused cache
    and, with a window, the hidden prefix are skipped), none is listed twice, and every block
    listed as full is all visible. kv_block, kv_len: the key blocks' size and the keys (a
    paged window's: the cache's blocks, all of them)."""
    bm = found.block_mask
    kv_len = kv_len or found.kv_len
    num_b, _, s_used = dense.shape
    num_kv, num_q = -(-kv_len // kv_block), -(-num_n // BLOCK)
    padded = torch.zeros(num_b, num_q * BLOCK, num_kv * kv_block, dtype=torch.bool)
    padded[:, :num_n, :s_used] = dense
    blocks = padded.view(num_b, num_q, BLOCK, num_kv, kv_block)
    rows = torch.zeros(num_b, num_q * BLOCK, dtype=torch.bool)
    rows[:, :num_n] = True
    rows = rows.view(num_b, num_q, BLOCK, 1, 1)
    cols = torch.zeros(num_kv * kv_block, dtype=torch.bool)
    cols[:kv_len] = True
    cols = cols.view(1, 1, 1, num_kv, kv_block)
    needed = blocks.any(4).any(2)  # [B, Qb, K]
    all_seen = (blocks | ~(rows & cols)).all(4).all(2)  # [B, Qb, K] (padding counts as seen)

    def as_dense(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(num_b, num_q, num_kv, dtype=torch.int32)
        for b in range(num_b):
            for i in range(num_q):
                for j in idx[b, 0, i, : int(num[b, 0, i])].tolist():
                    out[b, i, j] += 1
        return out

    partial = as_dense(bm.kv_num_blocks, bm.kv_indices)
    full = as_dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    listed = partial + full
    assert int(listed.max()) <= 1, "a block listed twice"
    assert torch.equal(listed.bool(), needed), "the listed blocks are not the visible ones"
    assert bool((all_seen >= full.bool()).all()), "a block listed as full has hidden keys"


@pytest.mark.parametrize("num_n", [1, 9, 64])
@pytest.mark.parametrize("slots", ["contiguous", "scattered"])
def test_flex_equals_dense_reference_across_block_boundaries(num_n, slots):
    """Prefixes of 1 to 5,000 tokens, around the block size (127, 128, 129, 255, 256, 257)
    and a tree of each size, GQA (8 query heads on 2 KV heads)."""
    lengths = [127, 1, 4999, 128, 129, 255, 256, 257, 0]
    order = list(range(len(lengths)))
    if slots == "scattered":  # a batch of fewer requests than slots, in another order
        order = [3, 0, 4, 2, 7, 5]
    compare(lengths, order, num_n, heads=8, kv_heads=2, seed=num_n)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 1)])
def test_flex_equals_dense_reference_other_head_groups(heads, kv_heads):
    compare([130, 5, 383], [2, 0, 1], 13, heads, kv_heads, seed=heads)


@pytest.mark.parametrize("window", [16, 200])
def test_flex_sliding_window_equals_dense_reference(window):
    """The draft head's sliding window: prefix entries older than base - window hidden, so
    blocks are skipped at both ends and a ragged block opens the prefix."""
    compare([1000, 129, 40, 700], [1, 3, 0], 7, heads=4, kv_heads=2, window=window,
            seed=window)


def compare_paged(lengths: list[int], slots: list[int], num_n: int, heads: int, kv_heads: int,
                  block_size: int = 16, compiled: bool = False, seed: int = 0,
                  device: str = "cpu", dtype: torch.dtype = torch.float32,
                  atol: float = ATOL) -> None:
    """Flex reading a paged cache's blocks in place (`PagedFlexWindow`) against the dense
    reference over the same cache laid out as by default: outputs, the cache after the
    writes, and the block lists against the dense mask moved to where each position's entry
    lies. The blocks are handed out in a random order; a block is shared by two requests
    (a cached prefix) where their lengths allow."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(lengths) + num_n + 3
    per_slot = -(-max_len // block_size)
    num_blocks = len(lengths) * per_slot + 3
    caches = [KVCache.allocate_paged(1, len(lengths), num_blocks, block_size, max_len,
                                     kv_heads, HEAD_DIM, dtype, device, heads_outer=h)
              for h in (False, True)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [order[s * per_slot:(s + 1) * per_slot] for s in range(len(lengths))]
    if len(lengths) > 1 and min(lengths[:2]) >= block_size:
        tables[1][0] = tables[0][0]  # a shared first block, as prefix caching makes
    k_all = torch.randn(caches[0].k.shape, generator=gen)
    v_all = torch.randn(caches[0].v.shape, generator=gen)
    for cache in caches:
        cache.k.copy_(k_all)
        cache.v.copy_(v_all)
        cache.lengths.copy_(torch.tensor(lengths))
        for s, blocks in enumerate(tables):
            cache.set_blocks(s, blocks)
    ref_cache, flex_cache = caches
    slot_t = torch.tensor(slots, device=device)
    num_b = len(slots)
    tree = torch.stack([random_tree_mask(num_n, gen) for _ in range(num_b)]).to(device)
    positions = ref_cache.lengths[slot_t][:, None] + tree.sum(-1) - 1  # [B, N]
    q, k, v = (torch.randn(num_b, h, num_n, HEAD_DIM, generator=gen).to(device, dtype)
               for h in (heads, kv_heads, kv_heads))

    def rope(like, pos):  # no rotation (the attention, not RoPE, is under test)
        shape = (*pos.shape, HEAD_DIM)
        return (torch.ones(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype))

    ref_inp = step_inputs(ref_cache, slot_t, tree, positions, rope, q)
    ref = cached_attention(q, k, v, ref_cache, 0, ref_inp)
    inp = flex_step_inputs(flex_cache, slot_t, tree, positions, rope, q, compiled=compiled,
                           in_place=True)
    assert isinstance(inp.window, PagedFlexWindow) and inp.mask is None
    out = flex_cached_attention(q, k, v, flex_cache, 0, inp)
    torch.testing.assert_close(out, ref, atol=atol, rtol=max(atol, 1e-5))
    assert torch.equal(flex_cache.k, ref_cache.k) and torch.equal(flex_cache.v, ref_cache.v)
    dense = ref_inp.mask[:, 0].cpu()  # [B, N, S] by position
    pool = (num_blocks + 1) * block_size
    where = torch.zeros(num_b, num_n, pool, dtype=torch.bool)  # by where the entry lies
    for b, slot in enumerate(slots):
        pos = torch.arange(dense.shape[-1])
        table = flex_cache.block_tables[slot].cpu()
        where[b][:, table[pos // block_size] * block_size + pos % block_size] = dense[b]
    bm = inp.window.block_mask
    lists = PagedFlexWindow(bm.to("cpu") if device != "cpu" else bm, block_size, compiled)
    check_block_lists(lists, where, num_n, kv_block=block_size, kv_len=pool)


@pytest.mark.parametrize("num_n", [1, 9, 130])
@pytest.mark.parametrize("block_size", [16, 32])
def test_flex_reading_paged_blocks_in_place_equals_dense_reference(num_n, block_size):
    """Ragged prefixes across block boundaries, scattered slots, GQA, a shared block, trees
    of one node, of nine and of two query blocks."""
    compare_paged([31, 32, 47, 100], [2, 0, 3], num_n, heads=4, kv_heads=2,
                  block_size=block_size, seed=num_n + block_size)


def test_the_cache_blocks_are_read_where_they_lie():
    """`KVCache.head_runs` views the heads-outer cache without a copy (a write to the cache
    shows through it) and refuses the default layout, which it could only copy."""
    cache = KVCache.allocate_paged(2, 2, 6, 4, 16, 2, HEAD_DIM, torch.float32, "cpu",
                                   heads_outer=True)
    keys, values = cache.head_runs(1)
    assert keys.shape == values.shape == (1, 2, 7 * 4, HEAD_DIM)
    cache.k[1, 5, 1, 2] = 3.0
    cache.v[1, 0, 0, 1] = 4.0
    assert bool((keys[0, 1, 5 * 4 + 2] == 3.0).all()) and bool((values[0, 0, 1] == 4.0).all())
    default = KVCache.allocate_paged(2, 2, 6, 4, 16, 2, HEAD_DIM, torch.float32, "cpu")
    with pytest.raises(ValueError, match="heads-outer"):
        default.head_runs(0)


@pytest.mark.slow  # torch.compile of FlexAttention, ~12 s; the eager tests above stay
def test_compiled_flex_visits_only_the_listed_paged_blocks():
    """The compiled CPU kernel over the blocks in place (it follows the lists: the eager one
    scores every block) equals the reference."""
    compare_paged([31, 32, 47, 300], [2, 0, 3], 9, heads=4, kv_heads=2, compiled=True, seed=5)


@pytest.mark.slow  # torch.compile of FlexAttention, ~12 s; the eager tests above stay
def test_compiled_flex_visits_only_the_listed_blocks():
    """The compiled CPU kernel reads the block lists (the eager one ignores them): it equals the
    reference over the whole cache rows (contiguous slots: all 1,024 rows, the unused ones
    skipped), and a block mask that drops the full blocks changes its result."""
    found = compare([127, 128, 129, 500], [0, 1, 2, 3], 9, heads=4, kv_heads=2,
                    compiled=True, max_len=1024, seed=3)
    assert found.kv_len == 1024
    bm = found.block_mask
    assert int(bm.full_kv_num_blocks.sum()) > 0  # the prefixes have whole blocks
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, 4, 9, HEAD_DIM, generator=gen)
    cache = random_cache([127, 128, 129, 500], 2, 1024, seed=5)
    inp = flex_step_inputs(cache, torch.arange(4), torch.ones(4, 9, 9, dtype=torch.bool).tril(),
                           torch.zeros(4, 9, dtype=torch.long), identity_rope, q, compiled=True)
    out = inp.window.attend(q, cache.k[0], cache.v[0], inp)
    bm = inp.window.block_mask
    bm.full_kv_num_blocks = torch.zeros_like(bm.full_kv_num_blocks)
    dropped = inp.window.attend(q, cache.k[0], cache.v[0], inp)
    assert (out - dropped).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_flex_equals_dense_reference_sweep(seed):
    """Random batches: prefixes up to 5,000, trees of 1-64 nodes, slots in any order, with and
    without a sliding window, eager and (seeds 0, 1) compiled."""
    gen = torch.Generator().manual_seed(100 + seed)
    for trial in range(4):
        num_slots = int(torch.randint(1, 7, (1,), generator=gen))
        lengths = torch.randint(0, 5001, (num_slots,), generator=gen).tolist()
        slots = torch.randperm(num_slots, generator=gen)[
            : int(torch.randint(1, num_slots + 1, (1,), generator=gen))].tolist()
        num_n = int(torch.randint(1, 65, (1,), generator=gen))
        kv_heads = [1, 2, 4][trial % 3]
        window = [None, 64, 1000, None][trial]
        compare(lengths, slots, num_n, heads=4, kv_heads=kv_heads, window=window,
                compiled=seed < 2 and trial < 2, seed=1000 * seed + trial,
                max_len=5100)


def forward_both(target, tokens: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor,
                 caches: tuple[KVCache, KVCache], slots: torch.Tensor, backends):
    """The target's forward through each backend over its own cache -> their outputs."""
    outs = []
    for backend, cache in zip(backends, caches, strict=True):
        target.backend = backend
        outs.append(target.forward(tokens, positions, tree, cache, slots))
    return outs


def test_tiny_model_through_flex_equals_the_torch_backend():
    """A tiny random Llama (GQA: 4 heads on 2): a prefill of two prompts of different lengths
    and then a tree step after them give the same features and logits through FlexBackend
    as through the torch backend (SDPA over the dense mask), and the same caches."""
    target = tiny_target(seed=3, layers=3)
    target.set_feature_layers((0, 2))  # EAGLE-3 features: residual streams of two layers
    backends = (Backend(), FlexBackend())
    caches = tuple(Backend().allocate_cache(target, 3, 400) for _ in backends)
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([2, 0])
    lengths = torch.tensor([300, 130])
    tokens = torch.randint(0, 64, (2, 300), generator=gen)
    positions = torch.arange(300).expand(2, 300)
    outs = forward_both(target, tokens, positions, causal_mask(lengths, 300), caches, slots,
                        backends)
    for a, b in zip(outs[0].__dict__.values(), outs[1].__dict__.values(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for cache in caches:
        cache.lengths[slots] = lengths
    tree = torch.stack([random_tree_mask(12, gen) for _ in range(2)])  # [B, N, N]
    tokens = torch.randint(0, 64, (2, 12), generator=gen)
    positions = lengths[:, None] + tree.sum(-1) - 1
    ref, got = forward_both(target, tokens, positions, tree, caches, slots, backends)
    torch.testing.assert_close(got.features, ref.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(target.logits(got.hidden), target.logits(ref.hidden),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-5, rtol=1e-5)


def test_engine_greedy_through_flex_equals_plain_decoding(monkeypatch):
    """EAGLE2_ATTENTION=flex: the target and the draft head attend through FlexAttention on
    this fp32 CPU; greedy speculative decoding then equals plain decoding (through the CPU
    backend) token for token, with the same drafts as the head's module path."""
    prompts = random_prompts(3, 48, seed=2, lo=3, hi=140)  # prefills of up to 139: 2 query blocks
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    tree = TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed",
                      draft_window=64)
    plain = run(make_engine(tiny_target(vocab=48, seed=11), None), prompts, greedy,
                TreeConfig("vanilla"))
    module_path = make_engine(tiny_target(vocab=48, seed=11), 0)
    assert run(module_path, prompts, greedy, tree) == plain
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    engine = make_engine(tiny_target(vocab=48, seed=11), 0)
    assert isinstance(engine.runner.target.backend, FlexBackend)
    assert isinstance(engine.drafter.kernels, FlexHeadKernels)
    assert engine.runner.info["attention"] == "flex"
    assert run(engine, prompts, greedy, tree) == plain
    assert engine.stats.steps == module_path.stats.steps  # the same drafts, accepted alike


def test_backend_for_picks_and_logs_the_attention(monkeypatch, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="eagle2.devices"):
        on_gpu = backend_for(cuda, torch.bfloat16)
    assert isinstance(on_gpu, FlexBackend) and on_gpu.compiles(cuda)
    assert "FlexAttention (compiled)" in caplog.text and "cuda" in caplog.text
    assert not isinstance(backend_for(cpu, torch.float32), FlexBackend)  # the CPU backend
    assert type(backend_for(cuda, torch.bfloat16, attention="sdpa")) is Backend
    assert type(backend_for(torch.device("mps"), torch.float16)) is Backend  # flex: CUDA only
    flex_cpu = backend_for(cpu, torch.float32, attention="flex")
    assert isinstance(flex_cpu, FlexBackend) and not flex_cpu.compiles(cpu)
    monkeypatch.setenv(ATTENTION_ENV, "flex")
    assert isinstance(backend_for(cpu, torch.float32), FlexBackend)
    monkeypatch.setenv(ATTENTION_ENV, "dense")
    with pytest.raises(ValueError, match="EAGLE2_ATTENTION"):
        backend_for(cpu, torch.float32)
    monkeypatch.delenv(ATTENTION_ENV)
    target = tiny_target()
    target.backend = FlexBackend()
    assert target.backend.info(target)["attention"] == "flex"
    assert target.backend.cost_key(target) != Backend().cost_key(target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_flex_reads_paged_blocks_in_place(dtype, block_size):
    """On a GPU: the compiled (Triton) FlexAttention over the paged cache's blocks in place
    (the serving path's eager steps) against SDPA over the gathered entries, one and 33
    nodes (the decoding and the main kernel), block sizes under and at the default tile."""
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for num_n in (1, 33):
        compare_paged([127, 128, 129, 1000], [3, 1, 0], num_n, heads=8, kv_heads=2,
                      block_size=block_size, compiled=True, seed=num_n, device="cuda",
                      dtype=dtype, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_flex_equals_dense_reference(dtype):
    """On a GPU: the compiled (Triton) FlexAttention against SDPA over the dense mask, whole
    cache rows, GQA, block boundaries, contiguous and scattered slots."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    lengths = [127, 128, 129, 4000]
    for slots in ([0, 1, 2, 3], [3, 1]):
        cache = random_cache(lengths, 2, 4200, seed=1)
        cache = KVCache(cache.k.to(dev, dtype), cache.v.to(dev, dtype), cache.lengths.to(dev))
        flex_cache = copy_cache(cache)
        slot_t = torch.tensor(slots, device=dev)
        tree = torch.stack([random_tree_mask(33, gen) for _ in slots]).to(dev)
        positions = torch.zeros(len(slots), 33, dtype=torch.long, device=dev)
        q = torch.randn(len(slots), 8, 33, 64, generator=gen).to(dev, dtype)
        k = torch.randn(len(slots), 2, 33, 64, generator=gen).to(dev, dtype)
        v = torch.randn(len(slots), 2, 33, 64, generator=gen).to(dev, dtype)

        def rope(like, pos):
            shape = (*pos.shape, 64)
            return (torch.ones(shape, device=dev, dtype=dtype),
                    torch.zeros(shape, device=dev, dtype=dtype))

        ref = cached_attention(q.float(), k.float(), v.float(), copy_cache(cache), 0,
                               step_inputs(cache, slot_t, tree, positions, rope, q))
        inp = flex_step_inputs(flex_cache, slot_t, tree, positions, rope, q, compiled=True)
        out = flex_cached_attention(q, k, v, flex_cache, 0, inp)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_compiled_flex_keeps_a_graph_for_every_kind_of_call(monkeypatch):
    """On CUDA one compiled flex_attention (dynamic shapes) takes every call: the target's
    masks and the head's (a sliding window), batches and trees of one and of more, keys as a
    view of the cache and gathered. Dynamo makes a graph for each kind, more than its default
    limit of 8, past which a call runs unfused for the rest of the process (K/V repeated per
    head, fp32 scores [B, Hq, N, S]: GBs for a long prompt chunk). Here with torch.compile's
    eager backend (the graphs without their kernels: seconds on a CPU), dynamic as on CUDA,
    and a hit of the limit made to raise."""
    import functools

    import torch._dynamo

    from eagle2 import flex

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    compiled = functools.cache(flex.compiled_flex_attention.__wrapped__)
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda dynamic: compiled(True))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    # (the limit as it is, restored after; a hit raises)
    try:
        with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit,
                                        fail_on_recompile_limit_hit=True):
            for window in (None, 64):
                for slots in ([0], [1, 0], [0, 1, 2], [2, 0, 1, 3]):
                    for num_n in (1, 5, 9):
                        compare([40, 100, 7, 200], slots, num_n, heads=4, kv_heads=2,
                                window=window, compiled=True, seed=num_n)
        assert counters["stats"]["unique_graphs"] - before > 8  # past dynamo's default limit
    finally:
        torch._dynamo.reset()


def test_a_flex_attention_that_does_not_compile_gives_way_to_sdpa(monkeypatch, caplog):
    """The compile probe (`flex.compile_failure`, one tiny compiled call a process): None
    where the call compiles and runs (here torch.compile's eager backend on the CPU), the
    error where compiling fails (as Triton does without a C compiler or Python headers).
    Then `backend_for` on CUDA gives SDPA over a dense mask with a warning (auto) instead of
    failing every prefill, and an error naming the cause where FlexAttention was asked for."""
    import functools

    from eagle2 import flex

    probe = flex.compile_failure.__wrapped__
    real_compile = torch.compile
    compiled = functools.cache(flex.compiled_flex_attention.__wrapped__)
    monkeypatch.setattr(flex, "compiled_flex_attention", compiled)
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: real_compile(fn, **{**kw, "backend": "eager"}))
    assert probe(torch.device("cpu"), torch.float32) is None

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment")

    compiled.cache_clear()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: no_compiler)
    assert probe(torch.device("cpu"), torch.float32).startswith("RuntimeError: Failed to find")

    cuda = torch.device("cuda")
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    monkeypatch.setattr(flex, "compile_failure", lambda device, dtype: "RuntimeError: no CC")
    with caplog.at_level(logging.WARNING, logger="eagle2.devices"):
        assert type(backend_for(cuda, torch.bfloat16)) is Backend
    assert "FlexAttention does not compile on cuda (RuntimeError: no CC)" in caplog.text
    with pytest.raises(RuntimeError, match="does not compile on cuda: RuntimeError: no CC"):
        backend_for(cuda, torch.bfloat16, attention="flex")
