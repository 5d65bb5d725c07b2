"""The data and features stages for a target larger than one device
(`eagle2.train.multi_device`): the target spread by accelerate's device_map, chunks split over
processes, EAGLE-3 layers.

See docs/training.md "A head for a target larger than one GPU". References: one process with
the whole target, the engine's greedy answers, HF's own hidden states, the shards read
without mapping.
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
from safetensors.torch import load_file

from eagle2.train import data
from eagle2.train.multi_device import device_share, worker_of

VOCAB, LAYERS = 48, 6
# a tiny target split over two "devices" a CPU-only machine has: memory and disk (accelerate
# loads a disk module's weights into place for each forward and drops them after)
SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
         "model.layers.2": "disk", "model.layers.3": "cpu", "model.layers.4": "disk",
         "model.layers.5": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
         "lm_head": "disk"}


def char_tokenizer(path: Path) -> None:
    """Replace a saved tiny target's tokenizer by one token a character (lower-case letters,
    digits, space and a few marks; id 0 for the rest), so that prompt texts differ in ids."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = " abcdefghijklmnopqrstuvwxyz0123456789.,?'-:"
    words = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(path)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """A saved 6-layer tiny target and 5 chunks of 6 conversations."""
    root = tmp_path_factory.mktemp("feat")
    save_tiny_target(tiny_target(vocab=VOCAB, layers=LAYERS, seed=5), root / "target")
    char_tokenizer(root / "target")
    prompts = random_prompts(30, VOCAB, seed=1, lo=3, hi=9)
    answers = random_prompts(30, VOCAB, seed=2, lo=4, hi=15)
    for chunk in range(5):
        recs = [{"prompt": "", "prompt_ids": p, "answer_ids": a, "temperature": 0.0}
                for p, a in zip(prompts[6 * chunk:6 * chunk + 6],
                                answers[6 * chunk:6 * chunk + 6], strict=True)]
        data.chunk_path(root / "convs", chunk).parent.mkdir(parents=True, exist_ok=True)
        data.chunk_path(root / "convs", chunk).write_text(json.dumps(recs))
    return root


def features_stage(root: Path, out: Path) -> None:
    import shutil

    shutil.copytree(root / "convs", out)


@pytest.mark.slow  # two worker processes, ~8 s; the split itself is tested below
def test_two_processes_on_a_split_target_write_the_shards_of_one(conversations, tmp_path):
    """torchrun, 2 processes (`--worker auto`), each with the target split over memory and
    disk by accelerate (`--device-map`), write the same shards (ids, masks, final features,
    EAGLE-3 layers) as one process with the whole target; each process offloads its own."""
    from eagle2.cli import main

    stage = ["train-head", "--stages", "features", "--target", str(conversations / "target"),
             "--device", "cpu", "--arch", "eagle3"]
    one, two = tmp_path / "one", tmp_path / "two"
    features_stage(conversations, one)
    features_stage(conversations, two)
    assert main([*stage, "--out", str(one)]) == 0
    (tmp_path / "split.json").write_text(json.dumps(SPLIT))
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
           "--nproc-per-node", "2", "-m", "eagle2.cli", *stage, "--out", str(two),
           "--worker", "auto", "--device-map", str(tmp_path / "split.json"),
           "--offload-folder", str(tmp_path / "offload")]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("target spread over ['cpu', 'disk']") == 2
    assert sorted(p.name for p in (tmp_path / "offload").iterdir()) == ["rank0", "rank1"]
    names = sorted(p.name for p in (one / "features").glob("shard_*.safetensors"))
    assert len(names) == 5
    assert names == sorted(p.name for p in (two / "features").glob("shard_*.safetensors"))
    for name in names:
        a, b = load_file(str(one / "features" / name)), load_file(str(two / "features" / name))
        assert sorted(a) == sorted(b) == ["aux", "features", "input_ids", "lengths",
                                          "loss_mask"]
        for key in ("input_ids", "lengths", "loss_mask"):
            assert torch.equal(a[key], b[key]), (name, key)
        for key in ("features", "aux"):  # fp16; one thread against two
            torch.testing.assert_close(b[key], a[key], atol=2e-3, rtol=1e-3, msg=name)


def test_stored_eagle3_layers_are_the_inputs_of_layers_2_l2_and_l3(conversations, tmp_path):
    """`eagle2 train-head --stages features --arch eagle3`: `aux` holds HF's
    hidden_states[2], [L//2], [L-3] side by side and `features` the final normed hidden
    state, per conversation, cut at each one's length."""
    from eagle2.cli import main
    from eagle2.target import TargetModel

    target = TargetModel.load(str(conversations / "target"), dtype="float32", device="cpu")
    root = tmp_path / "d"
    features_stage(conversations, root)
    assert main(["train-head", "--stages", "features", "--arch", "eagle3", "--out", str(root),
                 "--target", str(conversations / "target"), "--device", "cpu"]) == 0
    seqs = data.load_shards(root)
    assert len(seqs) == 30
    for a, b in zip(seqs, data.load_shards(root, mmap=True), strict=True):  # the same, mapped
        for key in ("input_ids", "loss_mask", "features", "aux"):
            x, y = getattr(a, key), getattr(b, key)
            assert x.dtype == y.dtype and torch.equal(x, y), key
    for s in seqs[::7]:
        with torch.no_grad():
            out = target.hf.model(s.input_ids[None], output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i][0] for i in (2, 3, 3)], dim=-1)
        torch.testing.assert_close(s.aux.float(), ref, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(s.features.float(), out.last_hidden_state[0], atol=2e-3,
                                   rtol=1e-3)


def test_a_node_splits_its_gpus_and_chunks_over_processes(monkeypatch):
    assert device_share(0, 2, 8) == [0, 1, 2, 3] and device_share(1, 2, 8) == [4, 5, 6, 7]
    assert device_share(3, 4, 8) == [6, 7]
    with pytest.raises(ValueError, match="evenly"):
        device_share(0, 3, 8)
    assert worker_of("1/4") == (1, 4)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert worker_of("auto") == (1, 2)
    with pytest.raises(ValueError, match="I/N"):
        worker_of("2")
    with pytest.raises(ValueError, match=r"0\.\.N-1"):
        worker_of("2/2")


def test_answers_of_a_split_target_are_the_engines(conversations, tmp_path):
    """`--stages data --device-map`: HF generate on the target split over memory and disk
    writes the chunks (prompt ids, greedy answers) the engine writes with the whole target."""
    from eagle2.cli import main

    split_map = tmp_path / "split.json"
    split_map.write_text(json.dumps(SPLIT))
    common = ["train-head", "--stages", "data", "--target", str(conversations / "target"),
              "--device", "cpu", "--num-prompts", "6", "--chunk-size", "3",
              "--max-new-tokens", "10", "--threads", "1"]
    assert main([*common, "--out", str(tmp_path / "engine")]) == 0
    assert main([*common, "--out", str(tmp_path / "spread"), "--device-map", str(split_map),
                 "--offload-folder", str(tmp_path / "offload")]) == 0
    for chunk in range(2):
        a = json.loads(data.chunk_path(tmp_path / "engine", chunk).read_text())
        b = json.loads(data.chunk_path(tmp_path / "spread", chunk).read_text())
        assert len(a) == len(b) == 3
        for x, y in zip(a, b, strict=True):
            assert x["prompt_ids"] == y["prompt_ids"]
            assert len(x["answer_ids"]) == 10 and x["answer_ids"] == y["answer_ids"]
        assert len({len(x["prompt_ids"]) for x in a}) > 1  # the batch was padded
        assert len({tuple(x["answer_ids"]) for x in a}) > 1
