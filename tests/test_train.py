"""Head training: data shards, the loop, checkpoints and resume, the saved layout.

See docs/training.md "Training a head".
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, run, save_tiny_target, tiny_target
from safetensors.torch import load_file

from eagle2.config import SamplingParams, TreeConfig
from eagle2.drafter import Drafter
from eagle2.engine import Engine
from eagle2.head import load_head, save_head
from eagle2.runner import LocalRunner
from eagle2.train import data
from eagle2.train.batches import collate, epoch_batches
from eagle2.train.trainer import (
    TrainConfig,
    Trainer,
    build_head,
    evenly_spaced,
    init_from_target,
    split_sources,
)

VOCAB = 48
CFG = TrainConfig(lr=3e-3, warmup=2, epochs=1.0, batch_tokens=256, noise=0.1, log_every=1,
                  checkpoint_seconds=1e9)


def greedy_sequences(target, n: int, seed: int = 0, new: int = 24) -> list[data.Sequence]:
    """Self-distilled sequences of the tiny target: random prompt + its greedy answer."""
    prompts = random_prompts(n, VOCAB, seed=seed, lo=3, hi=10)
    ids = []
    for p in prompts:
        x = torch.tensor([p])
        out = target.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        ids.append(out[0].tolist())
    feats = data.target_features(target.hf, ids)
    return [data.Sequence(torch.tensor(x), data.loss_mask(len(p), len(x)), f.half())
            for p, x, f in zip(prompts, ids, feats, strict=True)]


@pytest.fixture(scope="module")
def tiny():
    target = tiny_target(vocab=VOCAB, seed=3)
    return target, greedy_sequences(target, 12)


def train_head(*argv: str) -> int:
    """`eagle2 train-head ARGV` in this process (its exit code)."""
    import argparse

    from eagle2.train.run import add_arguments
    from eagle2.train.run import run as run_stages

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run_stages(parser.parse_args(list(argv)))


def trainer(target, seqs, out: Path, cfg: TrainConfig = CFG, vocab: int = 0) -> Trainer:
    head = build_head(target, seqs, vocab, "target", seed=0)
    return Trainer(head, target.embed, target.lm_head, seqs, seqs[:2], cfg, out)


def test_loss_mask_covers_positions_that_predict_answer_tokens():
    mask = data.loss_mask(prompt_len=4, total_len=9)
    assert mask.tolist() == [False, False, False, True, True, True, True, False, False]


def test_shards_round_trip_and_resume(tmp_path):
    target = tiny_target(vocab=VOCAB, seed=1)
    (tmp_path / "conversations").mkdir()
    recs = [{"prompt": "", "prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6, 7]},
            {"prompt": "", "prompt_ids": [9, 8], "answer_ids": [7, 6, 5, 4, 3, 2]}]
    data.chunk_path(tmp_path, 0).write_text(json.dumps(recs))
    assert data.extract_features(target.hf, tmp_path) == 1
    stamp = data.shard_path(tmp_path, 0).stat().st_mtime_ns
    data.extract_features(target.hf, tmp_path)  # finished shards are skipped
    assert data.shard_path(tmp_path, 0).stat().st_mtime_ns == stamp
    seqs = data.load_shards(tmp_path)
    assert [s.input_ids.tolist() for s in seqs] == [[1, 2, 3, 4, 5, 6, 7],
                                                    [9, 8, 7, 6, 5, 4, 3, 2]]
    ref = target.hf.model(torch.tensor([[9, 8, 7, 6, 5, 4, 3, 2]])).last_hidden_state[0]
    torch.testing.assert_close(seqs[1].features.float(), ref, atol=2e-2, rtol=2e-3)
    assert seqs[0].loss_mask.tolist() == data.loss_mask(3, 7).tolist()


def test_draft_vocab_keeps_the_most_frequent_targets(tiny):
    _, seqs = tiny
    counts = data.token_counts(seqs, VOCAB)
    d2t = data.draft_vocab(seqs, VOCAB, 8)
    assert d2t.tolist() == sorted(d2t.tolist()) and len(d2t) == 8
    assert counts[d2t].min() >= counts.sort(descending=True).values[7]


def test_init_from_target_passes_features_through(tiny):
    target, _ = tiny
    head = build_head(target, [], 0, "target", seed=0)
    last = target.hf.model.layers[-1]
    torch.testing.assert_close(head.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert not head.layers[0].mlp.down_proj.weight.any()  # residual branches start at zero
    feats = torch.randn(1, 5, 64)
    torch.testing.assert_close(head.fuse(torch.zeros(1, 5, 64), feats), feats)
    out = head.forward_train(0.02 * torch.randn(1, 5, 64), feats)  # embedding-sized
    torch.testing.assert_close(out, feats, atol=0.1, rtol=0.05)  # ~pass-through
    init_from_target(head, target.hf)  # idempotent


def test_held_out_sequences_stay_held_out_as_the_data_grows():
    """The next head trains from the previous one on a grown data set: nothing the previous
    one was validated on may move into training, nothing it trained on into validation."""
    synthetic, own = [f"s{i}" for i in range(128)], [f"o{i}" for i in range(64)]
    train, val = split_sources([synthetic, own])
    assert len(val) == 7 + 4 and not set(train) & set(val)
    grown = [synthetic + [f"s{i}" for i in range(128, 192)],
             own + [f"o{i}" for i in range(64, 100)]]
    train2, val2 = split_sources(grown)
    assert set(val) <= set(val2) and set(train) <= set(train2)
    assert len(train2) + len(val2) == 192 + 100 and not set(train2) & set(val2)
    assert evenly_spaced(val2, 4) == [val2[0], val2[3], val2[7], val2[11]]  # of 15
    assert evenly_spaced(val2, 0) == val2


def test_batches_are_padded_and_reproducible(tiny):
    _, seqs = tiny
    lengths = [len(s.input_ids) for s in seqs]
    a = epoch_batches(lengths, 96, seed=1, epoch=2)
    assert a == epoch_batches(lengths, 96, seed=1, epoch=2)
    assert sorted(i for b in a for i in b) == list(range(len(seqs)))
    for b in a:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 96
    batch = collate([seqs[i] for i in a[0]])
    assert batch.features.dtype == torch.float32
    assert batch.loss_mask.sum() == sum(int(seqs[i].loss_mask.sum()) for i in a[0])


def test_loop_lowers_the_loss_on_a_fixed_batch(tiny, tmp_path):
    target, seqs = tiny
    t = trainer(target, seqs[:4], tmp_path, replace(CFG, batch_tokens=4096, epochs=40.0))
    assert t.steps_per_epoch == 1
    before = t.evaluate(seqs[:4])
    t.run()
    after = t.evaluate(seqs[:4])
    assert after["loss"] < 0.7 * before["loss"]
    assert after["acc"] >= before["acc"]
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert {"step", "loss", "smooth_l1", "ce", "acc"} <= set(log[0])
    assert log[-1]["step"] == 40 and "val_acc" in log[-1]


def test_interrupted_run_resumes_to_the_same_state(tiny, tmp_path):
    target, seqs = tiny
    cfg = replace(CFG, epochs=2.0)
    whole = trainer(target, seqs, tmp_path / "a", cfg)
    whole.run()
    first = trainer(target, seqs, tmp_path / "b", cfg)
    first.run(max_steps=3)  # "crash" after step 3 (run() checkpoints on the way out)
    second = trainer(target, seqs, tmp_path / "b", cfg)
    assert second.maybe_resume() and second.step == 3
    assert second.opt.state_dict()["state"]  # the optimizer moments came back too
    second.run()
    assert second.step == whole.step == whole.total_steps
    for (name, a), b in zip(whole.head.state_dict().items(), second.head.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_saved_head_has_the_published_layout(tiny, tmp_path):
    target, seqs = tiny
    head = build_head(target, seqs, 16, "target", seed=0)
    save_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is False
    keys = set(load_file(tmp_path / "model.safetensors"))
    expected = {"fc.weight", "layers.0.post_attention_layernorm.weight", "d2t"}
    expected |= {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert keys == expected  # no embed_tokens, no rotary buffers, no input_layernorm
    loaded = load_head(tmp_path)
    assert loaded.d2t.tolist() == head.d2t.tolist()
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight)


def test_trained_reduced_vocab_head_is_lossless(tiny, tmp_path):
    target, seqs = tiny
    t = trainer(target, seqs, tmp_path, replace(CFG, epochs=3.0), vocab=12)
    t.run()
    save_head(t.head.eval(), tmp_path / "head")
    head = load_head(tmp_path / "head")
    assert head.d2t.numel() == 12
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=4, max_len=256)
    engine = Engine(LocalRunner(target, 4, 256 + Engine.tree_margin), drafter, max_batch=4,
                    max_context=256)
    vanilla = Engine(LocalRunner(target, 4, 256 + Engine.tree_margin), None, max_batch=4,
                     max_context=256)
    prompts = random_prompts(6, VOCAB, seed=7)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    tree = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=3, budget="fixed")
    assert run(engine, prompts, params, tree) == run(vanilla, prompts, params,
                                                     TreeConfig("vanilla"))


def test_code_prompts_cut_stubs_and_drop_benchmark_overlap(tmp_path):
    """Stubs keep the signature and docstring, drop the body; excluded names, near-copies of
    benchmark prompts, private functions and test folders never become prompts."""
    from eagle2.train.code_prompts import function_stubs, make_code_prompts

    doc = "Return the sum of the squares of the numbers in values, skipping None entries."
    (tmp_path / "mod.py").write_text(
        "import os\n\n"
        f"def sum_squares(values):\n    \"\"\"{doc}\"\"\"\n    total = 0\n"
        "    for v in values:\n        total += v * v\n    return total\n\n"
        f"def _private(x):\n    \"\"\"{doc}\"\"\"\n    return x\n\n"
        f"def only_doc(x):\n    \"\"\"{doc}\"\"\"\n\n"
        "def short(x):\n    \"\"\"Too short.\"\"\"\n    return x\n\n"
        "@staticmethod\ndef has_entry(table, key):\n"
        f"    \"\"\"Tell whether key is in table; {doc}\"\"\"\n"
        "    return key in table\n")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text(
        f"def in_tests(x):\n    \"\"\"{doc}\"\"\"\n    return x\n")
    stubs = dict(function_stubs(tmp_path))
    assert set(stubs) == {"sum_squares", "has_entry"}
    assert stubs["sum_squares"] == f"def sum_squares(values):\n    \"\"\"{doc}\"\"\"\n"
    assert stubs["has_entry"].startswith("@staticmethod\ndef has_entry")
    both = make_code_prompts(5, root=tmp_path)
    assert len(both) == 2 and all("```python\n" in p and p.endswith("```") for p in both)
    assert make_code_prompts(5, root=tmp_path) == both  # deterministic
    assert len(make_code_prompts(5, root=tmp_path, exclude_names={"has_entry"})) == 1
    bench = [f"def other(values):\n    \"\"\"{doc}\"\"\"\n"]  # shares an 8-gram with both
    assert make_code_prompts(5, root=tmp_path, bench_prompts=bench) == []


def test_every_nth_chunk_is_answered_at_temperature_one():
    cfg = data.DataConfig(num_prompts=640, chunk_size=64, sample_every=4)
    assert [cfg.temperature_of(i) for i in range(8)] == [0, 0, 0, 1.0, 0, 0, 0, 1.0]
    assert data.DataConfig(num_prompts=64).temperature_of(3) == 0.0
    with pytest.raises(ValueError, match="sample_every"):
        data.DataConfig(sample_every=-1)


@pytest.mark.slow  # the model writes prompts, ~14 s
def test_self_written_prompts_are_stored_reproducible_and_filtered(smol, tmp_path):
    """The embedded target writes user messages from its user-turn header; a stored chunk is
    reused as is, the same seed writes the same prompts, and a prompt that overlaps a
    benchmark text is dropped."""
    from eagle2.train.self_prompts import chunk_prompts, prompts_path, user_header_ids

    header = smol.tokenizer.decode(user_header_ids(smol.tokenizer))
    assert header.endswith("user\n") and "system" in header
    first = chunk_prompts(smol, tmp_path / "a", 0, 4, seed=1, bench=["unrelated text"],
                          max_tokens=48, oversample=1.0)
    record = json.loads(prompts_path(tmp_path / "a", 0).read_text())
    assert record["prompts"] == first and record["drawn"] == 4
    assert len(first) + sum(record["dropped"].values()) == 4
    assert chunk_prompts(smol, tmp_path / "a", 0, 4, seed=99, bench=[]) == first  # stored
    assert first  # seed 1 writes finished messages
    again = chunk_prompts(smol, tmp_path / "b", 0, 4, seed=1, bench=[first[0]],
                          max_tokens=48, oversample=1.0)
    assert first[0] not in again and again == first[1:]
    dropped = json.loads(prompts_path(tmp_path / "b", 0).read_text())["dropped"]
    assert dropped["benchmark_overlap"] == 1


def test_the_data_stage_never_answers_held_out_prompts(tmp_path):
    """`--hold-out-prompts N`: the last N prompts of the list (calibration's) get no answer;
    the others are answered in order, chunk by chunk."""
    from eagle2.train.prompts import make_prompts

    assert train_head("--out", str(tmp_path), "--stages", "data", "--num-prompts", "6",
                      "--hold-out-prompts", "2", "--chunk-size", "2", "--gen-batch", "2",
                      "--max-new-tokens", "2", "--device", "cpu") == 0
    answered = [rec["prompt"] for rec in data.load_conversations(tmp_path)]
    assert answered == make_prompts(6)[:4]


def test_data_archive_round_trips_and_keeps_existing_chunks(tmp_path):
    """`--export-data` / `--import-data`: the chunk files (conversations and self-written
    prompts) survive the round trip byte for byte, the archive is reproducible, an import
    keeps chunks the directory already has, and a foreign member is refused."""
    import io
    import tarfile

    from eagle2.train.self_prompts import prompts_path

    src = tmp_path / "src"
    recs = [[{"prompt": "a", "prompt_ids": [1, 2], "answer_ids": [3, 4, 5], "temperature": 0.0}],
            [{"prompt": "b", "prompt_ids": [6], "answer_ids": [7, 8], "temperature": 1.0}]]
    for i, r in enumerate(recs):
        data.chunk_path(src, i).parent.mkdir(parents=True, exist_ok=True)
        data.chunk_path(src, i).write_text(json.dumps(r))
    prompts_path(src, 0).parent.mkdir(parents=True)
    prompts_path(src, 0).write_text(json.dumps({"prompts": ["a"], "drawn": 1, "dropped": {}}))
    (src / "features").mkdir()
    (src / "features" / "shard_00000.safetensors").write_bytes(b"large, not archived")

    archive = tmp_path / "data.tar.xz"
    assert train_head("--out", str(src), "--stages", "", "--export-data", str(archive)) == 0
    first = archive.read_bytes()
    assert data.pack_archive(src, archive) == 3 and archive.read_bytes() == first

    dst = tmp_path / "dst"
    data.chunk_path(dst, 1).parent.mkdir(parents=True)
    data.chunk_path(dst, 1).write_text("[]")  # already there: kept
    assert train_head("--out", str(dst), "--stages", "", "--import-data", str(archive)) == 0
    assert data.chunk_path(dst, 0).read_bytes() == data.chunk_path(src, 0).read_bytes()
    assert prompts_path(dst, 0).read_bytes() == prompts_path(src, 0).read_bytes()
    assert data.chunk_path(dst, 1).read_text() == "[]"
    assert not (dst / "features").exists()
    assert [r["answer_ids"] for r in data.load_conversations(dst)] == [[3, 4, 5]]

    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        info = tarfile.TarInfo("../outside.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"[]"))
    with pytest.raises(ValueError, match="unexpected member"):
        data.unpack_archive(bad, tmp_path / "other")
    assert not (tmp_path / "outside.json").exists()


def test_the_train_stage_fine_tunes_a_head_on_two_sources_held_out_per_source(tmp_path):
    """`eagle2 train-head --stages train --init-head H --extra-data D` end to end on a saved
    tiny target: the conversations of both directories are split per source (3 + 3 held out
    of 45 + 41), the fine-tuned head keeps the initial head's kind and is written in the
    published layout, its log starts with the initial head's held-out evaluation, and the
    summary reports the kept head's evaluation."""
    from eagle2.head import new_head

    target = tiny_target(vocab=VOCAB, seed=3)
    save_tiny_target(target, tmp_path / "target")
    save_head(new_head(target.config, seed=0), tmp_path / "init")
    prompts = random_prompts(86, VOCAB, seed=1, lo=3, hi=8)
    answers = random_prompts(86, VOCAB, seed=2, lo=6, hi=12)
    for name, lo, hi in (("a", 0, 45), ("b", 45, 86)):
        recs = [{"prompt": "", "prompt_ids": p, "answer_ids": a, "temperature": 0.0}
                for p, a in zip(prompts[lo:hi], answers[lo:hi], strict=True)]
        data.chunk_path(tmp_path / name, 0).parent.mkdir(parents=True)
        data.chunk_path(tmp_path / name, 0).write_text(json.dumps(recs))
    assert train_head(
        "--out", str(tmp_path / "a"), "--extra-data", str(tmp_path / "b"),
        "--target", str(tmp_path / "target"), "--device", "cpu", "--stages", "train",
        "--init-head", str(tmp_path / "init"), "--epochs", "0.5", "--batch-tokens", "128",
        "--ttt-steps", "2", "--bf16", "off", "--eval-every", "2",
        "--save", str(tmp_path / "new")) == 0
    summary = json.loads((tmp_path / "a" / "train-ttt-eagle2" / "summary.json").read_text())
    assert (summary["num_sequences"], summary["num_val_sequences"]) == (80, 6)
    assert summary["steps"] >= 2 and len(summary["val"]["acc"]) == 2
    log = [json.loads(x) for x in
           (tmp_path / "a" / "train-ttt-eagle2" / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "val_loss" in r]
    assert evals[0]["step"] == 0  # the initial head, evaluated first
    assert summary["val"]["loss"] == min(r["val_loss"] for r in evals)  # the kept head's
    head = load_head(tmp_path / "new")
    assert head.kind == "eagle2"
    assert not torch.equal(head.fc.weight, load_head(tmp_path / "init").fc.weight)
