#!/usr/bin/env bash
# bf16 figures for the README (CPU with AMX/AVX512-BF16, where dtype auto = bf16), quiet machine.
# forward curve + the engine costs first:
#   eagle2 bench-forward --threads 1 --repeats 3 --batches 1,2,4,8 --nodes 1,2,4,8,16,32,64 --out runs/s5/fw-bf16b
E=".venv/bin/python -m eagle2.cli"
B=runs/s5
echo "start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt
for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 40 --max-tokens 256 \
  --modes vanilla,eagle2 --threads 1 --shard $i/2 --out $B/full$i > $B/full$i.txt 2>&1 & done; wait
$E bench --merge $B/full0 $B/full1 --out $B/full > $B/full.txt 2>&1
echo "full $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 128 \
  --modes vanilla,eagle2,hf --threads 1 --shard $i/2 --out $B/hf$i > $B/hf$i.txt 2>&1 & done; wait
$E bench --merge $B/hf0 $B/hf1 --out $B/hf > $B/hf.txt 2>&1
log hf
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 2 --out $B/batch2 > $B/batch2.txt 2>&1 &
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 4 --out $B/batch4 > $B/batch4.txt 2>&1 & wait
log batch24
$E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --batch 8 --out $B/batch8 > $B/batch8.txt 2>&1
log batch8
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --out $B/quiet > $B/quiet.txt 2>&1
log quiet
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --background-load 1 --out $B/load1 > $B/load1.txt 2>&1
log load1
