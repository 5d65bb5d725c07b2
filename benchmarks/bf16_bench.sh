#!/usr/bin/env bash
# The bf16 figures in the README (a CPU with AMX/AVX512-BF16, where dtype auto = bf16), on a
# quiet machine, from the repository root. Writes under runs/s7/ (timeline.txt has the load).
E=".venv/bin/python -m eagle2.cli"
B=runs/s7
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
log start
$E bench-forward --threads 1 --repeats 3 --batches 1,2,4,8 --nodes 1,2,4,8,16,32,64 --out $B/fw > $B/fw.txt 2>&1
log fw
for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 40 --max-tokens 256 \
  --modes vanilla,eagle2 --threads 1 --shard $i/2 --out $B/full$i > $B/full$i.txt 2>&1 & done; wait
$E bench --merge $B/full0 $B/full1 --out $B/full > $B/full.txt 2>&1
log full
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
flock /tmp/eagle2-ray.lock $E bench-service --port 19212 --num-prompts 2 --concurrency 8 --max-tokens 24 \
  --tree-tokens 26 --repeats 3 --out $B/service.json > $B/service.txt 2>&1
log service
