#!/usr/bin/env bash
# Session 9 (AMD EPYC, AVX512-BF16 without AMX: dtype auto = bf16): the fused CPU operations
# (eagle2.native) against the same layers in ATen operations (EAGLE2_NATIVE=0), then the full
# batch-1 benchmark on the release. Quiet machine; every command alone; writes runs/s9/.
E=".venv/bin/python -m eagle2.cli"
B=runs/s9
mkdir -p $B
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
log "start $(git rev-parse --short HEAD)"
for round in 1 2; do
  for native in 0 1; do
    EAGLE2_NATIVE=$native $E bench-forward --threads 1 --repeats 2 --batches 1,8 \
      --nodes 1,2,4,8,16 --long-prefix 0 --no-save-costs --out $B/fw-native$native-$round \
      > $B/fw-native$native-$round.txt 2>&1
    log fw native=$native round $round
  done
done
for i in 0 1; do $E bench --suite mt_bench,humaneval --num-prompts 40 --max-tokens 256 \
  --modes vanilla,eagle2 --threads 1 --shard $i/2 --out $B/full$i > $B/full$i.txt 2>&1 & done
wait
$E bench --merge $B/full0 $B/full1 --out $B/full > $B/full.txt 2>&1
log full
