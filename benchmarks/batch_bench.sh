#!/usr/bin/env bash
# "Never slower than plain decoding" at batch 1, 2, 4, 8 (issue 9): 8 MT-bench + 8 HumanEval
# prompts x 96 tokens, vanilla and eagle2 (cost-aware budget) alternating per prompt group,
# REPEATS (default 3) repeats, one thread, each command alone. Session 16 (AMD EPYC, AVX2 only):
# OUT=runs/s16/batch REPEATS=5 benchmarks/batch_bench.sh. Writes $OUT/batch<B>/ (report + JSON) and
# $OUT/timeline.txt (the load average after each command).
E=".venv/bin/python -m eagle2.cli"
[ -x .venv/bin/python ] || E="python -m eagle2.cli"
B=${OUT:-runs/batch}
mkdir -p $B
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
log "start $(git rev-parse --short HEAD)"
for b in ${BATCHES:-1 2 4 8}; do
  $E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
    --threads 1 --batch $b --repeats ${REPEATS:-3} --out $B/batch$b > $B/batch$b.txt 2>&1
  log batch$b
done
