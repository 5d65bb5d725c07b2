"""The training-time test on stored features (`eagle2.train.ttt_stored`): `--arch eagle3
--stored-features`, alone and under DeepSpeed.

See docs/training.md "A head for a target larger than one GPU". References: the online
training-time test (the target run on every batch), and the single-process stored run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, save_tiny_target, tiny_target
from test_train_deepspeed import TTT, finish, greedy, single_args

from eagle2.head import load_head
from eagle2.train import data

VOCAB = 48


def ttt_log(out: Path) -> list[dict]:
    path = out / "train-ttt-eagle3" / "train_log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """A 6-layer tiny target, 44 conversations of its greedy answers, and their shards with
    the EAGLE-3 layers (`--stages features --arch eagle3`)."""
    root = tmp_path_factory.mktemp("stored")
    target = tiny_target(vocab=VOCAB, layers=6, seed=4)
    save_tiny_target(target, root / "target")
    prompts = random_prompts(44, VOCAB, seed=5, lo=3, hi=8)
    recs = [{"prompt": "", "prompt_ids": p, "answer_ids": greedy(target, p),
             "temperature": 0.0} for p in prompts]
    data.chunk_path(root / "data", 0).parent.mkdir(parents=True)
    data.chunk_path(root / "data", 0).write_text(json.dumps(recs))
    assert single_args(root / "data", "--target", str(root / "target"), "--device", "cpu",
                       "--stages", "features", "--arch", "eagle3") == 0
    return root


def copy(stored: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(stored / "data", dest)
    return dest


def test_stored_features_train_as_the_online_target_does(stored, tmp_path):
    """The shards (fp16 features) stand in for the target's forward: the loss curve, per-step
    agreement and held-out evaluations of the online run, to fp16 rounding (1e-3 relative;
    1.3e-4 measured over 13 records), without loading the target's decoder layers."""
    args = ("--target", str(stored / "target"), *TTT)
    online, offline = copy(stored, tmp_path / "online"), copy(stored, tmp_path / "offline")
    assert single_args(online, *args) == 0
    assert single_args(offline, *args, "--stored-features") == 0
    a, b = ttt_log(online), ttt_log(offline)
    assert [sorted(r) for r in a] == [sorted(r) for r in b] and len(a) >= 10
    for x, y in zip(a, b, strict=True):
        assert x["step"] == y["step"] and x.get("tokens") == y.get("tokens")
        for key in ("loss", "val_loss", "ce", "val_ce"):
            if key in x:
                torch.testing.assert_close(torch.tensor(y[key]), torch.tensor(x[key]),
                                           rtol=1e-3, atol=0)
    va, vb = a[-1]["val_acc"], b[-1]["val_acc"]
    assert all(abs(p - q) <= 0.05 for p, q in zip(va, vb, strict=True))
    assert load_head(offline / "head-eagle3").kind == "eagle3"


@pytest.mark.slow  # two torchrun ranks, ~13 s; DeepSpeed in CI: test_train_deepspeed.py
def test_two_ranks_train_on_stored_features_as_one(stored, tmp_path):
    """`--deepspeed zero2 --arch eagle3 --stored-features`: two gloo ranks log the single
    stored run's loss and held-out evaluations within 1e-5."""
    args = ("--target", str(stored / "target"), *TTT, "--stored-features")
    one, two = copy(stored, tmp_path / "one"), copy(stored, tmp_path / "two")
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
           "--nproc-per-node", "2", "-m", "eagle2.cli", "train-head", "--out", str(two),
           *args, "--deepspeed", "zero2"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert single_args(one, *args) == 0
    finish(proc)
    a, b = ttt_log(one), ttt_log(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "val_loss", "ce", "val_ce", "acc", "val_acc"):
            if key in x:
                torch.testing.assert_close(torch.tensor(y[key]), torch.tensor(x[key]),
                                           rtol=1e-5, atol=1e-6)
