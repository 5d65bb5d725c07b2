#!/usr/bin/env bash
# The bf16 figures in the README (a CPU with AMX/AVX512-BF16, where dtype auto = bf16), on a
# quiet machine, from the repository root. Every command runs alone (the lock), one thread;
# the two shards of the full run share the machine (one per core). Writes under runs/final/
# (timeline.txt has the load). This release (0475382 and after) ran the batch, quiet/loaded
# and forward commands below from a worktree of that commit; the forward with --batches 1,4,8
# (it now also times the grid after --long-prefix 1024 tokens).
E=".venv/bin/python -m eagle2.cli"
B=runs/final
L="flock /tmp/eagle2-cpu.lock"
mkdir -p $B
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
log "start $(git rev-parse --short HEAD)"
$L $E bench-forward --threads 1 --repeats 3 --batches 1,4,8 --nodes 1,2,4,8,16,32,64 \
  --out $B/fw > $B/fw.txt 2>&1
log fw
$L $E bench-service --port 19212 --num-prompts 2 --concurrency 8 --max-tokens 24 \
  --tree-tokens 26 --repeats 3 --out $B/service.json > $B/service.txt 2>&1
log service
for b in 2 4 8; do
  $L $E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
    --threads 1 --batch $b --repeats 3 --out $B/batch$b > $B/batch$b.txt 2>&1
  log batch$b
done
$L $E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --out $B/quiet > $B/quiet.txt 2>&1
log quiet
$L $E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --background-load 1 --out $B/load1 > $B/load1.txt 2>&1
log load1
$L bash -c "for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 40 \
  --max-tokens 256 --modes vanilla,eagle2 --threads 1 --shard \$i/2 --out $B/full\$i \
  > $B/full\$i.txt 2>&1 & done; wait"
$E bench --merge $B/full0 $B/full1 --out $B/full > $B/full.txt 2>&1
log full
# vs HF generate (kept from the previous run; our plain decoding did not change since):
# for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 128 \
#   --modes vanilla,eagle2,hf --threads 1 --shard $i/2 --out $B/hf$i & done; wait
