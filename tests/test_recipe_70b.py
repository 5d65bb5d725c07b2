"""docs/training.md "Recipe: a 70B target on one 8-GPU node", run as written at tiny scale.

The recipe's commands (data and features on copies of the target spread over devices, split
over processes; DeepSpeed training) with a tiny target split over memory and disk, two
processes a stage. References: the features of the whole target in this process, and the
planner's bytes a token for the shards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_target, tiny_target
from test_features_sharded import SPLIT, char_tokenizer

from eagle2.head import load_head
from eagle2.train import data
from eagle2.train.estimate import shard_bytes_per_token

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LAYERS = 48, 6


def recipe() -> tuple[list[str], list[str]]:
    """(the variable names the recipe sets, its commands) from the docs' bash block."""
    text = (ROOT / "docs" / "training.md").read_text()
    block = text.split("### Recipe: a 70B target on one 8-GPU node")[1]
    block = block.split("```bash\n")[1].split("```")[0].replace("\\\n", " ")
    lines = [x.strip() for x in block.splitlines() if x.strip() and not x.startswith("#")]
    names = [n for x in lines if re.match(r"^[A-Z_]+=", x) for n in re.findall(r"(\w+)=", x)]
    commands = [x for x in lines if not re.match(r"^[A-Z_]+=", x)]
    return names, commands


@pytest.mark.slow  # three torchruns of three processes each: ~45 s of CPU
def test_the_recipe_runs_end_to_end_at_tiny_scale(tmp_path):
    names, commands = recipe()
    assert [c.split()[8] for c in commands] == ["data", "features", "train"]
    save_tiny_target(tiny_target(vocab=VOCAB, layers=LAYERS, seed=5), tmp_path / "target")
    char_tokenizer(tmp_path / "target")
    (tmp_path / "split.json").write_text(json.dumps(SPLIT))
    out = tmp_path / "out"
    tiny = {"TARGET": str(tmp_path / "target"), "OUT": str(out), "COPIES": "2", "GPUS": "2",
            "MAP": str(tmp_path / "split.json"), "PROMPTS": "48", "CHUNK": "12",
            "NEW_TOKENS": "6", "DRAFT_VOCAB": "32", "BATCH_TOKENS": "800", "EPOCHS": "2"}
    assert sorted(names) == sorted(tiny)
    env = {**os.environ, **tiny, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for command in commands:
        proc = subprocess.run(["bash", "-euc", command], env=env, text=True,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, (command, (proc.stdout + proc.stderr)[-4000:])
    # data and features: 4 chunks over 2 processes; the features are the whole target's
    from eagle2.target import TargetModel

    target = TargetModel.load(str(tmp_path / "target"), dtype="float32", device="cpu")
    ref = tmp_path / "ref"
    (ref / "conversations").mkdir(parents=True)
    for chunk in sorted((out / "conversations").glob("chunk_*.json")):
        (ref / "conversations" / chunk.name).write_text(chunk.read_text())
    assert data.extract_features(target.hf, ref) == 4
    seqs, want = data.load_shards(out), data.load_shards(ref)
    assert len(seqs) == len(want) == 48
    for a, b in zip(seqs, want, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(a.features, b.features, atol=2e-3, rtol=1e-3)
    # the planner's shard volume: bytes a token x tokens, within the files' headers
    tokens = sum(len(s.input_ids) for s in seqs)
    disk = sum(f.stat().st_size for f in (out / "features").glob("shard_*.safetensors"))
    assert 1.0 <= disk / (tokens * shard_bytes_per_token(64)) < 1.02
    # train: the head, from two DeepSpeed ranks
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_val_sequences"] == 3
    head = load_head(out / "head")
    assert head.kind == "eagle2" and head.d2t.numel() == 32


def test_the_planner_counts_the_heads_parameters_and_the_shards_bytes(tmp_path):
    """The estimate's head sizes are the parameters of the heads train-head builds, and its
    shard bytes a token those of the shards the features stage writes."""
    from transformers import AutoConfig

    from eagle2.eagle3 import new_eagle3_head
    from eagle2.head import new_head
    from eagle2.plan.specs import spec_from_config
    from eagle2.train.estimate import train_head_params

    target = tiny_target(vocab=VOCAB, layers=LAYERS, seed=5)
    save_tiny_target(target, tmp_path / "target")
    config = AutoConfig.from_pretrained(tmp_path / "target")
    spec = spec_from_config(config.to_dict(), "tiny")
    eagle2_head = new_head(config, seed=0)
    assert train_head_params(spec) == sum(p.numel() for p in eagle2_head.parameters())
    eagle3_head = new_eagle3_head(config, torch.arange(VOCAB), seed=0)
    assert train_head_params(spec, eagle3=True) == \
        sum(p.numel() for p in eagle3_head.parameters())
    recs = [{"prompt": "", "prompt_ids": [1, 2, 3], "answer_ids": list(range(4, 4 + n))}
            for n in range(5, 25)]
    data.chunk_path(tmp_path / "d", 0).parent.mkdir(parents=True)
    data.chunk_path(tmp_path / "d", 0).write_text(json.dumps(recs))
    for eagle3 in (False, True):
        shard = data.shard_path(tmp_path / "d", 0)
        shard.unlink(missing_ok=True)
        data.extract_features(target.hf, tmp_path / "d", layers=(2, 3, 3) if eagle3 else None)
        tokens = sum(3 + len(r["answer_ids"]) for r in recs)
        ratio = shard.stat().st_size / (tokens * shard_bytes_per_token(64, eagle3))
        assert 1.0 <= ratio < 1.05, (eagle3, ratio)
