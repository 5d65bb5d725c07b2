#!/usr/bin/env bash
# The figures for the README, on a quiet machine (nothing else running). Writes under runs/b/.
E=".venv/bin/python -m eagle2.cli"
B=runs/c
mkdir -p $B
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a $B/timeline.txt; }
log start
# B. the full benchmark: 40 + 40 prompts x 256 tokens, batch 1, two shards (one per core)
for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 40 --max-tokens 256 \
  --modes vanilla,eagle2 --threads 1 --shard $i/2 --out $B/full$i > $B/full$i.txt 2>&1 & done; wait
$E bench --merge $B/full0 $B/full1 --out $B/full > $B/full.txt 2>&1
log full
# D. batches 2, 4, 8 (one process per batch size, two at a time): 8 + 8 prompts x 96 tokens
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 2 --out $B/batch2 > $B/batch2.txt 2>&1 &
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 4 --out $B/batch4 > $B/batch4.txt 2>&1 & wait
log batch24
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 8 --out $B/batch8 > $B/batch8.txt 2>&1
log batch8
# E. one busy process beside the benchmark vs none: 6 + 6 prompts x 96 tokens, 1 process
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --out $B/quiet > $B/quiet.txt 2>&1
log quiet
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --background-load 1 --out $B/load1 > $B/load1.txt 2>&1
log load1
