"""The fused bf16 CPU operations (eagle2/csrc/cpu_ops.cpp): the same numbers as the ATen
operations they replace up to bf16 rounding, and each row bitwise the same whatever the
number of rows or threads (what exact bf16 verification rests on)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from eagle2.cpu.native import cpu_ops

pytestmark = pytest.mark.skipif(not shutil.which("c++"), reason="no C++ compiler")
EPS = 1e-5


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops()
    assert module is not None, "the fused CPU operations did not build"
    return module


@pytest.fixture(scope="module", params=["native", pytest.param("avx2", marks=pytest.mark.slow)])
def attn_ops(request, ops):
    """This machine's build, and the AVX2 build where this one is AVX-512 (a machine builds
    only its own instruction set, so an AVX-512 CI machine would otherwise never run the AVX2
    attention; every x86-64 CPU we run on has AVX2)."""
    if request.param == "native":
        return ops
    if platform.machine() not in ("x86_64", "AMD64") or ops.isa() == "avx2":
        pytest.skip("this machine's build is the AVX2 one")
    from eagle2.cpu.native import load_variant

    avx2 = load_variant("eagle2_cpu_avx2", march="haswell")
    assert avx2.isa() == "avx2"
    return avx2


def test_the_build_uses_the_cpus_vector_instructions(ops):
    """AVX512-BF16 where the CPU has it, else AVX2 + FMA; the bf16 dot-product linear says
    clearly that an AVX2 build lacks it (the plans never pick it there)."""
    from eagle2.cpu.kernels import cpu_info, native_linear_ops

    flags = cpu_info()[1]
    want = "avx512_bf16" if {"avx512_bf16", "avx512bw"} <= flags else "avx2"
    assert ops.isa() == want
    if want == "avx2":
        assert native_linear_ops() is None
        w = torch.randn(64, 64).bfloat16()
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            ops.linear(torch.randn(1, 64).bfloat16(), ops.pack_linear(w), 64, 0)


@pytest.mark.slow  # four compiles, ~45 s on 2 cores; make test-slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_both_instruction_sets_compile():
    """The source compiles for both of its instruction sets, whichever this CPU has: a machine
    builds only its own (`-march=native`), and an AVX2 kernel's new argument once left the
    AVX-512 path uncompilable, so every AVX512-BF16 machine fell back to ATen (~2.4x slower).
    AVX2 + FMA; AVX512-BF16 with VNNI (Cooper Lake); AVX512-BF16 without VNNI; with AMX
    (Sapphire Rapids: the tile linear)."""
    from torch.utils.cpp_extension import include_paths

    from eagle2.cpu.native import CFLAGS, SOURCE

    flags = [f for f in CFLAGS if not f.startswith(("-march", "-O"))]
    incs = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    targets = (["-march=haswell"], ["-march=cooperlake"],
               ["-march=skylake-avx512", "-mavx512bf16"], ["-march=sapphirerapids"])
    runs = [(t, subprocess.Popen(["c++", "-fsyntax-only", "-std=c++20", *t, *flags,
                                  "-DTORCH_EXTENSION_NAME=eagle2_cpu_ops",
                                  "-DTORCH_API_INCLUDE_EXTENSION_H", *incs, str(SOURCE)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for t in targets]
    for target, proc in runs:
        out = proc.communicate()[0]
        if proc.returncode and ("bad value" in out or "unrecognized" in out):
            pytest.skip(f"this compiler does not know {' '.join(target)}")
        assert proc.returncode == 0, f"{' '.join(target)}:\n{out[-3000:]}"


def reference_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in fp32, round to bf16, scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return w * h.to(torch.bfloat16)


def test_rms_norm_matches_the_llama_norm(ops):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 200, generator=g) * 4).bfloat16()
    w = torch.rand(200, generator=g).bfloat16() + 0.5
    out = ops.rms_norm(x, w, EPS)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    torch.testing.assert_close(out.float(), reference_norm(x, w).float(), rtol=1.6e-2, atol=1e-2)
    delta = torch.randn(3, 5, 200, generator=g).bfloat16()
    total, normed = ops.add_rms_norm(x, delta, w, EPS)
    assert torch.equal(total, x + delta)  # the same rounding as a bf16 add
    torch.testing.assert_close(normed.float(), reference_norm(x + delta, w).float(),
                               rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_row_count(ops, threads):
    g = torch.Generator().manual_seed(1)
    w = torch.rand(576, generator=g).bfloat16()
    rows = torch.randn(97, 576, generator=g).bfloat16()
    delta = torch.randn(97, 576, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = ops.rms_norm(rows, w, EPS)
        total, normed = ops.add_rms_norm(rows, delta, w, EPS)
        for m in (1, 2, 5, 16, 33):
            assert torch.equal(ops.rms_norm(rows[:m].contiguous(), w, EPS), whole[:m])
            part = ops.add_rms_norm(rows[-m:].contiguous(), delta[-m:].contiguous(), w, EPS)
            assert torch.equal(part[0], total[-m:]) and torch.equal(part[1], normed[-m:])
    finally:
        torch.set_num_threads(before)


def test_fma_linear_split_over_threads_equals_one_thread_on_both_builds(attn_ops, ops):
    """The threads take a weight's 32-output blocks in pieces, in whatever order they come
    (`parallel_blocks`), for any row count: the outputs of 1-12 rows (weights of 18 and 49
    blocks: pieces of 4 and 8 blocks, a shorter last one) on two and four threads (more threads
    than cores: which thread takes which piece varies from call to call) are those of one
    thread, and the AVX2 build's are the AVX-512 build's."""
    g = torch.Generator().manual_seed(4)
    for n, k in ((576, 576), (1550, 192)):
        weight = (torch.randn(n, k, generator=g) / 24).bfloat16()
        packed, reference = attn_ops.pack_linear(weight), ops.pack_linear(weight)
        x = torch.randn(12, k, generator=g).bfloat16()
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = [attn_ops.linear_fma(x[:m], packed, n) for m in range(1, 13)]
            for threads in (2, 4):
                torch.set_num_threads(threads)
                for m in range(1, 13):
                    assert torch.equal(attn_ops.linear_fma(x[:m], packed, n), one[m - 1]), (n, m)
                    assert torch.equal(ops.linear_fma(x[:m], reference, n), one[m - 1]), (n, m)
        finally:
            torch.set_num_threads(before)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def test_qkv_rope_write_matches_rotary_and_cache_writes(ops):
    """q comes back rotated in [B, Hq, N, Dh]; k (rotated) and v land in the cache at each
    request's slot and positions, and nothing else of the cache changes."""
    g = torch.Generator().manual_seed(2)
    num_b, num_n, num_q, num_kv, dim, slots, length = 2, 3, 4, 2, 16, 4, 40
    qkv = torch.randn(num_b, num_n, (num_q + 2 * num_kv) * dim, generator=g).bfloat16()
    angle = torch.rand(num_b, num_n, dim // 2, generator=g) * 6
    cos = torch.cat([angle.cos()] * 2, -1).bfloat16()
    sin = torch.cat([angle.sin()] * 2, -1).bfloat16()
    cache_k = torch.zeros(slots, num_kv, length, dim, dtype=torch.bfloat16)
    cache_v = torch.ones(slots, num_kv, length, dim + 1, dtype=torch.bfloat16)
    slot_idx = torch.tensor([3, 1])
    write_pos = torch.tensor([[5, 6, 9], [30, 31, 32]])
    q = ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, cache_k, cache_v, slot_idx, write_pos)

    heads = qkv.view(num_b, num_n, num_q + 2 * num_kv, dim).transpose(1, 2).float()
    c, s = cos.float()[:, None], sin.float()[:, None]
    want_q = rotate(heads[:, :num_q], c, s)
    want_k = rotate(heads[:, num_q:num_q + num_kv], c, s)
    torch.testing.assert_close(q.float(), want_q, rtol=1.6e-2, atol=1e-2)
    written = torch.zeros(slots, length, dtype=torch.bool)
    for b in range(num_b):
        for n in range(num_n):
            sl, pos = int(slot_idx[b]), int(write_pos[b, n])
            written[sl, pos] = True
            torch.testing.assert_close(cache_k[sl, :, pos].float(), want_k[b, :, n],
                                       rtol=1.6e-2, atol=1e-2)
            assert torch.equal(cache_v[sl, :, pos, :dim], qkv[b, n].view(-1, dim)[-num_kv:])
    untouched = ~written[:, None].expand(slots, num_kv, length)
    assert bool((cache_k[untouched] == 0).all()) and bool((cache_v[..., dim] == 1).all())
    assert bool((cache_v[untouched] == 1).all())
    with pytest.raises(RuntimeError, match="cache position out of range"):
        ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, cache_k, cache_v, slot_idx,
                           write_pos + length)


def test_fused_layers_match_the_aten_layers(ops):
    """A bf16 target's forward with the fused CPU operations gives the features of the same
    layers in ATen operations, up to bf16 rounding."""
    from conftest import tiny_target

    from eagle2.attention import causal_mask
    from eagle2.cpu.kernels import exact_bf16_kernels
    from eagle2.target import TargetModel

    if not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no exact bf16 kernels on this CPU")
    hf = tiny_target(seed=5, layers=3).hf.to(torch.bfloat16)
    target = TargetModel(hf, name="tiny-native").fuse()
    assert target.backend.native is ops
    tokens = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(3))
    mask = causal_mask(torch.tensor([50, 50]), 50)
    pos = torch.arange(50).expand(2, 50)
    outs = []
    for native in (ops, None):
        target.backend.native = native
        cache = target.allocate_cache(2, 64)
        outs.append(target.forward(tokens, pos, mask, cache, torch.arange(2)).hidden.float())
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)
    assert (outs[0] - outs[1]).abs().mean() < 0.01
    assert F.cosine_similarity(outs[0].flatten(), outs[1].flatten(), dim=0) > 0.999


def one_kernel_plan(kernel: str):
    """A plan that multiplies every row count by the FMA kernel ("fma") or the AMX one
    ("amx"); skips the test where this CPU has not that kernel."""
    from eagle2.cpu.kernels import (
        AMX,
        FMA,
        ROW_BUCKETS,
        BlockPlan,
        amx_linear_ops,
        exact_bf16_kernels,
        fma_linear_ops,
    )

    if not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")) or fma_linear_ops() is None:
        pytest.skip("no exact bf16 FMA kernels on this CPU")
    if kernel == "amx" and amx_linear_ops() is None:
        pytest.skip("no AMX tiles here")
    return BlockPlan({bucket: FMA if kernel == "fma" else AMX for bucket in ROW_BUCKETS})


@pytest.mark.parametrize("kernel", ["fma", "amx"])
def test_the_native_layer_operators_equal_their_calls_one_by_one(ops, kernel):
    """`eagle2_cpu::decoder_layer` (fused.NATIVE_LAYER) and the layers in one
    `eagle2_cpu::decoder_layers` call (fused.NATIVE_STACK) give bitwise the features and cache
    entries of the same operators called one by one from Python: a prefill of two prompts and
    a tree step of two requests with different trees, with and without layers whose inputs the
    target keeps (an EAGLE-3 head's features: the stack is cut there); the linears by the FMA
    kernel, or by the AMX one where the CPU has it."""
    from conftest import tiny_target

    from eagle2.attention import causal_mask
    from eagle2.cpu import fused
    from eagle2.target import TargetModel

    plan = one_kernel_plan(kernel)  # the operator's condition: one of them throughout
    hf = tiny_target(seed=5, layers=3).hf.to(torch.bfloat16)
    target = TargetModel(hf, name="tiny-native").fuse()
    for lw in target.backend.fused:
        for w in (lw.qkv, lw.o, lw.gate_up, lw.down):
            w.plan = plan
    gen = torch.Generator().manual_seed(3)
    tree = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                          [1, 0, 1, 0, 1]],
                         [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                          [1, 0, 0, 0, 1]]], dtype=torch.bool)
    depth = tree.sum(-1) - 1
    steps = [(torch.randint(0, 64, (2, 40), generator=gen), torch.arange(40).expand(2, 40),
              causal_mask(torch.tensor([40, 40]), 40)),
             (torch.randint(0, 64, (2, 5), generator=gen), depth, tree)]
    ways = {"one by one": (False, False), "decoder_layer": (True, False),
            "decoder_layers": (True, True)}
    try:
        for keep in (None, (1,)):
            target.set_feature_layers(keep)
            for tokens, pos, mask in steps:
                outs = []
                for op, (native_layer, stack) in ways.items():
                    fused.NATIVE_LAYER, fused.NATIVE_STACK = native_layer, stack
                    cache = target.allocate_cache(2, 64)
                    with torch.profiler.profile() as prof:
                        out = target.forward(tokens, pos, mask, cache, torch.arange(2))
                    called = {e.key for e in prof.key_averages()}
                    assert native_layer == (f"eagle2_cpu::{op}" in called)
                    # the stack runs layers 0 and 1-2 apart where layer 1's input is kept
                    calls = [e.count for e in prof.key_averages()
                             if e.key == "eagle2_cpu::decoder_layers"]
                    assert calls == ([] if not stack else [1 if keep is None else 2])
                    outs.append((out.hidden, out.features, cache.k.clone(), cache.v.clone()))
                for other in outs[1:]:
                    for a, b in zip(outs[0], other, strict=True):
                        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    finally:
        fused.NATIVE_LAYER, fused.NATIVE_STACK = True, True


def reference_attention(q, cache_k, cache_v, slots, base, tree_mask):
    """Plain fp32 softmax attention, one query at a time, over its keys in position order."""
    num_b, num_hq, num_n, dim = q.shape
    group = num_hq // cache_k.shape[1]
    out = torch.zeros(num_b, num_n, num_hq * dim)
    for b in range(num_b):
        for n in range(num_n):
            length = int(base[b])
            cols = list(range(length)) + [length + int(m) for m in
                                          torch.nonzero(tree_mask[b, n]).flatten()]
            for h in range(num_hq):
                keys = cache_k[slots[b], h // group, cols].float()
                vals = cache_v[slots[b], h // group, cols, :dim].float()
                p = torch.softmax(keys @ q[b, h, n].float() * dim ** -0.5, 0)
                out[b, n, h * dim:(h + 1) * dim] = p @ vals
    return out


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_attention_matches_softmax_attention_over_each_querys_keys(attn_ops, dim):
    """Committed keys of each request's slot, then its tree ancestors, with per-request
    lengths (some crossing a 16-key block) and slots out of order."""
    g = torch.Generator().manual_seed(dim)
    num_q, num_kv, slots, length = 6, 2, 3, 80
    cache_k = torch.randn(slots, num_kv, length, dim, generator=g).bfloat16()
    cache_v = torch.randn(slots, num_kv, length, dim + 1, generator=g).bfloat16()
    parents = [-1, 0, 0, 1, 3]
    tree = torch.zeros(5, 5, dtype=torch.bool)
    for node, parent in enumerate(parents):
        tree[node] = tree[parent] if parent >= 0 else tree[node]
        tree[node, node] = True
    tree_mask = tree.expand(3, 5, 5).clone()
    tree_mask[1] = torch.eye(5, dtype=torch.bool)  # a request whose nodes are all roots
    q = torch.randn(3, num_q, 5, dim, generator=g).bfloat16()
    slot_idx, base = torch.tensor([2, 0, 1]), torch.tensor([17, 0, 64])
    out = attn_ops.attention(q, cache_k, cache_v, slot_idx, base, tree_mask, dim ** -0.5)
    want = reference_attention(q, cache_k, cache_v, slot_idx, base, tree_mask)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_attention_of_a_tree_node_equals_plain_decoding_bitwise(attn_ops):
    """A node at depth 2 of a tree over committed length 30 sees the same keys in the same
    order as the same token decoded alone after its path was committed: the same bits."""
    g = torch.Generator().manual_seed(7)
    num_q, num_kv, dim, length = 9, 3, 64, 64
    cache_k = torch.randn(1, num_kv, length, dim, generator=g).bfloat16()
    cache_v = torch.randn(1, num_kv, length, dim + 1, generator=g).bfloat16()
    # tree after 30 committed: nodes 0 (root), 1, 2 (children of 0), 3 (child of 2)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]).bool()
    q = torch.randn(1, num_q, 4, dim, generator=g).bfloat16()
    in_tree = attn_ops.attention(q, cache_k, cache_v, torch.tensor([0]), torch.tensor([30]),
                            tree[None], dim ** -0.5)
    plain_k, plain_v = cache_k.clone(), cache_v.clone()
    for depth, node in enumerate([0, 2, 3]):  # node 3's path, committed in order
        plain_k[0, :, 30 + depth] = cache_k[0, :, 30 + node]
        plain_v[0, :, 30 + depth] = cache_v[0, :, 30 + node]
    alone = attn_ops.attention(q[:, :, 3:4].contiguous(), plain_k, plain_v, torch.tensor([0]),
                          torch.tensor([32]), torch.ones(1, 1, 1, dtype=torch.bool),
                          dim ** -0.5)
    assert torch.equal(in_tree[0, 3], alone[0, 0])


def test_every_node_of_a_branched_tree_equals_plain_decoding_bitwise(attn_ops):
    """A tree of 22 entries after 54 committed keys: a chain of 12 under the root, a branch of
    8 leaving it at depth 4, a leaf under the root, in depth order (the branches interleave); its
    paths cross the 32- and 64-key boundaries (where the AMX weighted sums change chunks, and
    entries of two branches would share one). Every node's output, with the committed keys and
    values kept in blocks and without, has the bits of the same token decoded alone after its
    path was committed."""
    from eagle2.cpu.attention import empty_key_blocks

    g = torch.Generator().manual_seed(17)
    num_q, num_kv, dim, size, base = 9, 3, 64, 128, 54
    # in depth order, as the engine's trees are: chain a1..a12 under the root, a leaf under
    # the root, branch b1..b8 under a3 (depths 4..11)
    parents, chain, branch = [-1], [0], [None]
    for depth in range(1, 13):
        chain.append(len(parents))
        parents.append(chain[depth - 1])
        if depth == 1:
            parents.append(0)  # the leaf
        if 4 <= depth <= 11:
            branch.append(len(parents))
            parents.append(chain[3] if depth == 4 else branch[-2])
    assert len(parents) == 22
    tree = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        assert parent < node
        tree[node] = tree[parent] if parent >= 0 else tree[node]
        tree[node, node] = True
    cache_k = torch.randn(1, num_kv, size, dim, generator=g).bfloat16()
    cache_v = torch.randn(1, num_kv, size, dim, generator=g).bfloat16()
    q = torch.randn(1, num_q, len(parents), dim, generator=g).bfloat16()
    args = (q, cache_k, cache_v, torch.tensor([0]), torch.tensor([base]), tree[None], dim ** -0.5)
    fresh = attn_ops.attention(*args)
    kept = attn_ops.attention(*args, *empty_key_blocks((1, num_kv), size, dim, value_tiles=True))
    assert torch.equal(fresh.view(torch.int16), kept.view(torch.int16))
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    for node in range(len(parents)):
        path = torch.nonzero(tree[node]).flatten().tolist()  # its ancestors, then itself
        plain_k, plain_v = cache_k.clone(), cache_v.clone()
        for depth, entry in enumerate(path):
            plain_k[0, :, base + depth] = cache_k[0, :, base + entry]
            plain_v[0, :, base + depth] = cache_v[0, :, base + entry]
        alone = attn_ops.attention(q[:, :, node:node + 1].contiguous(), plain_k, plain_v,
                                   torch.tensor([0]), torch.tensor([base + len(path) - 1]), one,
                                   dim ** -0.5)
        assert torch.equal(fresh[0, node].view(torch.int16), alone[0, 0].view(torch.int16)), node


def test_attention_of_a_long_chain_equals_each_token_decoded_alone_bitwise(attn_ops):
    """Chains of 20 tree tokens (two key blocks of the tree) after 37 and 5 committed keys,
    two requests in one call, on one and on two threads (the queries of a request then split
    between them): every token's output has the bits of the same query decoded alone, its
    chain before it committed."""
    g = torch.Generator().manual_seed(11)
    num_q, num_kv, dim, size, num_n = 9, 3, 64, 96, 20
    cache_k = torch.randn(2, num_kv, size, dim, generator=g).bfloat16()
    cache_v = torch.randn(2, num_kv, size, dim + 1, generator=g).bfloat16()
    q = torch.randn(2, num_q, num_n, dim, generator=g).bfloat16()
    slots, base = torch.tensor([1, 0]), torch.tensor([37, 5])
    chain = torch.tril(torch.ones(num_n, num_n, dtype=torch.bool)).expand(2, -1, -1)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            outs.append(attn_ops.attention(q, cache_k, cache_v, slots, base, chain, dim ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    one = torch.ones(1, 1, 1, dtype=torch.bool)
    for b in range(2):
        for n in range(num_n):
            alone = attn_ops.attention(q[b:b + 1, :, n:n + 1].contiguous(), cache_k, cache_v,
                                  slots[b:b + 1], base[b:b + 1] + n, one, dim ** -0.5)
            assert torch.equal(outs[0][b, n].view(torch.int16), alone[0, 0].view(torch.int16))


@pytest.mark.parametrize("value_tiles", [False, True])
def test_kept_key_blocks_give_the_bits_of_transposing_every_call(attn_ops, value_tiles):
    """The committed keys kept transposed from call to call (`KVCache.key_blocks`; with
    value_tiles the committed values too, as AMX tiles, where the tiles exist) through a
    request's life as the engine drives the cache: prefill, tree steps whose K land at the
    base and after, a step that rewinds the committed length below blocks kept earlier, a
    finished request's slot taken over by `copy_slot`, a new request in a used slot. Every
    call gives bitwise the outputs of the same call transposing every key afresh."""
    from eagle2.attention import KVCache
    from eagle2.cpu.attention import with_key_blocks

    g = torch.Generator().manual_seed(13)
    num_q, num_kv, dim, size = 9, 3, 64, 160
    cache = with_key_blocks(KVCache.allocate(1, 3, num_kv, size, dim, torch.bfloat16, "cpu",
                                             ones_column=True), value_tiles)
    cache.key_blocks.fill_(-1)  # whatever the memory held
    width = 8 if attn_ops.isa() == "avx2" else 16  # keys a block

    def call(slots, base, num_n):
        """New K/V at base + [0, num_n) of each slot (a chain), then both attentions."""
        for s, b in zip(slots, base, strict=True):
            cache.k[0, s, :, b:b + num_n] = torch.randn(num_kv, num_n, dim, generator=g).bfloat16()
            cache.v[0, s, :, b:b + num_n, :dim] = torch.randn(num_kv, num_n, dim,
                                                              generator=g).bfloat16()
        q = torch.randn(len(slots), num_q, num_n, dim, generator=g).bfloat16()
        chain = torch.tril(torch.ones(num_n, num_n, dtype=torch.bool)).expand(len(slots), -1, -1)
        args = (q, cache.k[0], cache.v[0], torch.tensor(slots), torch.tensor(base), chain,
                dim ** -0.5)
        kept = attn_ops.attention(*args, *cache.layer_key_blocks(0))
        fresh = attn_ops.attention(*args)
        assert torch.equal(kept.view(torch.int16), fresh.view(torch.int16)), (slots, base)
        for s, b in zip(slots, base, strict=True):
            assert cache.key_blocks_valid[0, s].tolist() == [b // width] * num_kv

    call([0, 1], [0, 0], 40)  # prefill of two requests
    length = [40, 40]
    for step in range(20):  # tree steps, 1-7 tokens committed each
        num_n = 1 + step % 7
        call([0, 1], length, num_n)
        length = [n + 1 + (step + b) % num_n for b, n in enumerate(length)]
    assert min(length) > 64
    call([1], [33], 5)  # rewound below the blocks kept: keys from 33 on rewritten
    call([1], [48], 3)  # ... so the blocks from 32 on are transposed again
    cache.lengths[:] = torch.tensor([length[0], 51, 0])
    cache.copy_slot(0, 1)  # slot 1's request finished; slot 0's moves there
    call([1], [length[0]], 4)
    call([0], [0], 20)  # a new request in slot 0 (its old blocks: another request's)
    call([0, 1, 2], [20, length[0] + 2, 0], 6)


@pytest.mark.slow  # a second process loading the build, ~6 s
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_process(ops):
    """torch's extension builder waits forever on the lock file of a build that was killed;
    the next process clears it (its own flock proves the file stale) and loads the ops."""
    import subprocess
    import sys

    code = ("import eagle2.cpu.native as n; (n._build_dir() / 'lock').touch(); "
            "assert n.cpu_ops() is not None; assert not (n._build_dir() / 'lock').exists()")
    done = subprocess.run([sys.executable, "-c", code], timeout=300, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_the_drafters_native_layer_matches_the_module_path(ops, kind):
    """A bf16 head's layer through `fused.native_head_layer` (what the drafter uses on a bf16
    CPU) gives the module path's outputs and cache entries up to bf16 rounding: the prefix,
    then one tree level whose nodes see only their own ancestors, for two requests in
    non-adjacent slots at different lengths."""
    from conftest import tiny_target

    from eagle2.attention import causal_mask
    from eagle2.cpu.kernels import exact_bf16_kernels
    from eagle2.drafter import Drafter
    from eagle2.eagle3 import new_eagle3_head
    from eagle2.head import new_head

    if not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no exact bf16 kernels on this CPU")
    target = tiny_target(seed=7, hidden=64, heads=4, kv_heads=2)
    make = new_head if kind == "eagle2" else new_eagle3_head
    head = make(target.config, seed=1, dtype=torch.bfloat16)
    fast, slow = (Drafter(head, target.embed, target.lm_head, 4, 96) for _ in range(2))
    assert fast.kernels.native is ops
    slow.kernels.native = None
    gen = torch.Generator().manual_seed(2)
    width = 64 if kind == "eagle2" else 3 * 64
    feats = torch.randn(2, 40, width, generator=gen).bfloat16()
    tokens = torch.randint(0, 64, (2, 40), generator=gen)
    counts = torch.tensor([40, 23])
    outs = []
    for d in (fast, slow):
        for sid in ("pad0", "pad1", "a"):
            d._slots([sid])  # slots 0 and 1 are taken: the requests land in 2 and 3
        slots = d._slots(["a", "b"])
        pos = torch.arange(40).expand(2, 40)
        first = d._run(slots, tokens, feats, pos, causal_mask(counts, 40), 2048)
        d.cache.lengths[slots] += counts
        # one level of 3 nodes over 2 earlier scratch entries: node j sees entry j % 2, itself
        anc = torch.zeros(2, 3, 5, dtype=torch.bool)
        for j in range(3):
            anc[:, j, j % 2] = anc[:, j, 2 + j] = True
        level = d._run(slots, tokens[:, :3], first[:, :3].contiguous(),
                       counts[:, None] + 1 + torch.zeros(2, 3, dtype=torch.long), anc, 2048)
        outs.append((first, level, d.cache.k[0, slots].clone()))
    for a, b in zip(outs[0][:2], outs[1][:2], strict=True):
        a = torch.cat([a[0], a[1, :23]]) if a.shape[1] == 40 else a
        b = torch.cat([b[0], b[1, :23]]) if b.shape[1] == 40 else b
        assert F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.999
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
    keys_fast, keys_slow = outs[0][2], outs[1][2]
    for b, n in enumerate((40, 23)):  # the prefix and the level's entries at n + 2 .. n + 4
        for cols in (slice(0, n), slice(n + 2, n + 5)):
            torch.testing.assert_close(keys_fast[b, :, cols].float(),
                                       keys_slow[b, :, cols].float(), rtol=0.05, atol=0.05)
    # q|k|v and gate|up ran as one packed weight each, packed again once the head changes
    fused = fast.kernels.fused_weights()
    assert fused is not None and fast.kernels.fused_weights() is fused
    with torch.no_grad():
        head.decoder.mlp.up_proj.weight.mul_(2)
    assert fast.kernels.fused_weights() is not fused


@pytest.mark.parametrize("vocab", [8192, 1000, 7])
def test_top_log_probs_are_log_softmax_and_topk(attn_ops, vocab):
    """`top_log_probs` (the drafter's top k of a level, one pass) gives torch's log_softmax
    top k: the same indices in the same order, values to fp32 rounding; among equal logits
    the first index first; at both widths (this build's and AVX2) and row counts that do not
    fill the lanes."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 2, vocab, generator=gen) * 4
    k = min(8, vocab)
    values, indices = attn_ops.top_log_probs(logits, k)
    ref = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    assert values.shape == indices.shape == (3, 2, k) and indices.dtype == torch.long
    assert torch.equal(indices, ref.indices)
    torch.testing.assert_close(values, ref.values, rtol=1e-5, atol=1e-5)
    tied = torch.zeros(1, vocab)
    tied[0, [5, 2, 6]] = 3.0  # three equal maxima, then equal zeros
    _, first = attn_ops.top_log_probs(tied, 5)
    assert first.tolist() == [[2, 5, 6, 0, 1]]
    with pytest.raises(RuntimeError, match="k must be"):
        attn_ops.top_log_probs(logits, vocab + 1)


def test_the_heads_layer_runs_as_one_operator(ops):
    """An EAGLE-2 head's layer with FMA-kernel weights runs as `eagle2_cpu::decoder_layer`
    (no input norm): bitwise the native calls one by one, features and cache entries, for a
    prefix and a tree level."""
    from conftest import tiny_target

    from eagle2.attention import causal_mask
    from eagle2.cpu import fused
    from eagle2.cpu.kernels import (
        FMA,
        ROW_BUCKETS,
        BlockPlan,
        PackedLinear,
        exact_bf16_kernels,
        fma_linear_ops,
    )
    from eagle2.drafter import Drafter
    from eagle2.head import new_head

    if not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")) or fma_linear_ops() is None:
        pytest.skip("no bf16 FMA kernels on this CPU")
    target = tiny_target(seed=7, hidden=64, heads=4, kv_heads=2)
    head = new_head(target.config, seed=1, dtype=torch.bfloat16)
    drafter = Drafter(head, target.embed, target.lm_head, 2, 96)
    plan = BlockPlan({rows: FMA for rows in ROW_BUCKETS})
    for w in (*drafter.kernels.fused_weights(), *(m.blocked() for m in head.modules()
                                           if isinstance(m, PackedLinear))):
        w.plan = plan
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 30, 64, generator=gen).bfloat16()
    tokens = torch.randint(0, 64, (1, 30), generator=gen)
    anc = torch.zeros(1, 3, 5, dtype=torch.bool)
    for j in range(3):
        anc[:, j, j % 2] = anc[:, j, 2 + j] = True
    outs = []
    try:
        for native_layer in (False, True):
            fused.NATIVE_LAYER = native_layer
            drafter.cache.lengths.zero_()
            slots = drafter._slots(["a"])
            with torch.profiler.profile() as prof:
                first = drafter._run(slots, tokens, feats, torch.arange(30)[None],
                                     causal_mask(torch.tensor([30]), 30), 2048)
                drafter.cache.lengths[slots] += 30
                level = drafter._run(slots, tokens[:, :3], first[:, :3].contiguous(),
                                     torch.full((1, 3), 31), anc, 2048)
            called = sum(e.count for e in prof.key_averages()
                         if e.key == "eagle2_cpu::decoder_layer")
            assert called == (2 if native_layer else 0)
            outs.append((first, level, drafter.cache.k[0, slots, :, :35].clone(),
                         drafter.cache.v[0, slots, :, :35].clone()))
    finally:
        fused.NATIVE_LAYER = True
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kernel", ["fma", "amx"])
def test_the_heads_calls_run_as_one_operator(ops, kernel):
    """An EAGLE-2 head's calls (embedding, fc, layer, draft-vocabulary top k) run as one
    `eagle2_cpu::head_step` each (`eagle2.cpu.head.HeadStep`) and draft bitwise the trees of the
    native calls one by one: dynamic and static trees, two requests at different lengths, the
    first draft and one after two more accepted positions each, the head cache's entries too."""
    from conftest import tiny_target

    from eagle2.config import TreeConfig
    from eagle2.cpu.kernels import PackedLinear
    from eagle2.drafter import Drafter
    from eagle2.head import new_head
    from eagle2.tree import static_shape

    plan = one_kernel_plan(kernel)
    target = tiny_target(seed=7, hidden=64, heads=4, kv_heads=2)
    head = new_head(target.config, seed=1, dtype=torch.bfloat16)
    one, by_calls = (Drafter(head, target.embed, target.lm_head, 4, 96) for _ in range(2))
    for d in (one, by_calls):
        d.kernels.vocab_proj.plan = plan
        for w in (*d.kernels.fused_weights(), *(m.blocked() for m in head.modules()
                                         if isinstance(m, PackedLinear))):
            w.plan = plan
    by_calls.kernels._head_step = lambda end, window: None
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 30, 64, generator=gen).bfloat16()
    tokens = torch.randint(0, 64, (2, 30), generator=gen)
    configs = (TreeConfig(total_tokens=12, depth=3, top_k=3, budget="fixed", lookup=4),
               TreeConfig(mode="static", total_tokens=10, budget="fixed"))
    for config in configs:
        trees, calls = [], []
        for d in (one, by_calls):
            for sid in ("a", "b"):
                d.release(sid)
            with torch.profiler.profile() as prof:
                first = d.draft(["a", "b"], feats, tokens, torch.tensor([30, 17]), config)
                later = d.draft(["a", "b"], feats[:, :2], tokens[:, 5:7], torch.tensor([2, 2]),
                                config)
            calls.append(sum(e.count for e in prof.key_averages()
                             if e.key == "eagle2_cpu::head_step"))
            slots = d._slots(["a", "b"])
            trees.append((first, later, d.cache.k[0, slots, :, :32].clone(),
                          d.cache.v[0, slots, :, :32].clone()))
        levels = config.depth + 1 if config.mode == "eagle2" else len(
            static_shape(config.total_tokens))
        assert calls == [2 * levels, 0]  # the update and each expanded level, both drafts
        for a, b in zip(*trees, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
                continue
            for name in a.__dataclass_fields__:
                assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_gives_the_slotted_bits_through_shared_and_reused_blocks(
        attn_ops, block_size):
    """The native attention and K/V writes over a paged cache (`KVCache.block_tables`, the key
    blocks kept per block) give bitwise what the slotted cache gives with every key transposed
    afresh, through what the engine does to blocks: scrambled tables, prefill, tree steps, a
    rewind, a prefix of full blocks shared by two requests, a request's blocks freed and taken
    by another (their kept counts stale) and a table that grows."""
    from eagle2.attention import KVCache
    from eagle2.cpu.attention import with_key_blocks

    g = torch.Generator().manual_seed(19)
    num_q, num_kv, dim, size, slots = 6, 2, 64, 192, 3
    ref = KVCache.allocate(1, slots, num_kv, size, dim, torch.bfloat16, "cpu", ones_column=True)
    paged = with_key_blocks(KVCache.allocate_paged(1, slots, 40, block_size, size, num_kv, dim,
                                                   torch.bfloat16, "cpu", ones_column=True))
    paged.key_blocks.fill_(-1)  # whatever the memory held
    width = 8 if attn_ops.isa() == "avx2" else 16  # keys a block
    order = torch.randperm(40, generator=g).tolist()
    per = size // block_size
    tables = {s: order[s * per:(s + 1) * per] for s in range(2)}
    tables[2] = []

    def show(s, count=per):
        paged.set_blocks(s, tables[s][:count])

    def call(slot_list, base, num_n):
        """New K/V at base + [0, num_n) of each slot (a chain) written by qkv_rope_write into
        both caches, then the attention over each: the same bits."""
        num_b = len(slot_list)
        qkv = torch.randn(num_b, num_n, (num_q + 2 * num_kv) * dim, generator=g).bfloat16()
        pos = torch.tensor(base)[:, None] + torch.arange(num_n)
        angle = pos[..., None].float() / (1 + torch.arange(dim).float())
        cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
        sl = torch.tensor(slot_list)
        chain = torch.tril(torch.ones(num_n, num_n, dtype=torch.bool)).expand(num_b, -1, -1)
        q = attn_ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, ref.k[0], ref.v[0], sl, pos)
        q_paged = attn_ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, paged.k[0], paged.v[0],
                                          sl, pos, paged.block_tables)
        assert torch.equal(q, q_paged)
        want = attn_ops.attention(q, ref.k[0], ref.v[0], sl, torch.tensor(base), chain,
                                  dim ** -0.5)
        got = attn_ops.attention(q, paged.k[0], paged.v[0], sl, torch.tensor(base), chain,
                                 dim ** -0.5, *paged.layer_key_blocks(0), paged.block_tables)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (slot_list, base)
        for s, b in zip(slot_list, base, strict=True):  # the pages before the base: kept
            for i in range(b // block_size):
                block = tables[s][i]
                assert paged.key_blocks_valid[0, block].tolist() == [block_size // width] * num_kv

    show(0), show(1)
    call([0, 1], [0, 0], 40)  # prefill of two requests
    length = [40, 40]
    for step in range(16):  # tree steps, 1-7 tokens committed each
        num_n = 1 + step % 7
        call([1, 0], length[::-1], num_n)
        length = [n + 1 + (step + b) % num_n for b, n in enumerate(length)]
    call([1], [33], 5)  # rewound below kept blocks: keys from 33 on rewritten
    call([1], [48], 3)
    # request 2 shares request 0's first two full blocks (a cached prefix) and grows
    shared = 2 * block_size
    tables[2] = tables[0][:2] + order[2 * per:3 * per - 2]
    ref.k[0, 2, :, :shared] = ref.k[0, 0, :, :shared]
    ref.v[0, 2, :, :shared] = ref.v[0, 0, :, :shared]
    show(2, 3)
    call([2, 0], [shared, length[0]], 7)
    show(2)
    call([0, 2], [length[0] + 3, shared + 5], 40)
    # request 1 finished: its blocks (kept counts stale) go to a new request in slot 1
    tables[1] = tables[1][1:] + tables[1][:1]
    show(1)
    call([1], [0], 50)
    call([2, 1], [shared + 20, 50], 6)


def test_paged_operators_refuse_tables_that_leave_the_cache(ops):
    """A block table naming a block past the cache, or positions past a slot's table, is a
    clear error before any write or read, never a stray memory access."""
    from eagle2.attention import KVCache
    from eagle2.cpu.attention import with_key_blocks

    num_q, num_kv, dim = 4, 2, 16
    cache = with_key_blocks(KVCache.allocate_paged(1, 2, 6, 16, 64, num_kv, dim, torch.bfloat16,
                                                   "cpu", ones_column=True))
    cache.set_blocks(0, [0, 1])
    cache.block_tables[1, 0] = 99  # no such block
    qkv = torch.randn(1, 3, (num_q + 2 * num_kv) * dim).bfloat16()
    cos, sin = torch.ones(1, 3, dim).bfloat16(), torch.zeros(1, 3, dim).bfloat16()
    pos = torch.tensor([[0, 1, 2]])
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="block table entry 99 out of range"):
        ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, cache.k[0], cache.v[0],
                           torch.tensor([1]), pos, block_tables=cache.block_tables)
    assert torch.equal(cache.k, before)
    q = ops.qkv_rope_write(qkv, cos, sin, num_q, num_kv, cache.k[0], cache.v[0],
                           torch.tensor([0]), pos, block_tables=cache.block_tables)
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None]
    with pytest.raises(RuntimeError, match="block table entry 99 out of range"):
        ops.attention(q, cache.k[0], cache.v[0], torch.tensor([1]), torch.tensor([0]), chain,
                      0.25, *cache.layer_key_blocks(0), block_tables=cache.block_tables)
    with pytest.raises(RuntimeError, match="out of range"):  # past the table's 4 blocks of 16
        ops.attention(q, cache.k[0], cache.v[0], torch.tensor([0]), torch.tensor([62]), chain,
                      0.25, *cache.layer_key_blocks(0), block_tables=cache.block_tables)
    out = ops.attention(q, cache.k[0], cache.v[0], torch.tensor([0]), torch.tensor([0]), chain,
                        0.25, *cache.layer_key_blocks(0), block_tables=cache.block_tables)
    assert out.shape == (1, 3, num_q * dim) and torch.isfinite(out.float()).all()
