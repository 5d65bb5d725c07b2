"""EAGLE-3 training with the training-time test (eagle2.train.ttt).

The unrolled training pass must compute exactly what the drafter computes when it drafts a
chain through the head's KV cache (docs/training.md "Training a head"); training must lower the
loss and raise the acceptance of a tiny target's drafts while decoding stays lossless; an
interrupted run resumes to the same state.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, run, tiny_target

from eagle2.attention import step_inputs
from eagle2.config import SamplingParams, TreeConfig
from eagle2.drafter import Drafter
from eagle2.engine import Engine, Request
from eagle2.head import load_head, new_head, save_head
from eagle2.runner import LocalRunner
from eagle2.train import data
from eagle2.train.ttt import TTTConfig, TTTTrainer, build_eagle3_head, collate, target_pass, unroll

VOCAB, LAYERS = 48, 4
AUX = (0, 1, 2)  # output ids: the inputs of layers 1, 2, 3
CFG = TTTConfig(steps=3, lr=3e-3, warmup=2, epochs=1.0, batch_tokens=512, noise=0.0,
                log_every=1, eval_every=10_000, checkpoint_seconds=1e9, bf16="off")


def greedy_sequences(target, n: int, seed: int = 0, new: int = 24) -> list[data.Sequence]:
    prompts = random_prompts(n, VOCAB, seed=seed, lo=3, hi=10)
    seqs = []
    for p in prompts:
        x = torch.tensor([p])
        out = target.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        ids = out[0]
        seqs.append(data.Sequence(ids, data.loss_mask(len(p), len(ids)), None))
    return seqs


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(vocab=VOCAB, layers=LAYERS, seed=4)
    return target, greedy_sequences(target, 16)


def make_trainer(target, seqs, out: Path, cfg: TTTConfig = CFG, vocab: int = 0) -> TTTTrainer:
    head = build_eagle3_head(target, seqs, vocab, seed=0, aux_layer_ids=AUX)
    return TTTTrainer(head, target, seqs, seqs[:3], cfg, out)


@pytest.mark.parametrize("kind", ["eagle3", "eagle2"])
def test_unrolled_steps_equal_chain_drafting_through_the_cache(tiny, kind):
    """Step k at position t == the head run at tree depth k over the committed prefix 0..t
    (true features) and the chain of its own outputs, as Drafter does it."""
    target, seqs = tiny
    if kind == "eagle3":
        head = build_eagle3_head(target, seqs, 0, seed=1, aux_layer_ids=AUX).eval()
    else:
        head = new_head(target.config, seed=1).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # make the later steps differ visibly from step 0
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = collate(seqs[:2])
    feats, _ = target_pass(target.hf, batch, head.feature_layers(LAYERS))
    with torch.no_grad():
        outs = unroll(head, target.embed, batch.input_ids, batch.lengths, feats, 3)
    ids, length = batch.input_ids[0], int(batch.lengths[0])
    for t in (3, length - 5):
        cache = head.allocate_cache(1, 64)
        slot = torch.tensor([0])
        with torch.no_grad():
            embeds = target.embed(ids[1:t + 2])[None]  # pairs 0..t: token[i + 1]
            causal = torch.tril(torch.ones(1, t + 1, t + 1, dtype=torch.bool))
            inp = step_inputs(cache, slot, causal, torch.arange(t + 1)[None], head.rotary,
                              embeds)
            g = head.step(embeds, feats[0:1, :t + 1], cache, inp)[:, -1:]
            cache.lengths[0] = t + 1
            torch.testing.assert_close(g[0, 0], outs[0][0, t], atol=1e-5, rtol=1e-5)
            for k in (1, 2):
                emb = target.embed(ids[t + 1 + k:t + 2 + k])[None]
                mask = torch.ones(1, 1, k, dtype=torch.bool)  # its chain ancestors + itself
                inp = step_inputs(cache, slot, mask, torch.tensor([[t + k]]), head.rotary, emb)
                g = head.step(emb, g, cache, inp)
                torch.testing.assert_close(g[0, 0], outs[k][0, t], atol=1e-5, rtol=1e-5)


def accepted_drafts(target, head, prompts, tree) -> tuple[list[list[int]], int]:
    target.set_feature_layers(head.feature_layers(target.num_layers))
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=8, max_len=256)
    engine = Engine(LocalRunner(target, 8, 256 + Engine.tree_margin), drafter, max_batch=8,
                    max_context=256)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out, accepted = {}, 0
    for i, p in enumerate(prompts):
        engine.add(Request(f"s{i}", tuple(p), params, tree))
        out[f"s{i}"] = []
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].extend(ev.token_ids)
            if ev.finished:
                accepted += sum(n * d for d, n in ev.accepted_at_depth.items())
    target.set_feature_layers(None)
    return [out[f"s{i}"] for i in range(len(prompts))], accepted


def test_training_lowers_the_loss_and_its_drafts_get_accepted_losslessly(tiny, tmp_path):
    target, seqs = tiny
    t = make_trainer(target, seqs, tmp_path, replace(CFG, epochs=60.0), vocab=24)
    before = t.evaluate(seqs)
    untrained = build_eagle3_head(target, seqs, 24, seed=0, aux_layer_ids=AUX).eval()
    summary = t.run()
    after = t.evaluate(seqs)
    assert after["loss"] < 0.5 * before["loss"]
    assert all(a > b for a, b in zip(after["acc"], before["acc"], strict=True))
    assert summary["steps"] == t.total_steps
    save_head(t.head.eval(), tmp_path / "head", target_config=target.config)
    head = load_head(tmp_path / "head")
    assert head.d2t.numel() == 24 and head.feature_layers(LAYERS) == (1, 2, 3)
    prompts = [s.input_ids[:6].tolist() for s in seqs[:6]]  # contexts it was trained on
    tree = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, budget="fixed",
                      lookup=0)  # the head's own drafts only
    got, accepted = accepted_drafts(target, head, prompts, tree)
    _, accepted_untrained = accepted_drafts(target, untrained, prompts, tree)
    vanilla = Engine(LocalRunner(target, 8, 256 + Engine.tree_margin), None, max_batch=8,
                     max_context=256)
    assert got == run(vanilla, prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                      TreeConfig("vanilla"))
    assert accepted > max(2 * accepted_untrained, 20)
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log[0]["acc"]) == CFG.steps and "val_acc" in log[-1]


def test_interrupted_run_resumes_to_the_same_state(tiny, tmp_path):
    target, seqs = tiny
    cfg = replace(CFG, epochs=3.0, noise=0.1)
    whole = make_trainer(target, seqs, tmp_path / "a", cfg)
    whole.run()
    first = make_trainer(target, seqs, tmp_path / "b", replace(cfg, max_seconds=1e-9))
    first.run()  # stops after one step and checkpoints on the way out
    second = make_trainer(target, seqs, tmp_path / "b", cfg)
    assert second.maybe_resume() and second.step == 1
    second.run()
    assert second.step == whole.step == whole.total_steps
    for (name, a), b in zip(whole.head.state_dict().items(), second.head.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_early_stopping_keeps_the_best_head(tiny, tmp_path):
    target, seqs = tiny
    cfg = replace(CFG, lr=0.5, epochs=30.0, eval_every=2, patience=2, warmup=1)
    t = make_trainer(target, seqs, tmp_path, cfg)
    summary = t.run()
    assert summary["steps"] < t.total_steps  # a diverging run stops early
    assert summary["val"]["loss"] == pytest.approx(summary["best_val_loss"], rel=1e-4)


def test_bf16_autocast_trains_too(tiny, tmp_path):
    target, seqs = tiny
    t = make_trainer(target, seqs, tmp_path, replace(CFG, epochs=15.0, bf16="on"))
    assert t.bf16
    before = t.evaluate(seqs)
    t.run()
    assert t.evaluate(seqs)["loss"] < 0.8 * before["loss"]
    assert all(p.dtype == torch.float32 for p in t.head.parameters())  # fp32 master weights


def test_an_eagle2_head_fine_tuned_for_depth(tiny, tmp_path):
    """--init-head: an EAGLE-1/2 head trained for one step ahead (the stored-feature trainer)
    then trained with the training-time test drafts deeper steps better and stays lossless."""
    from eagle2.train.trainer import TrainConfig, Trainer, build_head

    target, seqs = tiny
    feats = data.target_features(target.hf, [s.input_ids.tolist() for s in seqs])
    stored = [data.Sequence(s.input_ids, s.loss_mask, f.half()) for s, f in
              zip(seqs, feats, strict=True)]
    first = Trainer(build_head(target, stored, 24, "random", seed=0), target.embed,
                    target.lm_head, stored, [], TrainConfig(lr=3e-3, warmup=2, epochs=40.0,
                                                            batch_tokens=4096, noise=0.0),
                    tmp_path / "first")
    first.run()
    save_head(first.head.eval(), tmp_path / "one-step")
    head = load_head(tmp_path / "one-step")
    t = TTTTrainer(head, target, seqs, seqs[:3], replace(CFG, epochs=40.0), tmp_path / "ttt")
    before = t.evaluate(seqs)
    t.run()
    after = t.evaluate(seqs)
    assert after["acc"][2] > before["acc"][2] + 0.05  # the deepest unrolled step gained
    assert after["loss"] < before["loss"]
    save_head(t.head.eval(), tmp_path / "deep")
    tuned = load_head(tmp_path / "deep")
    assert tuned.kind == "eagle2" and tuned.d2t.tolist() == head.d2t.tolist()
    prompts = [s.input_ids[:6].tolist() for s in seqs[:6]]
    tree = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, budget="fixed", lookup=0)
    got, _ = accepted_drafts(target, tuned, prompts, tree)
    vanilla = Engine(LocalRunner(target, 8, 256 + Engine.tree_margin), None, max_batch=8,
                     max_context=256)
    assert got == run(vanilla, prompts, SamplingParams(max_tokens=24, ignore_eos=True),
                      TreeConfig("vanilla"))
