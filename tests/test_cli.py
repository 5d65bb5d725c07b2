"""`eagle2 generate` end to end (a subprocess, the embedded model) and prompt encoding."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def test_generate_json_equals_plain_greedy(smol):
    cmd = [sys.executable, "-m", "eagle2.cli", "generate", "Name a planet.", "--max-tokens",
           "16", "--json", "--dtype", "float32"]  # the dtype of the reference below
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"text", "token_ids", "num_steps", "tau", "tokens_per_s"} <= set(got)
    from eagle2.config import SamplingParams

    ref = smol.generate(["Name a planet."], SamplingParams(max_tokens=16), mode="vanilla")[0]
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
    assert got["tau"] == pytest.approx(len(ref.token_ids) / got["num_steps"], rel=1e-3)
    assert got["tau_decode"] == pytest.approx((len(ref.token_ids) - 1) / (got["num_steps"] - 1),
                                              rel=1e-3)


def test_generate_with_a_downloaded_eagle3_directory(tmp_path, smol):
    """`eagle2 generate --draft DIR` with an EAGLE-3 head in the published layout for the
    embedded target (random weights: lossless, drafts rarely accepted)."""
    from eagle2.eagle3 import new_eagle3_head
    from eagle2.head import save_head

    cfg = smol.target.config
    head = new_eagle3_head(cfg, torch.arange(0, cfg.vocab_size, 7), seed=0)
    save_head(head, tmp_path / "head", target_config=cfg)
    cmd = [sys.executable, "-m", "eagle2.cli", "generate", "Name a planet.", "--json",
           "--max-tokens", "12", "--draft", str(tmp_path / "head"), "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from eagle2.config import SamplingParams

    ref = smol.generate(["Name a planet."], SamplingParams(max_tokens=12), mode="vanilla")[0]
    assert got["token_ids"] == ref.token_ids and got["mode"] == "eagle2"


def test_bad_cli_input_exits_with_message():
    cmd = [sys.executable, "-m", "eagle2.cli", "generate", "hi", "--temperature", "-1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "temperature" in out.stderr


def test_chat_template_is_applied_like_transformers(smol):
    tok = smol.tokenizer
    msg = [{"role": "user", "content": "Hello there"}]
    expected = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert smol.encode("Hello there") == list(expected)
    assert smol.encode(msg) == list(expected)
    assert smol.encode("Hello there", chat=False) == tok("Hello there")["input_ids"]
    with pytest.raises(ValueError, match="empty prompt"):
        smol.encode("")
