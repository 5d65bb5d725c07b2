"""Prompts the target writes itself (docs/training.md "Training a head").

The target gets only its chat template's user-turn header (everything the template puts
before a user message's text, system prompt included) and samples the message at T = 1 until
its end-of-turn token. Each chunk of prompts is stored once (`prompts/chunk_XXXXX.json`, with
how many candidates were drawn and why any were dropped), so a rerun, another process or a
later session answers exactly the same prompts.

Dropped: unfinished or very short messages, exact repeats, near-copies of earlier self-written
prompts, and anything that overlaps MT-bench or HumanEval by the same word n-gram test as the
hand-written prompts (`eagle2.train.prompts.overlap_report`).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle2.config import SamplingParams, TreeConfig
from eagle2.train.data import atomic_write
from eagle2.train.prompts import overlap_report

MARK = "\u2063EAGLE2-MESSAGE\u2063"  # stands in for the message text to cut the template
MIN_WORDS, MAX_CHARS = 4, 2000


def user_header_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if MARK not in text:
        raise ValueError("the chat template does not show the user message verbatim")
    return tokenizer(text[:text.index(MARK)], add_special_tokens=False)["input_ids"]


def prompts_path(root: Path, idx: int) -> Path:
    return root / "prompts" / f"chunk_{idx:05d}.json"


def bench_texts() -> list[str]:
    from eagle2.bench.prompts import load_suite

    return [p.text for p in load_suite("mt_bench") + load_suite("humaneval")]


def earlier_prompts(root: Path, before: int) -> list[str]:
    out = []
    for f in sorted((root / "prompts").glob("chunk_*.json")):
        if int(f.stem.split("_")[1]) < before:
            out += json.loads(f.read_text())["prompts"]
    return out


def chunk_prompts(llm, root: Path, idx: int, size: int, seed: int,
                  bench: list[str] | None = None, max_tokens: int = 128,
                  oversample: float = 1.5) -> list[str]:
    """The `size` (or fewer) self-written prompts of chunk `idx`: read if stored, else
    sampled, filtered and stored atomically."""
    path = prompts_path(root, idx)
    if path.exists():
        return json.loads(path.read_text())["prompts"]
    header = user_header_ids(llm.tokenizer)
    num = max(size, int(size * oversample))
    reqs = [llm.request(header, SamplingParams(temperature=1.0, top_p=0.95,
                                               max_tokens=max_tokens,
                                               seed=(seed * 1_000_003 + idx) * 4096 + i),
                        tree=TreeConfig("vanilla"))
            for i in range(num)]
    outs = llm.generate_ids(reqs)
    kept, dropped = [], {"unfinished": 0, "short_or_long": 0, "repeat": 0, "near_copy": 0,
                         "benchmark_overlap": 0}
    seen = set(earlier_prompts(root, idx))
    for out in outs:
        text = out.text.strip()
        if out.finish_reason != "stop":
            dropped["unfinished"] += 1
        elif len(text.split()) < MIN_WORDS or len(text) > MAX_CHARS:
            dropped["short_or_long"] += 1
        elif text in seen:
            dropped["repeat"] += 1
        else:
            seen.add(text)
            kept.append(text)
    bench_hits = {h.train_idx for h in overlap_report(kept, bench or bench_texts()).hits}
    dropped["benchmark_overlap"] = len(bench_hits)
    kept = [t for i, t in enumerate(kept) if i not in bench_hits]
    near = {h.train_idx for h in overlap_report(kept, earlier_prompts(root, idx)).hits}
    near |= _near_copies_within(kept)
    dropped["near_copy"] = len(near)
    kept = [t for i, t in enumerate(kept) if i not in near][:size]
    record = {"prompts": kept, "drawn": num, "dropped": dropped, "seed": seed}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record)))
    return kept


def _near_copies_within(texts: list[str]) -> set[int]:
    """Indices of texts that are near-copies of an earlier text in the same list."""
    drop: set[int] = set()
    for i in range(1, len(texts)):
        if overlap_report([texts[i]], texts[:i]).hits:
            drop.add(i)
    return drop
