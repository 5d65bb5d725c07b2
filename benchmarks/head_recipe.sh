#!/usr/bin/env bash
# The default head's recipe (eagle2/heads/smollm2-135m-instruct/README.md), stage by stage;
# every stage resumes where it stopped. usage: benchmarks/head_recipe.sh STAGE [DATA_DIR]
#   data     two processes (one per core) write conversations for DATA_MINUTES (default 60)
#   export   the chunks into data/smollm2-135m-instruct/*.tar.xz (kept in git)
#   import   those archives back into DATA_DIR (a fresh machine); then `data` goes on after them
#   train    the training-time test from a previous head (INIT, default the shipped one),
#            TRAIN_MINUTES (default 55),
#            EPOCHS, LR (default 3e-4), EVAL_EVERY steps (default 200), PATIENCE evaluations
#            without improvement (default 3), 2 threads, into DATA_DIR/FT (default ft; a new
#            FT for a new head: an existing one resumes)
#   calib    the value calibration of the trained head (held-out prompts: the last 32
#            synthetic prompts, which `data` never answers, and code stubs)
#   ngram    the n-gram store of the target's answers (the archives in data/) beside HEAD
#            (default: the shipped head), its rates fitted on every 10th conversation
set -e
STAGE=$1; D=${2:-runs/head-data}; FT=${FT:-ft}
CHAT=11200; CALIB=32  # synthetic chat prompts; the last CALIB are calibration's, never answered
E=".venv/bin/python -m eagle2.cli"
A=data/smollm2-135m-instruct
GEN="--stages data --chunk-size 64 --gen-batch 64 --max-new-tokens 256 --sample-every 4 \
  --threads 1 --gen-dtype auto --data-minutes ${DATA_MINUTES:-60}"
case $STAGE in
  data)
    $E train-head --out $D/synthetic --num-prompts $CHAT --hold-out-prompts $CALIB $GEN > $D-synthetic.log 2>&1 &
    $E train-head --out $D/self --prompt-source self --num-prompts 8000 $GEN > $D-self.log 2>&1 &
    wait ;;
  export)
    for s in synthetic self; do $E train-head --out $D/$s --stages "" --export-data $A/$s.tar.xz; done ;;
  import)
    for s in synthetic self; do $E train-head --out $D/$s --stages "" --import-data $A/$s.tar.xz; done ;;
  train)
    # INIT: the head to train on from; default the shipped one (v8). Earlier heads left the
    # tree; v8 itself started from v7: `git show a04a4cd:eagle2/heads/smollm2-135m-instruct-v7/F`
    # for F in config.json and model.safetensors, into one directory, then INIT=that directory.
    $E train-head --ttt --init-head ${INIT:-eagle2/heads/smollm2-135m-instruct} --out $D/$FT \
      --extra-data $D/synthetic --extra-data $D/self --stages train --epochs ${EPOCHS:-1} \
      --batch-tokens 2048 --lr ${LR:-3e-4} --warmup 20 --noise 0.1 --ttt-steps 4 --eval-every ${EVAL_EVERY:-200} \
      --patience ${PATIENCE:-3} --threads 2 --train-minutes ${TRAIN_MINUTES:-55} --save $D/$FT/head ;;
  calib)
    $E calibrate --draft $D/$FT/head --num-chat $CALIB --num-code 16 --first-chat $((CHAT - CALIB)) \
      --max-tokens 128 --bins 24 --threads ${THREADS:-1} --lookup 16 ;;
  ngram)
    $E build-ngram --data $A/synthetic.tar.xz $A/self.tar.xz \
      --out ${HEAD:-eagle2/heads/smollm2-135m-instruct} ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
