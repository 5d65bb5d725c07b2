"""Tree attention equals causal attention along each root path; commit equals recomputation."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import tiny_target

from eagle2.attention import causal_mask
from eagle2.cpu.kernels import exact_bf16_kernels
from eagle2.target import TargetModel
from eagle2.tree import chain_tree, finish_tree


def causal_features(target, tokens: list[int]) -> torch.Tensor:
    """Plain causal forward over a whole sequence with a fresh cache: [T, H]."""
    cache = target.allocate_cache(1, 256)
    t = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    out = target.forward(t, pos, causal_mask(torch.tensor([len(tokens)]), len(tokens)), cache,
                         torch.tensor([0]))
    return out.features[0]


def prefill(target, prompt: list[int], slots: int = 1):
    cache = target.allocate_cache(slots, 256)
    n = len(prompt)
    target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                   causal_mask(torch.tensor([n]), n), cache, torch.tensor([0]))
    cache.lengths[0] = n
    return cache


def sample_tree():
    # root, 3 children, grandchildren under the first two, one great-grandchild
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4]])
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 3]])
    tokens = torch.tensor([[11, 3, 9, 30, 4, 5, 17, 21]])
    return finish_tree(tokens, parents, depths)


def test_tree_attention_matches_causal_along_each_path():
    target = tiny_target(seed=3)
    prompt = [1, 5, 2, 8, 13, 40]
    tree = sample_tree()
    cache = prefill(target, prompt)
    out = target.forward(tree.tokens, cache.lengths[:1, None] + tree.depths, tree.tree_mask,
                         cache, torch.tensor([0]))
    for node in range(tree.size):
        path = [i for i in range(tree.size) if tree.tree_mask[0, node, i]]
        seq = prompt + [int(tree.tokens[0, i]) for i in path]
        ref = causal_features(target, seq)[-1]
        torch.testing.assert_close(out.features[0, node], ref, rtol=1e-5, atol=1e-5)


def test_cache_after_commit_equals_recomputation():
    target = tiny_target(seed=4)
    prompt = [2, 7, 1, 8, 2, 8]
    tree = sample_tree()
    cache = prefill(target, prompt)
    target.forward(tree.tokens, cache.lengths[:1, None] + tree.depths, tree.tree_mask, cache,
                   torch.tensor([0]))
    accepted = [0, 1, 4, 7]  # root -> 3 -> 4 -> 21
    cache.commit(torch.tensor([0]), torch.tensor([accepted]), torch.tensor([len(accepted)]))
    seq = prompt + [int(tree.tokens[0, i]) for i in accepted]
    assert int(cache.lengths[0]) == len(seq)
    ref = prefill(target, seq)
    n = len(seq)
    torch.testing.assert_close(cache.k[:, 0, :, :n], ref.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, 0, :, :n], ref.v[:, 0, :, :n], rtol=1e-5, atol=1e-5)


def test_a_chain_accepted_from_its_start_commits_in_place():
    """Two requests: one accepts its chain's first two tokens (the K/V already sit where
    they go: nothing moves), the other its first only; both caches equal recomputation."""
    target = tiny_target(seed=4)
    prompts = [[2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5]]
    cache = target.allocate_cache(2, 64)
    for slot, prompt in enumerate(prompts):
        n = len(prompt)
        target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                       causal_mask(torch.tensor([n]), n), cache, torch.tensor([slot]))
        cache.lengths[slot] = n
    tree = chain_tree(torch.tensor([[9, 10, 11], [12, 13, 14]]))
    target.forward(tree.tokens, cache.lengths[:2, None] + tree.depths, tree.tree_mask, cache,
                   torch.tensor([0, 1]))
    cache.commit(torch.tensor([0, 1]), torch.tensor([[0, 1], [0, 0]]), torch.tensor([2, 1]))
    for slot, seq in enumerate([prompts[0] + [9, 10], prompts[1] + [12]]):
        n = len(seq)
        assert int(cache.lengths[slot]) == n
        ref = prefill(target, seq)
        torch.testing.assert_close(cache.k[:, slot, :, :n], ref.k[:, 0, :, :n], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(cache.v[:, slot, :, :n], ref.v[:, 0, :, :n], rtol=1e-5,
                                   atol=1e-5)


def test_a_copied_slot_decodes_as_the_original():
    """copy_slot moves only the committed entries (the rest of a slot is scratch); the next
    token's features from the copy equal those from the original slot, and a longer stale
    request that held the slot before leaves nothing the copy can see."""
    target = tiny_target(seed=5)
    cache = target.allocate_cache(3, 64)
    for slot, prompt in ((0, list(range(1, 30))), (2, [3, 1, 4, 1, 5, 9, 2, 6])):
        n = len(prompt)
        target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                       causal_mask(torch.tensor([n]), n), cache, torch.tensor([slot]))
        cache.lengths[slot] = n
    cache.copy_slot(2, 0)
    assert int(cache.lengths[0]) == 8
    torch.testing.assert_close(cache.k[:, 0, :, :8], cache.k[:, 2, :, :8], rtol=0, atol=0)

    def next_features(slot: int) -> torch.Tensor:
        pos = cache.lengths[[slot], None].clone()
        return target.forward(torch.tensor([[7]]), pos, torch.ones(1, 1, 1, dtype=torch.bool),
                              cache, torch.tensor([slot])).features

    torch.testing.assert_close(next_features(0), next_features(2), rtol=0, atol=0)


# --- exact bf16 attention (docs/cpu-backend.md "Exact bf16 attention") ---------------------------

def _bf16_target(seed: int):
    target = tiny_target(seed=seed)
    target.hf.to(torch.bfloat16)
    return TargetModel(target.hf, name=f"tiny-bf16-{seed}")


def _tree_step(target, prefixes: list[list[int]], tree):
    """Prefill each prefix into its own slot, then one tree forward for all: features [B, N]."""
    cache = target.allocate_cache(len(prefixes), 256)
    for b, prompt in enumerate(prefixes):
        n = len(prompt)
        target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                       causal_mask(torch.tensor([n]), n), cache, torch.tensor([b]))
        cache.lengths[b] = n
    num_b = len(prefixes)
    tokens = tree.tokens.expand(num_b, -1)
    positions = cache.lengths[:, None] + tree.depths
    mask = tree.tree_mask.expand(num_b, -1, -1)
    return target.forward(tokens, positions, mask, cache, torch.arange(num_b)).features


def _plain_decode(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Feed `tokens` one at a time after the prompt, like plain decoding: features [T, H]."""
    cache = target.allocate_cache(1, 256)
    n = len(prompt)
    target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                   causal_mask(torch.tensor([n]), n), cache, torch.tensor([0]))
    cache.lengths[0] = n
    out = []
    for t in tokens:
        pos = cache.lengths[:1, None].clone()
        f = target.forward(torch.tensor([[t]]), pos, torch.ones(1, 1, 1, dtype=torch.bool),
                           cache, torch.tensor([0])).features[0, 0]
        cache.lengths[0] += 1
        out.append(f)
    return torch.stack(out)


needs_exact_bf16 = pytest.mark.skipif(
    not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")),
    reason="exact bf16 verification needs oneDNN's packed bf16 kernels (AVX512/AMX) or the "
           "native FMA kernel (AVX2 and a C++ compiler)")


@needs_exact_bf16
@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused"])
def test_bf16_tree_nodes_equal_plain_decoding_bitwise(fused):
    """Every node of a tree, verified together with other requests of other lengths (some
    trees crossing an attention chunk boundary), gets bitwise the features plain decoding
    would give the same token. fused: the engine's layers (`eagle2.cpu.fused`, with the fused CPU
    operations of `eagle2.cpu.native` where they build)."""
    target = _bf16_target(seed=11)
    assert target.backend.exact
    if fused:
        target.fuse()
        assert target.backend.fused is not None
        assert target.backend.native is not None or not shutil.which("c++")
    tree = sample_tree()
    prefixes = [[1, 5, 2, 8, 13, 40], list(range(3, 33)), list(range(2, 64)) + [7, 9]]
    feats = _tree_step(target, prefixes, tree)
    for b, prompt in enumerate(prefixes):
        for node in range(tree.size):
            path = [int(tree.tokens[0, i]) for i in range(tree.size) if tree.tree_mask[0, node, i]]
            plain = _plain_decode(target, prompt, path)[-1]
            assert torch.equal(feats[b, node], plain), (b, node)


@needs_exact_bf16
def test_canonical_attention_matches_sdpa():
    """Same numbers as PyTorch's attention up to bf16 rounding (it is attention, reordered)."""
    target = _bf16_target(seed=12)
    tree = sample_tree()
    prefixes = [list(range(1, 40)), [4, 4, 4]]
    exact = _tree_step(target, prefixes, tree).float()
    target.backend.exact = False
    sdpa = _tree_step(target, prefixes, tree).float()
    torch.testing.assert_close(exact, sdpa, rtol=0.05, atol=0.05)
    assert (exact - sdpa).abs().mean() < 0.01


def test_window_depth_covers_every_tree_the_config_allows():
    from eagle2.config import MAX_DEPTH, MAX_LOOKUP, TreeConfig
    from eagle2.cpu.attention import WINDOW_DEPTH

    assert MAX_DEPTH + 1 <= WINDOW_DEPTH and MAX_LOOKUP <= WINDOW_DEPTH
    with pytest.raises(ValueError, match="depth must be in"):
        TreeConfig("eagle2", depth=MAX_DEPTH + 1)


def test_the_layer_views_of_a_cache_follow_its_tensors():
    """`KVCache.layer_views`: each layer's K, V and kept key blocks (views made once), the
    same storage as the cache's own tensors, and made again when one of them is replaced."""
    from eagle2.attention import KVCache
    from eagle2.cpu.attention import with_key_blocks

    cache = with_key_blocks(KVCache.allocate(3, 2, 1, 32, 8, torch.bfloat16, "cpu"))
    for i in range(3):
        k, v, blocks, valid = cache.layer_views(i)
        assert k.data_ptr() == cache.k[i].data_ptr() and v.data_ptr() == cache.v[i].data_ptr()
        assert blocks.data_ptr() == cache.key_blocks[i].data_ptr()
        assert valid.data_ptr() == cache.key_blocks_valid[i].data_ptr()
    assert cache.layer_views(1)[0] is cache.layer_views(1)[0]  # kept, not made per call
    cache.k = torch.ones_like(cache.k)
    assert cache.layer_views(2)[0].data_ptr() == cache.k[2].data_ptr()
    assert bool(cache.layer_views(2)[0].eq(1).all())
    plain = KVCache.allocate(2, 1, 1, 16, 8, torch.float32, "cpu")
    assert plain.layer_views(1)[2:] == (None, None)


# --- several groups in one forward (`TargetModel.forward_parts`) ---------------------------------

def _parts_backend(kind: str):
    """A tiny target on one backend: fp32 CPU, torch SDPA, FlexAttention (eager), or bf16 with
    the CPU's exact kernels (fused, the native operators where built)."""
    from eagle2.backend import Backend
    from eagle2.flex import FlexBackend

    if kind == "bf16-exact":
        return _bf16_target(seed=41).fuse()
    target = tiny_target(seed=40)
    if kind != "cpu-fp32":
        target.backend = Backend() if kind == "sdpa" else FlexBackend(compiled=False)
    return target


def cache_with_prompts(target, prompts: list[list[int]], paged: bool, seed: int):
    """A cache of a slot per prompt, each prompt's forward committed in its slot; paged: 8
    blocks of 16 entries a slot, handed out in a random order."""
    num = len(prompts)
    cache = (target.allocate_paged_cache(num, 8 * num + 16, 16, 128) if paged
             else target.allocate_cache(num, 128))
    if paged:
        order = torch.randperm(8 * num + 16, generator=torch.Generator().manual_seed(seed))
        for s in range(num):
            cache.set_blocks(s, order[8 * s:8 * s + 8].tolist())
    for s, prompt in enumerate(prompts):
        n = len(prompt)
        target.forward(torch.tensor([prompt]), torch.arange(n)[None],
                       causal_mask(torch.tensor([n]), n), cache, torch.tensor([s]))
        cache.lengths[s] = n
    return cache


@pytest.mark.parametrize("paged", [False, True], ids=["slotted", "paged"])
@pytest.mark.parametrize("kind", ["cpu-fp32", "sdpa", "flex", "bf16-exact"])
def test_forward_parts_equals_each_groups_own_forward(kind, paged):
    """Trees of two requests and a prompt chunk of a third in one forward: each group's
    features and K/V are its own forward's (bitwise with the exact bf16 kernels)."""
    from eagle2.backend import StepPart

    if kind == "bf16-exact" and not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")):
        pytest.skip("needs the CPU's exact bf16 kernels")
    target = _parts_backend(kind)
    gen = torch.Generator().manual_seed(3)

    def cache_with_history():
        return cache_with_prompts(target, [[5, 9, 2, 7, 1, 3, 3, 8, 6], [4, 4, 1],
                                           list(range(30))], paged, seed=1)

    tree = sample_tree()
    trees = StepPart(tree.tokens.expand(2, -1), None, tree.tree_mask.expand(2, -1, -1),
                     torch.arange(2))
    chunk_tokens = torch.randint(0, 64, (1, 20), generator=gen)
    chunk = StepPart(chunk_tokens, 30 + torch.arange(20)[None],
                     causal_mask(torch.tensor([20]), 20), torch.tensor([2]))
    alone, parts = cache_with_history(), cache_with_history()
    trees = trees._replace(positions=alone.lengths[:2, None] + tree.depths)
    want = [target.forward(p.tokens, p.positions, p.tree_mask, alone, p.slots)
            for p in (trees, chunk)]
    got = target.forward_parts([trees, chunk], parts)
    same = torch.equal if kind == "bf16-exact" else (
        lambda a, b: torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5) or True)
    for w, g in zip(want, got, strict=True):
        assert g.features.shape == w.features.shape
        assert same(g.features, w.features)
    for kv_a, kv_p in ((alone.k, parts.k), (alone.v, parts.v)):
        assert same(kv_p, kv_a)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_a_head_cast_to_bf16_keeps_its_rope_frequencies_fp32(kind):
    """The heads are trained with fp32 RoPE frequencies (as the target keeps them); cast to
    bf16 with the head they had moved each angle by up to pos * f * 2^-9. The bf16 head's
    cos/sin must be the fp32 head's, rounded once to bf16."""
    from eagle2.eagle3 import Eagle3Head
    from eagle2.head import new_head

    config = tiny_target().config
    make = (lambda: new_head(config)) if kind == "eagle2" else \
        (lambda: Eagle3Head(config, draft_vocab_size=32))
    ref, head = make(), make().to(torch.bfloat16)
    assert head.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary.inv_freq, ref.rotary.inv_freq)
    positions = torch.arange(4096)[None]
    like = torch.zeros(1, dtype=torch.bfloat16)
    for got, want in zip(head.rotary(like, positions),
                         ref.rotary(like.float(), positions), strict=True):
        assert torch.equal(got, want.to(torch.bfloat16))


def _reference_attention(q, k, v, mask):
    """Masked attention with K/V repeated per query head, in fp64: q [B, Hq, N, D], k, v
    [B, KVH, S, D], mask [B, 1, N, S] -> [B, Hq, N, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("group", [1, 2, 4])
def test_packed_gqa_sdpa_equals_per_head_attention(group, monkeypatch):
    """`masked_sdpa` with the query heads packed (what CUDA runs: no masked GQA call) and
    with `enable_gqa` both give each query head its KV head's masked attention."""
    from eagle2 import attention
    from eagle2.attention import StepInputs

    gen = torch.Generator().manual_seed(group)
    num_b, num_kv, num_n, keys, dim = 3, 2, 5, 19, 16
    q = torch.randn(num_b, num_kv * group, num_n, dim, generator=gen)
    k, v = (torch.randn(num_b, num_kv, keys, dim, generator=gen) for _ in range(2))
    mask = torch.rand(num_b, 1, num_n, keys, generator=gen) < 0.5
    mask[..., -1] = True  # every row sees a key; some see only that one
    mask[0, 0, 1] = False
    mask[0, 0, 1, 7] = True
    inp = StepInputs(torch.arange(num_b), None, mask, None, None, True)
    want = _reference_attention(q, k, v, mask)
    plain = attention.masked_sdpa(q, k, v, inp)
    monkeypatch.setattr(attention, "PACK_GQA_DEVICES", frozenset({"cpu"}))
    packed = attention.masked_sdpa(q, k, v, inp)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):  # the output in [B, L, H, D] memory, as CUDA's kernels
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_layout)
    torch.testing.assert_close(attention.masked_sdpa(q, k, v, inp), packed, atol=0, rtol=0)
    for got in (plain, packed):
        assert got.shape == q.shape
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert list(inp.packed) == ([] if group == 1 else [(group, torch.float32)])
    for bias in inp.packed.values():  # rows aligned as CUDA's memory-efficient kernel wants
        assert bias.shape == (num_b, 1, group * num_n, keys)
        assert all(stride % 16 == 0 for stride in bias.stride()[:-1])


@pytest.mark.parametrize("paged", [False, True], ids=["slotted", "paged"])
def test_tree_forward_with_packed_query_heads_equals_enable_gqa(paged, monkeypatch):
    """The torch backend's forward over a tree after a prompt (two requests at different
    lengths, slotted or paged cache): features and the K/V written are the same with the
    query heads packed (CUDA's path) as with SDPA's `enable_gqa` (the CPU's)."""
    from eagle2 import attention
    from eagle2.backend import Backend

    target = tiny_target(seed=44, heads=8, kv_heads=2)
    target.backend = Backend()
    tree = sample_tree()

    def run():
        cache = cache_with_prompts(target, [[5, 9, 2, 7, 1, 3, 3, 8, 6, 1, 2, 3, 4, 5, 6, 7,
                                             8, 9], [4, 4, 1]], paged, seed=2)
        out = target.forward(tree.tokens.expand(2, -1), cache.lengths[:, None] + tree.depths,
                             tree.tree_mask.expand(2, -1, -1), cache, torch.tensor([1, 0]))
        return out.features, cache

    want, cache_want = run()
    monkeypatch.setattr(attention, "PACK_GQA_DEVICES", frozenset({"cpu"}))
    got, cache_got = run()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_got.k, cache_want.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_got.v, cache_want.v, atol=1e-5, rtol=1e-5)
