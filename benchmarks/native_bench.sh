#!/usr/bin/env bash
# Session 9 (AMD EPYC, AVX512-BF16 without AMX: dtype auto = bf16): the release with the fused
# CPU operations and their exact attention (eagle2.native), on a quiet machine, from the
# repository root (the session ran it from a worktree of the release commit). Session 12 (the
# native linear): OUT=runs/s12/bench FULL_AB=1 ALTERNATE=EAGLE2_NATIVE_LINEAR=0 (the A/B forward
# and full bench run only with FULL_AB). Session 13: OUT=runs/s13/bench. Session 14 (Intel Xeon,
# the FMA linear): OUT=runs/s14/bench FULL_AB=1 ALTERNATE=EAGLE2_FMA_LINEAR=0. Session 15 (AMD
# EPYC with AVX2 only; the alternate, EAGLE2_NATIVE=0, is fp32 there, what the previous release
# ran): OUT=runs/s15/bench FULL_AB=1. One thread per
# process; the two shards of a sharded run share the machine (one per core), every other
# command runs alone. Writes $OUT (default runs/s9/; timeline.txt has the load average per command).
E=".venv/bin/python -m eagle2.cli"
[ -x .venv/bin/python ] || E="python -m eagle2.cli"
B=${OUT:-runs/s9}
mkdir -p $B
log() { echo "$(date +%T) $* | load $(cut -d' ' -f1-3 /proc/loadavg)" >> $B/timeline.txt; }
shards() {  # name, then bench arguments: two shards (one per core), merged
  local name=$1; shift
  for i in 0 1; do $E bench "$@" --threads 1 --shard $i/2 --out $B/$name$i > $B/$name$i.txt 2>&1 & done
  wait
  $E bench --merge $B/${name}0 $B/${name}1 --out $B/$name > $B/$name.txt 2>&1
  log $name
}
log "start $(git rev-parse --short HEAD)"
# A/B (session 12): ALTERNATE=EAGLE2_NATIVE_LINEAR=0 (oneDNN's linears alone); the default,
# EAGLE2_NATIVE=0, is the same layers with ATen operations and canonical_attention. The forward
# curves go first: bench-forward stores each kernel set's costs, which the budget then reads.
ALT=${ALTERNATE:-EAGLE2_NATIVE=0}
for alt in "" ${FULL_AB:+"$ALT"}; do
  name=fw${alt:+-ab}
  env $alt $E bench-forward --threads 1 --repeats 3 --batches 1,4,8 \
    --nodes 1,2,4,8,16,32,64 --out $B/$name > $B/$name.txt 2>&1
  log $name $alt
done
FULL="--suite mt_bench,humaneval --num-prompts 40 --max-tokens 256 --modes vanilla,eagle2"
shards full $FULL
[ -n "$FULL_AB" ] && { export "${ALT?}"; shards full-ab $FULL; unset "${ALT%%=*}"; }
shards hf --suite mt_bench,humaneval --num-prompts 6 --max-tokens 128 --modes vanilla,eagle2,hf
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --out $B/quiet > $B/quiet.txt 2>&1
log quiet
$E bench --suite mt_bench,humaneval --num-prompts 6 --max-tokens 96 --modes vanilla,eagle2 \
  --threads 1 --background-load 1 --out $B/load1 > $B/load1.txt 2>&1
log load1
for b in 2 4 8; do
  $E bench --suite mt_bench,humaneval --num-prompts 8 --max-tokens 96 --modes vanilla,eagle2 \
    --threads 1 --batch $b --repeats 3 --out $B/batch$b > $B/batch$b.txt 2>&1
  log batch$b
done
