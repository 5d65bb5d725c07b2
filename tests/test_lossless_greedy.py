"""Greedy speculative output equals plain greedy decoding, token for token.

See docs/draft-tree.md "Verification".
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target

from eagle2.config import SamplingParams, TreeConfig
from eagle2.cpu.kernels import exact_bf16_kernels
from eagle2.target import TargetModel

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
TREES = {
    "eagle2": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed"),
    "static": TreeConfig("static", total_tokens=26, budget="fixed"),
    "chain": TreeConfig("chain", depth=5, budget="fixed"),
}


def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("head_seed", [0, 1, 2])
def test_tiny_llama_all_modes_equal_vanilla_and_hf(head_seed):
    target = tiny_target(vocab=48, seed=10 + head_seed)
    prompts = random_prompts(8, 48, seed=head_seed)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    if head_seed == 0:
        assert [hf_greedy(target, p, 40) for p in prompts] == vanilla
    for name, tree in TREES.items():
        engine = make_engine(target, head_seed)
        assert run(engine, prompts, GREEDY, tree) == vanilla, name
        assert engine.stats.steps < 8 * 40  # batched: fewer steps than tokens


def test_batch_of_four_different_lengths_equals_each_alone():
    target = tiny_target(vocab=48, seed=5)
    prompts = [[1, 2, 3], list(range(5, 22)), [7] * 9, [4, 44, 4, 44, 4]]
    tree = TREES["eagle2"]
    together = run(make_engine(target, 0, max_batch=4), prompts, GREEDY, tree)
    alone = [run(make_engine(target, 0, max_batch=1), [p], GREEDY, tree)[0] for p in prompts]
    assert together == alone


def test_continuous_batching_mixed_modes_and_lengths():
    """More requests than slots, different max_tokens and modes: each equals its solo run."""
    target = tiny_target(vocab=48, seed=6)
    engine = make_engine(target, 0, max_batch=3)
    prompts = random_prompts(7, 48, seed=9)
    from eagle2.engine import Request

    trees = list(TREES.values()) + [TreeConfig("vanilla")]
    out = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=10 + 5 * i, ignore_eos=True)
        engine.add(Request(f"r{i}", tuple(p), params, trees[i % 4]))
        out[f"r{i}"] = []
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
    assert max(engine.stats.batch_sizes) == 3
    vanilla = make_engine(target, None)
    for i, p in enumerate(prompts):
        solo = run(vanilla, [p], SamplingParams(max_tokens=10 + 5 * i, ignore_eos=True),
                   TreeConfig("vanilla"))[0]
        assert out[f"r{i}"] == solo, i


def test_reduced_draft_vocabulary_is_still_lossless():
    target = tiny_target(vocab=48, seed=7)
    prompts = random_prompts(8, 48, seed=3)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0, draft_vocab=torch.arange(0, 48, 3))
    assert run(engine, prompts, GREEDY, TREES["eagle2"]) == vanilla


def test_bad_requests_raise_value_error():
    from eagle2.engine import Request

    target = tiny_target(vocab=48, seed=0)
    engine = make_engine(target, 0, max_context=64)
    tree = TREES["eagle2"]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add(Request("a", (), GREEDY, tree))
    with pytest.raises(ValueError, match="context"):
        engine.add(Request("b", tuple(range(40)) * 2, GREEDY, tree))
    with pytest.raises(ValueError, match="token ids"):
        engine.add(Request("c", (1, 2, 999), GREEDY, tree))
    no_head = make_engine(target, None)
    with pytest.raises(ValueError, match="draft head"):
        no_head.add(Request("d", (1, 2), GREEDY, tree))


def test_generation_runs_past_the_draft_window():
    """A window shorter than the prompt keeps drafting (and stays lossless)."""
    target = tiny_target(vocab=48, seed=8)
    prompts = random_prompts(2, 48, seed=4, lo=60, hi=80)
    tree = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, draft_window=16,
                      budget="fixed")
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    assert run(make_engine(target, 0), prompts, GREEDY, tree) == vanilla


def test_restarts_of_the_head_stay_lossless():
    """Prompts longer than catch_up (the head restarts from their last positions) and the
    backlog of an auto budget's plain steps: outputs equal plain decoding."""
    target = tiny_target(vocab=48, seed=8)
    prompts = random_prompts(3, 48, seed=5, lo=40, hi=70)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    for budget in ("fixed", "auto"):
        tree = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, budget=budget,
                          catch_up=16)
        engine = make_engine(target, 0)
        restarts = []
        restart = engine.drafter._restart
        engine.drafter._restart = lambda *a, seen=restarts, real=restart: \
            seen.append(a[-1]) or real(*a)
        assert run(engine, prompts, GREEDY, tree) == vanilla, budget
        assert restarts  # the prompts at least


def test_embedded_smollm2_modes_equal_hf_greedy(smol):
    prompts = ["Write a haiku about the sea.", "What is the capital of France? Explain.",
               "Write a Python function that reverses a string."]
    params = SamplingParams(max_tokens=64)  # both stop at EOS (kept in the output)
    ids = [smol.encode(p) for p in prompts]
    ref = [hf_greedy(smol.target, x, 64) for x in ids]
    for mode in ("eagle2", "static", "chain"):
        outs = smol.generate(prompts, params, mode=mode)
        assert [o.token_ids for o in outs] == ref, mode


needs_exact_bf16 = pytest.mark.skipif(
    not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")),
    reason="exact bf16 verification needs oneDNN's packed bf16 kernels (AVX512/AMX) or the "
           "native FMA kernel (AVX2 and a C++ compiler)")


def bf16_target(seed: int) -> TargetModel:
    target = tiny_target(vocab=48, seed=seed, layers=3)
    target.hf.to(torch.bfloat16)
    return TargetModel(target.hf, name=f"tiny-bf16-{seed}")


@needs_exact_bf16
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_all_modes_equal_vanilla_in_a_batch(seed):
    """bf16 on a CPU: every mode, eight prompts batched (64-token contexts cross several
    attention chunks), equals plain decoding of each prompt alone, token for token."""
    target = bf16_target(20 + seed)
    prompts = random_prompts(8, 48, seed=seed, lo=3, hi=40)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    alone = [run(make_engine(target, None, max_batch=1), [p], params, TreeConfig("vanilla"))[0]
             for p in prompts]
    assert run(make_engine(target, None), prompts, params, TreeConfig("vanilla")) == alone
    trees = {**TREES, "wide": TreeConfig("eagle2", total_tokens=60, depth=6, top_k=8,
                                         budget="fixed")}
    for name, tree in trees.items():
        assert run(make_engine(target, seed), prompts, params, tree) == alone, name


@needs_exact_bf16
def test_bf16_native_linears_mixed_with_packed_ones_equal_vanilla():
    """The kernel plan a large bf16 model measures (the native linear for a few rows,
    oneDNN's for more, `kernels.exact_bf16_candidates`): every mode, batched, equals plain
    decoding of each prompt alone through oneDNN's kernel only."""
    from eagle2.cpu.kernels import NATIVE, native_linear_ops

    if native_linear_ops() is None:
        pytest.skip("no native bf16 linear here")
    target = bf16_target(30)
    prompts = random_prompts(6, 48, seed=3, lo=3, hi=40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [run(make_engine(target, None, max_batch=1), [p], params, TreeConfig("vanilla"))[0]
             for p in prompts]
    mixed = {rows: NATIVE if rows <= 8 else target.backend.plan.block_bytes[rows]
             for rows in target.backend.plan.block_bytes}
    target.backend.plan.block_bytes.update(mixed)
    assert run(make_engine(target, None), prompts, params, TreeConfig("vanilla")) == alone
    for name, tree in TREES.items():
        assert run(make_engine(target, 1), prompts, params, tree) == alone, name


@needs_exact_bf16
def test_bf16_greedy_tokens_without_logits_equal_decoding_through_the_logits():
    """Greedy steps through `TargetModel.greedy_tokens` (GreedyArgmax: the lm_head's argmax
    from an int8 pass and the few outputs that could win, computed exactly), every mode
    batched, equal plain decoding of each prompt alone through the full logits; the greedy
    head served the prefills and every verification (a vocabulary of 4099, not a multiple of
    the kernel's blocks)."""
    from eagle2.cpu.kernels import FMA, ROW_BUCKETS, GreedyArgmax, greedy_argmax_ops

    target = tiny_target(vocab=4099, seed=33, layers=3, logit_scale=4.0)
    target.hf.to(torch.bfloat16)
    target = TargetModel(target.hf, name="tiny-bf16-33").fuse()
    target.backend.plan.block_bytes.update({rows: FMA for rows in ROW_BUCKETS})
    ops = greedy_argmax_ops(target.backend.plan, target.dtype, target.device)
    if ops is None:
        pytest.skip("no native FMA linear here")
    greedy = GreedyArgmax(target.backend.head_proj, ops)
    target.backend.greedy_head = None  # the reference: argmax of the logits
    prompts = random_prompts(6, 4099, seed=5, lo=3, hi=40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [run(make_engine(target, None, max_batch=1), [p], params, TreeConfig("vanilla"))[0]
             for p in prompts]
    target.backend.greedy_head = greedy  # the cost model times the lm_head both ways
    flushes = []
    logits_s, greedy_s = make_engine(target, None).runner.head_seconds(
        (1, 3), passes=1, before=lambda: flushes.append(1))
    assert greedy_s is not None and min(logits_s + greedy_s) > 0
    assert len(flushes) == 4  # before every timed call: 2 row counts x (logits, argmax)
    served = []

    def counted(hidden):
        tokens = greedy(hidden)
        served.append(tokens is not None)
        return tokens

    target.backend.greedy_head = counted
    assert run(make_engine(target, None), prompts, params, TreeConfig("vanilla")) == alone
    assert len(served) == 40  # the batch's prefill, then 39 steps
    for name, tree in TREES.items():
        before = len(served)
        assert run(make_engine(target, 4), prompts, params, tree) == alone, name
        assert len(served) > before, name
    assert all(served)


@needs_exact_bf16
@pytest.mark.parametrize("kernel", ["fma", "amx"])
def test_bf16_fma_linears_equal_vanilla(kernel):
    """The other exact families (`kernels.FMA`, fp32 FMAs over the packed bf16 weight, chosen
    where vdpbf16ps is slow; `kernels.AMX`, the tile unit's sums over the same packed weight,
    where the CPU has AMX): every row count through one, every mode batched equals plain
    decoding of each prompt alone through it."""
    from eagle2.cpu.kernels import AMX, FMA, ROW_BUCKETS, amx_linear_ops, fma_linear_ops

    if fma_linear_ops() is None:
        pytest.skip("no native FMA linear here")
    if kernel == "amx" and amx_linear_ops() is None:
        pytest.skip("no AMX tiles here")
    target = bf16_target(31).fuse()  # fusing sets its own plan; this one replaces it
    chosen = FMA if kernel == "fma" else AMX
    target.backend.plan.block_bytes.update({rows: chosen for rows in ROW_BUCKETS})
    prompts = random_prompts(6, 48, seed=4, lo=3, hi=40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [run(make_engine(target, None, max_batch=1), [p], params, TreeConfig("vanilla"))[0]
             for p in prompts]
    assert set(target.backend.plan.block_bytes.values()) == {chosen}  # fusing kept the plan
    assert run(make_engine(target, None), prompts, params, TreeConfig("vanilla")) == alone
    for name, tree in TREES.items():
        assert run(make_engine(target, 2), prompts, params, tree) == alone, name
