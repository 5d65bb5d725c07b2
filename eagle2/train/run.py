"""`eagle2 train-head`: self-distilled data -> feature shards -> head training -> saved head.

Every stage is resumable: rerun the same command after a crash and finished chunks, shards
and the last checkpoint are picked up. `--stages` runs a subset (e.g. `data` only, while the
trainer is still being tuned), and `--data-minutes` time-boxes the self-distillation stage
(the later stages use the chunks that exist).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STAGES = ("data", "features", "train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/train-head", help="working directory (resumable)")
    p.add_argument("--save", default=None, help="where to write the head (default OUT/head)")
    p.add_argument("--target", default=None, help="model directory or .gguf (default: embedded)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"subset of {STAGES}")
    g = p.add_argument_group("data (self-distillation)")
    g.add_argument("--num-prompts", type=int, default=2048)
    g.add_argument("--prompt-source", default="synthetic",
                   choices=("synthetic", "stdlib-code", "self"),
                   help="synthetic chat prompts (prompts.py), code-completion stubs cut from "
                        "the Python standard library (code_prompts.py), or prompts the target "
                        "writes itself from its user-turn header (self_prompts.py); one source "
                        "per --out")
    g.add_argument("--prompt-seed", type=int, default=0)
    g.add_argument("--hold-out-prompts", type=int, default=0, metavar="N",
                   help="never answer the last N prompts of the list (synthetic, "
                        "stdlib-code): they stay unseen for `eagle2 calibrate` and evaluation")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers")
    g.add_argument("--sample-every", type=int, default=0,
                   help="answer every n-th chunk at T = 1 (0 = none)")
    g.add_argument("--gen-batch", type=int, default=16, help="max_batch of the generator")
    g.add_argument("--chunk-size", type=int, default=64, help="conversations per chunk/shard")
    g.add_argument("--data-minutes", type=float, default=None,
                   help="stop self-distillation after this many minutes (whole chunks)")
    g.add_argument("--worker", default="0/1",
                   help="I/N: this process does chunks i with i %% N == I (data and features); "
                        "auto: RANK/WORLD_SIZE as torchrun sets them")
    g.add_argument("--device-map", default=None, metavar="MAP",
                   help="data and features stages: spread the target over devices with "
                        "accelerate "
                        "(auto | balanced | sequential over this process's share of the GPUs, "
                        "or a JSON file {module: device}); bf16 on GPUs")
    g.add_argument("--offload-folder", default=None,
                   help="with --device-map: where modules mapped to 'disk' live")
    g.add_argument("--max-len", type=int, default=2048, help="truncate conversations")
    g.add_argument("--import-data", action="append", default=[], metavar="ARCHIVE",
                   help="first extract an archive of chunks (--export-data) into OUT, keeping "
                        "chunks OUT already has; the data stage then goes on after them")
    g.add_argument("--export-data", default=None, metavar="ARCHIVE",
                   help="after the stages, write OUT's conversation chunks into this .tar.xz "
                        "(small enough to keep in git: the data set outlives the machine)")
    g.add_argument("--gen-dtype", default="float32", choices=("float32", "auto", "bfloat16"),
                   help="dtype of the target that writes the answers: auto = what the service "
                        "runs on this machine (bf16 where the CPU or GPU has fast bf16; several "
                        "times faster on such CPUs)")
    t = p.add_argument_group("training")
    t.add_argument("--arch", default="eagle2", choices=("eagle2", "eagle3"),
                   help="eagle2: fc(2H) head on stored final features (needs the features "
                        "stage); eagle3: three-layer features and the training-time test, "
                        "target run online (no features stage)")
    t.add_argument("--ttt", action="store_true",
                   help="train with the training-time test (always for eagle3; for eagle2 it "
                        "runs the target online instead of reading stored features)")
    t.add_argument("--init-head", default=None, metavar="DIR",
                   help="with the training-time test: start from this head (its kind and draft "
                        "vocabulary), e.g. to fine-tune a head for depth")
    t.add_argument("--stored-features", action="store_true",
                   help="training-time test: read the features stage's shards (an EAGLE-3 "
                        "head: written with --arch eagle3) instead of running the target, "
                        "which is then never loaded whole (a 70B target)")
    t.add_argument("--ttt-steps", type=int, default=4,
                   help="unrolled draft steps of the training-time test")
    t.add_argument("--val-sequences", type=int, default=256,
                   help="TTT: evaluate on at most this many of the held-out conversations "
                        "(evenly spaced; 0 = all): an evaluation costs ~0.5 s a sequence on "
                        "2 CPU threads")
    t.add_argument("--eval-every", type=int, default=200,
                   help="TTT: steps between held-out evaluations (early stopping)")
    t.add_argument("--bf16", default="auto", choices=("auto", "on", "off"),
                   help="TTT: bf16 autocast (auto: CUDA, or a CPU with AMX/AVX512-BF16)")
    t.add_argument("--patience", type=int, default=3,
                   help="TTT: stop after this many evaluations without improvement")
    t.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="also train on the feature shards of another --out (repeatable), "
                        "e.g. a stdlib-code run next to the synthetic one")
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="reduced draft vocabulary size (0 = the target's full vocabulary)")
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--batch-tokens", type=int, default=1024, help="tokens per batch (padded)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    t.add_argument("--noise", type=float, default=0.2,
                   help="uniform feature noise amplitude, relative to the feature RMS")
    t.add_argument("--ce-weight", type=float, default=0.1)
    t.add_argument("--init", default="random", choices=("random", "target"),
                   help="random (measured better) or target: pass-through start with the "
                        "target's last decoder layer")
    t.add_argument("--checkpoint-minutes", type=float, default=3.0)
    t.add_argument("--log-every", type=int, default=10, help="steps per training-log record")
    t.add_argument("--train-minutes", type=float, default=None,
                   help="stop training after this many minutes (then save the head)")
    t.add_argument("--deepspeed", default=None, metavar="CONFIG",
                   help="data-parallel training with DeepSpeed (a JSON config, or 'zero2': "
                        "ZeRO stage 2, bf16 on GPUs): an EAGLE-1/2 head on the feature shards, "
                        "or the training-time test (--arch eagle3 / --ttt: every rank loads "
                        "the target); one process per device, started by torchrun "
                        "(docs/training.md)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stage(s) {bad}; use a subset of {STAGES}")
    if args.deepspeed and stages != ["train"]:
        raise ValueError("--deepspeed runs the train stage alone (--stages train): every rank "
                         "would run the other stages whole; run them first, split with "
                         "--worker auto (docs/training.md)")
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    (root / "args.json").write_text(json.dumps(vars(args), indent=2, default=str))
    from eagle2.train import data

    cfg = data.DataConfig(num_prompts=args.num_prompts, seed=args.prompt_seed,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          max_batch=args.gen_batch, chunk_size=args.chunk_size,
                          sample_every=args.sample_every)
    for archive in args.import_data:
        print(f"{archive}: {data.unpack_archive(Path(archive), root)} chunk files extracted",
              flush=True)
    target = None
    if "data" in stages:
        target = _data_stage(args, cfg, root)
    if "features" in stages:
        from eagle2.train.multi_device import worker_of

        hf = _features_model(args) if args.device_map else (target or _load_target(args)).hf
        layers = None
        if args.arch == "eagle3":
            from eagle2.eagle3 import default_feature_layers

            layers = default_feature_layers(hf.config.num_hidden_layers)
        if not data.extract_features(hf, root, args.max_len, worker=worker_of(args.worker),
                                     layers=layers):
            raise ValueError(f"no conversations under {root}; run the 'data' stage first")
    if "train" in stages and args.deepspeed and _trains_ttt(args):
        from eagle2.train.deepspeed_ttt import train_ttt_deepspeed_from_args

        train_ttt_deepspeed_from_args(args, root, _ttt_target)
    elif "train" in stages and args.deepspeed:
        from eagle2.train.deepspeed_train import train_deepspeed_from_args

        train_deepspeed_from_args(args, root)
    elif "train" in stages and _trains_ttt(args):
        from eagle2.train.ttt import TTTTrainer, train_ttt_from_args
        from eagle2.train.ttt_stored import StoredTTTTrainer

        trainer_cls = StoredTTTTrainer if args.stored_features else TTTTrainer
        train_ttt_from_args(args, target or _ttt_target(args), root, trainer_cls)
    elif "train" in stages:
        from eagle2.train.trainer import train_from_args

        train_from_args(args, target or _load_target(args, train=True), root)
    if args.export_data:
        n = data.pack_archive(root, Path(args.export_data))
        print(f"{args.export_data}: {n} chunk files", flush=True)
    return 0


def _trains_ttt(args) -> bool:
    """The train stage uses the training-time test (eagle2.train.ttt), not stored features."""
    return bool(args.arch == "eagle3" or args.ttt or args.init_head)


def _ttt_target(args):
    """The training-time test's target: whole, or (`--stored-features`) its embedding,
    lm_head and norm only."""
    if args.stored_features:
        from eagle2.devices import pick_device
        from eagle2.train.ttt_stored import VocabTarget

        return VocabTarget(args.target, pick_device(args.device))
    return _load_target(args, train=True)


def _load_target(args, train: bool = False):
    """fp32, except for a TTT training run with bf16 autocast: there a bf16 target skips
    autocast's cast of its 135M+ weights at every step (9% of a step here) and gives the
    features the service's bf16 target gives."""
    from eagle2.devices import pick_device
    from eagle2.target import TargetModel

    dtype = "float32"
    if train and _trains_ttt(args):
        from eagle2.train.ttt import use_bf16

        dtype = "bfloat16" if use_bf16(args.bf16, pick_device(args.device)) else "float32"
    return TargetModel.load(args.target, dtype=dtype, device=args.device)


def _features_model(args):
    """The target's HF model spread over devices by accelerate (`--device-map`)."""
    from eagle2.train.multi_device import load_across_devices, placement

    spec = args.device_map
    device_map = json.loads(Path(spec).read_text()) if spec.endswith(".json") else spec
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    hf = load_across_devices(args.target, dtype, device_map, offload_folder=args.offload_folder)
    print(f"target spread over {sorted(set(placement(hf).values()))}", flush=True)
    return hf


def _prompts(source: str, num: int, seed: int) -> list[str]:
    if source == "synthetic":
        from eagle2.train.prompts import make_prompts

        return make_prompts(num, seed=seed)
    import re

    from eagle2.bench.prompts import load_suite
    from eagle2.train.code_prompts import make_code_prompts

    bench = load_suite("humaneval") + load_suite("mt_bench")
    names = {n for b in bench for n in re.findall(r"def (\w+)", b.text)}
    prompts = make_code_prompts(num, seed, [b.text for b in bench], names)
    if len(prompts) < num:
        log.warning("the standard library gave %d code prompts (asked for %d)", len(prompts), num)
    return prompts


def _spread_generator(args):
    """`--device-map`: answers from the target spread over devices (HF generate)."""
    from transformers import AutoTokenizer

    from eagle2.target import embedded_model_dir
    from eagle2.train.multi_device import SpreadGenerator

    if args.prompt_source == "self":
        raise ValueError("--device-map answers synthetic or stdlib-code prompts "
                         "(--prompt-source self needs the engine)")
    hf = _features_model(args)
    tokenizer = AutoTokenizer.from_pretrained(args.target or embedded_model_dir())
    eos = hf.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return SpreadGenerator(hf, tokenizer, frozenset(i for i in eos if i is not None))


def _data_stage(args, cfg, root: Path):
    from eagle2.api import Eagle2
    from eagle2.train.data import chunk_path, generate_conversations
    if args.device_map:
        llm = _spread_generator(args)
    else:
        llm = Eagle2.load(args.target, draft="untrained", dtype=args.gen_dtype,
                          device=args.device, max_batch=cfg.max_batch, max_context=args.max_len,
                          threads=None)
    if args.prompt_source == "self":
        from eagle2.train.self_prompts import bench_texts, chunk_prompts

        bench = bench_texts()

        def prompts(i: int) -> list[str]:
            return chunk_prompts(llm, root, i, cfg.chunk_size, cfg.seed, bench)

        num_prompts = cfg.num_prompts
    else:
        prompts = _prompts(args.prompt_source, cfg.num_prompts, cfg.seed)
        prompts = prompts[:max(len(prompts) - args.hold_out_prompts, 0)]
        num_prompts = len(prompts)
    deadline = time.time() + 60 * args.data_minutes if args.data_minutes else None
    start = time.time()
    total = 0
    from eagle2.train.multi_device import worker_of

    worker, num_workers = worker_of(args.worker)
    for idx in range(worker, cfg.num_chunks, num_workers):
        if deadline is not None and time.time() > deadline:
            log.warning("data stage stopped at its time box (%s min)", args.data_minutes)
            break
        if idx * cfg.chunk_size >= num_prompts:
            break  # the prompt source ran out
        if chunk_path(root, idx).exists():
            continue
        total += generate_conversations(llm, prompts, cfg, root, [idx])
        rate = total / max(time.time() - start, 1e-9)
        print(f"chunk {idx}: {total} answer tokens, {rate:.1f} tokens/s", flush=True)
    return getattr(llm, "target", None)

