"""Fused layers and blocked linears compute the same model as the module path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_engine, random_prompts, run, tiny_target

from eagle2.bench.load import busy_processes
from eagle2.config import SamplingParams, TreeConfig
from eagle2.cpu.kernels import (
    AMX,
    FMA,
    NATIVE,
    PACKED,
    ROW_BUCKETS,
    BlockedWeight,
    BlockPlan,
    amx_linear_ops,
    exact_bf16_candidates,
    exact_bf16_kernels,
    fma_linear_ops,
    measure_plan,
    native_linear_ops,
    one_family,
    packed_plan,
    packing_supported,
)


@pytest.mark.parametrize("block_bytes", [0, 1024, 4096, 1 << 20])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_blocked_weight_equals_linear(block_bytes, rows):
    torch.manual_seed(0)
    w = torch.randn(200, 48)
    x = torch.randn(2, rows, 48)
    blocked = BlockedWeight(w, BlockPlan({b: block_bytes for b in ROW_BUCKETS}))
    torch.testing.assert_close(blocked(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    if block_bytes:
        assert len(blocked.blocks(block_bytes)) > 1 or block_bytes >= w.numel() * 4


def test_measure_plan_picks_one_candidate_per_bucket():
    plan, timings = measure_plan([torch.randn(256, 64), torch.randn(64, 128)],
                                 row_buckets=(1, 4), candidates=(0, 4096), repeats=1)
    assert set(plan.block_bytes) == {1, 4} and set(timings[1]) == {0, 4096}
    assert plan.for_rows(3) == plan.block_bytes[4] and plan.for_rows(100) == 0


def test_fused_forward_equals_module_forward():
    target = tiny_target(seed=7)
    slow = make_engine(tiny_target(seed=7), None)  # LocalRunner fuses; undo it below
    slow.runner.target.backend.fused = None
    slow.runner.target.backend.head_proj = None
    fast = make_engine(target, None)
    # blocked too
    fast.runner.target.backend.plan.block_bytes.update({b: 2048 for b in ROW_BUCKETS})
    assert fast.runner.target.backend.fused is not None
    prompts = random_prompts(3, 64, seed=2)
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    pos = torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    feats_a, logits_a = slow.runner.forward(tokens, pos, mask, torch.tensor([0]))
    feats_b, logits_b = fast.runner.forward(tokens, pos, mask, torch.tensor([0]))
    torch.testing.assert_close(feats_b, feats_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(fast.runner.cache.k[:, 0, :, :5], slow.runner.cache.k[:, 0, :, :5],
                               rtol=1e-4, atol=1e-4)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    assert run(fast, prompts, greedy, TreeConfig("vanilla")) == \
        run(slow, prompts, greedy, TreeConfig("vanilla"))


def test_fusing_keeps_the_hf_module_working():
    target = tiny_target(seed=8)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = target.hf(ids).logits
    target.fuse()
    q = target.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == target.backend.fused[0].qkv.weight.data_ptr()  # a view, not a copy
    torch.testing.assert_close(target.hf(ids).logits, before)


def test_background_load_processes_are_killed():
    import os

    with busy_processes(2, max_seconds=60) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(not packing_supported(torch.bfloat16, torch.device("cpu")),
                    reason="needs oneDNN's packed bf16 kernels (AVX512/AMX)")
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576), (1000, 64)])
def test_packed_bf16_rows_do_not_depend_on_the_row_count(shape):
    """What exact bf16 verification rests on: a row's output is bitwise the same whether it is
    multiplied alone or with up to 600 others (wide weights go in column chunks)."""
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.bfloat16) / 24
    bw = BlockedWeight(weight, BlockPlan({rows: PACKED for rows in ROW_BUCKETS}))
    x = torch.randn(600, shape[1], dtype=torch.bfloat16)
    whole = bw(x)
    for rows in (1, 2, 5, 8, 16, 26, 32, 33, 64, 100, 228, 512):
        assert torch.equal(bw(x[:rows]), whole[:rows]), rows
    torch.testing.assert_close(whole.float(), (x.float() @ weight.float().T), rtol=0.02,
                               atol=0.05)


@pytest.mark.skipif(not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")),
                    reason="needs exact bf16 kernels (oneDNN packed or native FMA)")
def test_packed_linear_matches_linear_follows_updates_and_keeps_the_state_dict():
    from torch import nn

    from eagle2.cpu.kernels import PackedLinear, pack_linears

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.ReLU(),
                          nn.Sequential(nn.Linear(96, 32, bias=False), nn.Linear(32, 8)))
    model.to(torch.bfloat16)
    keys = set(model.state_dict())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    assert pack_linears(model) == 2 and pack_linears(model) == 0  # the biased one stays
    assert isinstance(model[0], PackedLinear) and type(model[2][1]) is nn.Linear
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0.02, atol=0.02)
        model[0].weight.mul_(2)  # an in-place update is seen (packed again)
        torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight),
                                   rtol=0.02, atol=0.05)
    model.float().to(torch.bfloat16)  # new storage, same version counter: packed again
    with torch.no_grad():
        torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight),
                                   rtol=0.02, atol=0.05)
    model.float()  # in fp32: F.linear, with gradients for training
    with torch.no_grad():
        torch.testing.assert_close(model[0](x.float()), x.float() @ model[0].weight.T)
    model(x.float()).sum().backward()
    assert model[0].weight.grad is not None


@pytest.fixture(scope="module")
def native_linear():
    if native_linear_ops() is None:
        pytest.skip("no native bf16 linear here (needs AVX512-BF16, a C++ compiler and "
                    "oneDNN summing in the same order)")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576), (1000, 64), (130, 1000)])
def test_native_bf16_linear_equals_the_packed_kernel_for_any_row_count(native_linear, shape,
                                                                       threads):
    """The native kernel is bitwise oneDNN's packed kernel, so a plan may mix them per row
    count and stay exact: every row count, 1 and 2 threads, flat and batched inputs, a
    column-chunked weight (1536 features) and outputs that are not a multiple of 64; each row
    count's outputs split over two threads are those of one thread."""
    torch.manual_seed(2)
    weight = torch.randn(shape, dtype=torch.bfloat16) / 24
    native = BlockedWeight(weight, BlockPlan({rows: NATIVE for rows in ROW_BUCKETS}))
    packed = BlockedWeight(weight, packed_plan())
    x = torch.randn(520, shape[1], dtype=torch.bfloat16) * 2
    counts = (1, 2, 3, 4, 5, 7, 8, 9, 16, 26, 33, 64, 100, 520)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = {rows: native(x[:rows]) for rows in counts}
        torch.set_num_threads(threads)
        whole = packed(x)
        for rows in counts:
            out = native(x[:rows])
            assert torch.equal(out, whole[:rows]) and torch.equal(out, one_thread[rows]), rows
        batched = x[:24].view(3, 8, shape[1])
        assert torch.equal(native(batched), whole[:24].view(3, 8, -1))
        assert torch.equal(native(x[:5, :].t().contiguous().t()), whole[:5])  # strided input
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kernel", ["fma", "amx"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576), (1000, 64), (130, 1000)])
def test_fma_linear_rows_do_not_depend_on_the_row_count(shape, threads, kernel):
    """The FMA variant, and the AMX one where the CPU has AMX: each row bitwise what it gives
    alone, for every row count and tile shape (FMA: 1-11 rows in one pass, each count its own
    tile, more 8 at a time, then the rest; AMX: 16-row groups and the rest), any row count
    split over two threads as over one, flat and batched and strided inputs, outputs that are
    not a multiple of 32; and within bf16 rounding of an fp64 product."""
    if fma_linear_ops() is None:
        pytest.skip("no native FMA linear here (needs AVX2 and FMA, and a C++ compiler)")
    if kernel == "amx" and (amx_linear_ops() is None or shape[1] % 32):
        pytest.skip("no AMX tiles here, or inputs that do not fill them")
    torch.manual_seed(3)
    weight = torch.randn(shape, dtype=torch.bfloat16) / 24
    fma = BlockedWeight(weight, BlockPlan({rows: FMA if kernel == "fma" else AMX
                                           for rows in ROW_BUCKETS}))
    x = torch.randn(300, shape[1], dtype=torch.bfloat16) * 2
    counts = (*range(1, 26), 26, 33, 64, 100, 300)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = {rows: fma(x[:rows]) for rows in counts}
        torch.set_num_threads(threads)
        whole = fma(x)
        for rows in counts:
            out = fma(x[:rows])
            assert torch.equal(out, whole[:rows]) and torch.equal(out, one_thread[rows]), rows
        for i in (0, 1, 7, 150, 299):
            assert torch.equal(fma(x[i:i + 1]), whole[i:i + 1]), i
        assert torch.equal(fma(x[:24].view(3, 8, shape[1])), whole[:24].view(3, 8, -1))
        assert torch.equal(fma(x[:5, :].t().contiguous().t()), whole[:5])
    finally:
        torch.set_num_threads(before)
    reference = (x.double() @ weight.double().T)
    torch.testing.assert_close(whole.double(), reference, rtol=1 / 64, atol=0.02)


def test_one_family_never_mixes_fma_with_the_bf16_kernels():
    """FMA results differ from PACKED / NATIVE in the last bits, so a plan takes FMA for every
    row count (when its sum over 1-16 rows is smaller) or none; bf16 kernels mix per row; AMX
    is a family of its own too."""
    faster = {1: {PACKED: 30, NATIVE: 20, FMA: 21}, 8: {PACKED: 60, NATIVE: 45, FMA: 30},
              64: {PACKED: 200, NATIVE: 240, FMA: 250}}
    assert set(one_family(faster).block_bytes.values()) == {FMA}
    slower = {1: {PACKED: 30, NATIVE: 20, FMA: 26}, 8: {PACKED: 60, NATIVE: 45, FMA: 44},
              64: {PACKED: 200, NATIVE: 240, FMA: 150}}
    assert one_family(slower).block_bytes == {1: NATIVE, 8: NATIVE, 64: PACKED}
    amx = {1: {PACKED: 30, FMA: 20, AMX: 22}, 8: {PACKED: 60, FMA: 44, AMX: 23},
           64: {PACKED: 200, FMA: 250, AMX: 40}}  # AMX: a family of its own, as FMA
    assert one_family(amx).block_bytes == {1: AMX, 8: AMX, 64: AMX}
    assert one_family({1: {FMA: 20, AMX: 22}, 8: {FMA: 25, AMX: 30}}).block_bytes == \
        {1: FMA, 8: FMA}  # (no bf16 kernel measured: an AVX2-only CPU)
    candidates = exact_bf16_candidates()  # what this machine has: (FMA,) on AVX2 alone
    if not candidates:
        return
    plan, _ = measure_plan([torch.randn(64, 64).bfloat16()], row_buckets=(1, 4),
                           candidates=candidates, repeats=1)
    assert len(set(plan.block_bytes.values())) == 1


def greedy_case(vocab: int, features: int, seed: int):
    """A bf16 weight with duplicated outputs (exact ties) and outputs one bf16 step apart in
    one feature (logits that tie once rounded to bf16, not before), its FMA BlockedWeight and
    GreedyArgmax; None where the native operators are missing."""
    from eagle2.cpu.kernels import GreedyArgmax, greedy_argmax_ops

    plan = BlockPlan({rows: FMA for rows in ROW_BUCKETS})
    ops = greedy_argmax_ops(plan, torch.bfloat16, torch.device("cpu"))
    if ops is None:
        return None
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, features, generator=g) / features ** 0.5).bfloat16()
    weight[vocab // 2] = weight[5]  # exact ties with output 5 (and 5 < vocab // 2)
    weight[vocab - 1] = weight[5]
    near = weight[9].clone()
    away = near[0].float() * 2  # one bf16 step away from zero: a larger product with x[9]
    near[0] = torch.nextafter(near[0].float().bfloat16(), away.bfloat16())
    weight[vocab // 3] = near  # a hair above output 9 for inputs along it
    proj = BlockedWeight(weight, plan)
    return proj, GreedyArgmax(proj, ops), weight


@pytest.mark.parametrize("int8_pass", ["vnni", "tiles"])
@pytest.mark.parametrize("shape", [(1000, 64), (4099, 576), (49152, 576), (130, 1000)])
def test_greedy_argmax_is_the_argmax_of_the_fma_logits(shape, int8_pass):
    """GreedyArgmax (an int8 pass bounds every logit, the possible winners computed exactly):
    bitwise `argmax(proj.fma(x))` for 1-17 rows of random inputs, spread-out and
    near-uniform logits, exact ties (the lowest index wins), logits that tie only after
    bf16 rounding, a zero row, on one thread and two; a non-finite row or a plan that is not
    FMA for the row count hands back to the logits (None). The int8 pass by vpdpwssd, or on
    the AMX tiles for every row count (where the CPU has them; 16 rows a pass, then 1)."""
    case = greedy_case(*shape, seed=shape[0])
    if case is None:
        pytest.skip("no native FMA linear here (needs AVX2 and FMA, and a C++ compiler)")
    proj, greedy, weight = case
    if int8_pass == "tiles":
        if greedy.q_tiles is None:
            pytest.skip("no AMX tiles here, or inputs that are not a multiple of 64")
        greedy.tile_rows = 1
    else:
        greedy.q_tiles = None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, shape[1], generator=g) * 4
    x[3] *= 1e-3  # near-uniform logits: many outputs within the bound of the largest
    x[4] = weight[5].float() * 50  # output 5 and its copies lead: ties
    x[5] = weight[9].float() * 50  # output 9 and its near copy
    x[6] = 0.0  # every logit 0: output 0
    x = x.bfloat16()
    logits = proj.fma(x).float()
    assert logits[4].max() == logits[4, 5] == logits[4, shape[0] // 2]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):  # the int8 pass's blocks split over the threads
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 5, 8, 9, 17):
                assert torch.equal(greedy(x[:rows]), logits[:rows].argmax(-1)), (rows, threads)
    finally:
        torch.set_num_threads(before)
    for i in range(17):
        assert torch.equal(greedy(x[i:i + 1]), logits[i:i + 1].argmax(-1)), i
    assert torch.equal(greedy(x[:6].view(2, 3, -1)), logits[:6].argmax(-1).view(2, 3))
    assert int(greedy(x[4:5])) == 5 and int(greedy(x[6:7])) == 0
    # output 9's fp32 sum is below its near copy's, their bf16 logits tie: 9 wins
    assert logits[5, 9] == logits[5, shape[0] // 3] and int(greedy(x[5:6])) == 9
    bad = x[:3].clone()
    bad[1, 0] = float("nan")
    assert greedy(bad) is None
    proj.plan.block_bytes[4] = PACKED
    assert greedy(x[:3]) is None and greedy(x[:1]) is not None


def test_linear_amx_says_what_it_cannot_take():
    """Inputs whose features are not a multiple of 32 (one tile row) are refused with a
    message, not multiplied wrongly; a draft head's plan that names AMX for such a weight
    takes the FMA kernel instead."""
    if amx_linear_ops() is None:
        pytest.skip("no AMX tiles here")
    ops = amx_linear_ops()
    weight = torch.randn(64, 48).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_amx(torch.randn(2, 48).bfloat16(), ops.pack_linear(weight), 64)
    amx = BlockedWeight(weight, BlockPlan({rows: AMX for rows in ROW_BUCKETS}))
    fma = BlockedWeight(weight, BlockPlan({rows: FMA for rows in ROW_BUCKETS}))
    x = torch.randn(3, 48).bfloat16()
    assert torch.equal(amx(x), fma(x))


def test_a_target_on_amx_keeps_its_lm_head_on_the_fma_kernel(monkeypatch):
    """Where the measured plan puts the layers on AMX, the lm_head stays on the FMA kernel, so
    greedy tokens come from its int8 copy (`GreedyArgmax`); the layers' plan says AMX."""
    import eagle2.cpu as cpu_backend
    from eagle2.target import TargetModel

    if amx_linear_ops() is None or fma_linear_ops() is None:
        pytest.skip("no AMX tiles here")
    amx_plan = BlockPlan({rows: AMX for rows in ROW_BUCKETS})
    monkeypatch.setattr(cpu_backend, "cached_plan", lambda *a, **k: amx_plan)
    hf = tiny_target(seed=3, layers=2).hf.to(torch.bfloat16)
    target = TargetModel(hf, name="tiny-amx").fuse(measure=True)
    assert set(target.backend.plan.block_bytes.values()) == {AMX}
    assert set(target.backend.head_proj.plan.block_bytes.values()) == {FMA}
    assert target.backend.greedy_head is not None
