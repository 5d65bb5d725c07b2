#!/usr/bin/env bash
# tau of a draft head on the README's prompts (deterministic: tau does not depend on load).
# usage: benchmarks/head_eval.sh HEAD_DIR OUT_DIR [extra bench flags]
# 1. default settings (cost-aware tree, prompt lookup on), 2. the 26-token tree (depth 5,
# top_k 8) dynamic vs static without lookup (the head alone), 3. T = 1.
# A quick side-by-side of two heads (10 + 10 prompts x 128, one thread each); the head's goals
# are set at the full benchmark's 40 + 40 x 256, where benchmarks/head_goals.py measures them.
set -e
HEAD=$1; OUT=$2; shift 2
E=".venv/bin/python -m eagle2.cli"
mkdir -p "$OUT"
$E bench --suite mt_bench,humaneval --num-prompts 10 --max-tokens 128 --modes vanilla,eagle2 \
  --threads 1 --draft "$HEAD" --out "$OUT/default" "$@" > "$OUT/default.txt" 2>&1
$E bench --suite mt_bench,humaneval --num-prompts 10 --max-tokens 128 --modes eagle2,static \
  --tree fixed --total-tokens 26 --depth 5 --tree-top-k 8 --lookup 0 --threads 1 \
  --draft "$HEAD" --out "$OUT/tree26" "$@" > "$OUT/tree26.txt" 2>&1
$E bench --suite mt_bench,humaneval --num-prompts 10 --max-tokens 128 --modes eagle2 \
  --temperature 1.0 --seed 0 --threads 1 --draft "$HEAD" --out "$OUT/t1" "$@" > "$OUT/t1.txt" 2>&1
