"""Log-probabilities under speculation are the target's own, position by position: what a
forward of the whole text gives (an independent reference: no cache, no tree), whichever
mode drafted the tokens (docs/draft-tree.md "Log-probabilities")."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine, random_prompts, tiny_target

from eagle2.config import MAX_LOGPROBS, SamplingParams, TreeConfig
from eagle2.engine import Engine, Request
from eagle2.verify import TokenLogprobs

TOP = 5
TREES = {"eagle2": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed"),
         "chain": TreeConfig("chain", depth=5, budget="fixed"),
         "vanilla": TreeConfig("vanilla")}


def generate(engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
             tree: TreeConfig) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """(tokens, their TokenLogprobs) per prompt, all requests together."""
    out: dict[str, tuple[list[int], list | None]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add(Request(f"r{i}", tuple(p), sp, tree))
        out[f"r{i}"] = ([], [] if sp.logprobs is not None else None)
    while engine.has_work():
        for ev in engine.step():
            toks, lps = out[ev.seq_id]
            toks.extend(ev.token_ids)
            assert (ev.logprobs is None) == (lps is None)
            if lps is not None:
                assert len(ev.logprobs) == len(ev.token_ids)
                lps.extend(ev.logprobs)
    return [out[f"r{i}"] for i in range(len(prompts))]


def reference(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax of the target's logits at the positions that predict `tokens`, from one
    forward of the whole text through the HF module (no cache, no tree) -> [n, V]."""
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logits = target.hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def check(ref: torch.Tensor, tokens: list[int], got: list[TokenLogprobs], top: int) -> None:
    assert len(got) == len(tokens) == ref.shape[0]
    for j, (t, e) in enumerate(zip(tokens, got, strict=True)):
        assert e.logprob == pytest.approx(float(ref[j, t]), abs=1e-4), j
        values, ids = ref[j].topk(top)
        assert [i for i, _ in e.top] == ids.tolist(), j
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4), j
        assert e.top == tuple(sorted(e.top, key=lambda x: -x[1]))


@pytest.mark.parametrize("mode", list(TREES))
def test_greedy_logprobs_equal_a_whole_text_forward_in_every_mode(mode):
    """Draft tokens accepted several a step get, each, the logits of the accepted node before
    it (the row plain decoding computes); the first token its prompt's last row. Asking does
    not change the tokens."""
    target = tiny_target(vocab=48, seed=21)
    prompts = random_prompts(4, 48, seed=4)
    asking = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP)] * 4
    engine = make_engine(target, 0 if mode != "vanilla" else None)
    out = generate(engine, prompts, asking, TREES[mode])
    if mode != "vanilla":
        assert engine.stats.steps < 4 * 24  # speculation accepted several tokens a step
    plain = generate(make_engine(target, None), prompts,
                     [SamplingParams(max_tokens=24, ignore_eos=True)] * 4, TREES["vanilla"])
    assert [t for t, _ in out] == [t for t, _ in plain]
    for p, (tokens, lps) in zip(prompts, out, strict=True):
        check(reference(target, p, tokens), tokens, lps, TOP)
        greedy_top = [e.top[0][0] for e in lps]
        assert greedy_top == tokens  # greedy: the most likely token is the output


def test_only_the_asking_requests_get_logprobs_and_k_is_theirs():
    """In one batch: a request without logprobs, one with the chosen token's only (0), one
    with the most likely 3; sampled rows too (the target's own distribution, before
    temperature and top-p)."""
    target = tiny_target(vocab=48, seed=22)
    prompts = random_prompts(4, 48, seed=5)
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0),
              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9,
                             seed=7, logprobs=2)]
    out = generate(make_engine(target, 0), prompts, params, TREES["eagle2"])
    assert out[0][1] is None
    for i, top in ((1, 0), (2, 3), (3, 2)):
        tokens, lps = out[i]
        assert all(len(e.top) == top for e in lps)
        check(reference(target, prompts[i], tokens), tokens, lps, top)
    # the seeded sample is the same with and without logprobs
    again = generate(make_engine(target, 0), prompts[3:],
                     [SamplingParams(**{**params[3].__dict__, "logprobs": None})],
                     TREES["eagle2"])
    assert again[0][0] == out[3][0]


def test_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=-1)


def test_embedded_model_eagle2_logprobs_equal_plain_decodings(smol):
    """The embedded SmolLM2 with its shipped head: log-probabilities under EAGLE-2 equal
    plain decoding's (both through the engine's cache; fp32) and a whole-text forward's."""
    text = "Name three colours of the rainbow."
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=TOP)
    ids = smol.encode(text, True)
    fixed = TreeConfig("eagle2", budget="fixed")  # speculate whatever the costs say
    spec = smol.generate_ids([smol.request(ids, params, fixed)])[0]
    plain = smol.generate_ids([smol.request(ids, params, TreeConfig("vanilla"))])[0]
    assert spec.token_ids == plain.token_ids and spec.num_steps < plain.num_steps
    for a, b in zip(spec.logprobs, plain.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    check(reference(smol.target, ids, spec.token_ids), spec.token_ids, spec.logprobs, TOP)


def test_bf16_embedded_logprobs_are_plain_decodings_bit_for_bit():
    """The service's default on this CPU (bf16, exact attention): a verified node's features
    are plain decoding's bit for bit, so are its log-probabilities."""
    from eagle2.api import Eagle2
    from eagle2.cpu.kernels import exact_bf16_kernels

    if not exact_bf16_kernels(torch.bfloat16, torch.device("cpu")):
        pytest.skip("exact bf16 verification needs the packed bf16 or native kernels")
    model = Eagle2.load(max_batch=1, max_context=512, dtype="bfloat16", device="cpu",
                        threads=None)
    ids = model.encode("Name three colours of the rainbow.", True)
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=TOP)
    spec = model.generate_ids([model.request(ids, params, TreeConfig("eagle2",
                                                                     budget="fixed"))])[0]
    plain = model.generate_ids([model.request(ids, params, TreeConfig("vanilla"))])[0]
    assert spec.token_ids == plain.token_ids and spec.num_steps < plain.num_steps
    assert spec.logprobs == plain.logprobs
