"""`make gpu-check`: what a short GPU lease must show, written to one JSON file.

    PYTHONPATH=. python3 -m eagle2.gpu_check --out DIR          # CUDA, bf16, < 8 min on an H200
    PYTHONPATH=. python3 -m eagle2.gpu_check --out DIR --tiny   # CPU, fp32, tiny shapes, seconds

Imports only eagle2, torch, transformers and safetensors (no Ray, DeepSpeed, gguf, network).
Weights are random: a Llama with Llama-3-8B shapes and a random EAGLE head in bf16, plus a few
layers with Llama-3-70B shapes. It records:
1. losslessness: greedy output of eagle2 / static / chain equals vanilla in the same engine
   (logits spread by a scaled lm_head so that bf16 noise rarely flips an argmax; a mismatch is
   reported with its position), and the sampling path runs;
2. the forward cost curve: ms per target forward for N = 1..64 tokens x batch 1..16, eager and
   with CUDA graphs (`eagle2.cuda_graphs`), for the 8B shapes and per 70B-shape layer;
3. step overhead: host (launch) time against device time of one forward;
4. eagle2 against vanilla: ms per engine step and tokens per step at batch 1 and 8;
5. the same losslessness and step cost with a random EAGLE-3 head (three-layer features, its
   own lm_head over a 32,000-token draft vocabulary), the kind the 70B deployment uses.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

FORBIDDEN = ("ray", "grpc", "deepspeed", "gguf")
SHAPES = {  # config.json values (meta-llama/Meta-Llama-3-8B and -70B)
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama-3-70b-layers": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=4,
                               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
}


def random_target(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A random Llama (TargetModel) of the named shape; lm_head scaled so logits spread out."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle2.target import TargetModel

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype (no fp32 copy on the GPU)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return TargetModel(model, None, f"random-{shape}")


def make_engine(target, head, max_batch: int, max_context: int):
    from eagle2.drafter import Drafter
    from eagle2.engine import Engine
    from eagle2.runner import LocalRunner

    target.set_feature_layers(head.feature_layers(target.num_layers))  # EAGLE-3: 3 layers
    drafter = Drafter(head, target.embed, target.lm_head, max_slots=max_batch,
                      max_len=max_context)
    runner = LocalRunner(target, max_batch, max_context + Engine.tree_margin)
    return Engine(runner, drafter, max_batch=max_batch, max_context=max_context)


def generate(engine, prompts: list[list[int]], params, tree) -> tuple[list[list[int]], dict]:
    """New tokens per prompt, and ms per step / tokens per step of the run."""
    from eagle2.engine import Request

    out = {f"s{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add(Request(f"s{i}", tuple(p), params, tree))
    steps, decode_s = 0, 0.0
    while engine.has_work():
        prefill = bool(engine.waiting) and len(engine.seqs) < engine.max_batch
        t0 = time.perf_counter()
        events = engine.step()
        _sync(engine.runner.device)
        if not prefill:
            steps += 1
            decode_s += time.perf_counter() - t0
        for ev in events:
            out[ev.seq_id].extend(ev.token_ids)
    tokens = sum(len(v) for v in out.values()) - len(prompts)  # less the prefills' tokens
    return [out[f"s{i}"] for i in range(len(prompts))], {
        "steps": steps, "ms_per_step": round(1000 * decode_s / max(steps, 1), 3),
        "tokens_per_step": round(tokens / max(steps, 1), 3)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_eagle3_head(target, dtype: torch.dtype, device: str, draft_vocab: int = 32000):
    """A random EAGLE-3 head (the published architecture) over every k-th target token."""
    from eagle2.eagle3 import new_eagle3_head

    layers = target.num_layers
    aux = None if layers >= 6 else (0, layers // 2 - 1, layers - 2)  # tiny: valid layer ids
    vocab = target.vocab_size
    d2t = torch.arange(0, vocab, max(1, vocab // draft_vocab))[:draft_vocab]
    return new_eagle3_head(target.config, d2t, seed=0, dtype=dtype,
                           aux_layer_ids=aux).to(device)


def check_lossless(target, head, sizes: dict, num_tokens: int,
                   modes: tuple[str, ...] = ("eagle2", "static", "chain"),
                   sampling: bool = True) -> dict:
    """Greedy eagle2 / static / chain against vanilla, and one sampling run per mode."""
    from eagle2.config import SamplingParams, TreeConfig

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist()
               for n in (7, 12, 5)]
    greedy = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    trees = {"vanilla": TreeConfig("vanilla"), **{
        mode: TreeConfig(mode, sizes["total_tokens"], sizes["depth"], sizes["top_k"],
                         budget="fixed")
        for mode in modes}}
    trees["eagle2-auto"] = TreeConfig("eagle2", sizes["total_tokens"], sizes["depth"],
                                      sizes["top_k"])  # the cost-aware budget (default)
    out, ref = {}, None
    for mode, tree in trees.items():
        tokens, _ = generate(make_engine(target, head, 4, 256), prompts, greedy, tree)
        ref = tokens if mode == "vanilla" else ref
        mismatch = [(i, next(j for j, (a, b) in enumerate(zip(t, r, strict=True)) if a != b))
                    for i, (t, r) in enumerate(zip(tokens, ref, strict=True)) if t != r]
        out[f"greedy_{mode}"] = {"equal_to_vanilla": not mismatch,
                                 "first_mismatch": mismatch[:3]}
    if not sampling:
        return out
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=num_tokens,
                            ignore_eos=True, seed=3)
    for mode in ("eagle2", "vanilla"):
        tokens, _ = generate(make_engine(target, head, 4, 256), prompts, params, trees[mode])
        out[f"sampling_{mode}"] = {"ran": all(len(t) == num_tokens for t in tokens)}
    return out


def forward_cost(target, batches: list[int], tokens: list[int], reps: int,
                 graphs: bool) -> list[dict]:
    """ms per forward (features + logits of the last token) for each (batch, N)."""
    from eagle2.cuda_graphs import GraphedForward

    max_len = 256
    cache = target.allocate_cache(max(batches), max_len)
    cache.lengths[:] = 64  # a committed prefix of 64 positions (values do not matter)
    dev = target.device
    rows = []
    for num_b in batches:
        for num_n in tokens:
            toks = torch.randint(0, target.vocab_size, (num_b, num_n), device=dev)
            pos = (64 + torch.arange(num_n, device=dev)).expand(num_b, num_n).contiguous()
            mask = torch.ones(num_n, num_n, dtype=torch.bool, device=dev).tril()
            mask = mask.expand(num_b, num_n, num_n).contiguous()
            row = {"batch": num_b, "tokens": num_n}
            eager = GraphedForward(target, cache, [])
            row["eager_ms"], row["host_ms"] = _time(eager, target, toks, pos, mask, reps)
            if graphs and dev.type == "cuda":
                graphed = GraphedForward(target, cache, [(num_b, num_n)])
                row["graph_ms"], _ = _time(graphed, target, toks, pos, mask, reps)
                del graphed
            rows.append(row)
    return rows


@torch.inference_mode()
def _time(forward, target, toks, pos, mask, reps: int) -> tuple[float, float]:
    """(device ms per call incl. logits of the last token, host ms to issue one call)."""
    dev = target.device
    for _ in range(2):
        target.logits(forward(toks, pos, mask)[:, -1])
    _sync(dev)
    t0 = time.perf_counter()
    target.logits(forward(toks, pos, mask)[:, -1])
    host = time.perf_counter() - t0  # on CUDA: launch time only (no sync)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        target.logits(forward(toks, pos, mask)[:, -1])
    _sync(dev)
    device_ms = 1000 * (time.perf_counter() - t0) / reps
    return round(device_ms, 3), round(1000 * host, 3)


def eagle2_vs_vanilla(target, head, sizes: dict, num_tokens: int) -> list[dict]:
    from eagle2.config import SamplingParams, TreeConfig

    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    rows = []
    for num_b in (1, 8):
        prompts = [[(7 * i + j) % target.vocab_size for j in range(9)] for i in range(num_b)]
        for mode in ("vanilla", "eagle2"):
            tree = TreeConfig(mode, sizes["total_tokens"], sizes["depth"], sizes["top_k"],
                              budget="fixed") if mode != "vanilla" else TreeConfig("vanilla")
            _, stats = generate(make_engine(target, head, num_b, 256), prompts, params, tree)
            rows.append({"batch": num_b, "mode": mode, **stats})
    return rows


def run(args: argparse.Namespace) -> dict:
    from eagle2.head import new_head

    t_start = time.time()
    tiny = args.tiny or not torch.cuda.is_available()
    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    sizes = {"total_tokens": 16, "depth": 4, "top_k": 4}
    batches = [1, 2] if tiny else [1, 2, 4, 8, 16]
    tokens = [1, 4, 8] if tiny else [1, 2, 4, 8, 16, 32, 64]
    reps = 3 if tiny else 10
    report: dict = {"command": "gpu-check", "tiny": tiny, "device": device,
                    "device_name": torch.cuda.get_device_name() if device == "cuda" else
                    platform.processor() or platform.machine(),
                    "dtype": str(dtype), "torch": torch.__version__, "tree": sizes}
    shape = "tiny" if tiny else "llama-3-8b"
    target = random_target(shape, dtype, device)
    head = new_head(target.config, seed=0, dtype=dtype).to(device)
    report["model"] = {"shape": shape, **SHAPES[shape]}
    report["lossless"] = check_lossless(target, head, sizes, 8 if tiny else 24)
    report["forward_cost"] = forward_cost(target, batches, tokens, reps, graphs=not tiny)
    report["eagle2_vs_vanilla"] = eagle2_vs_vanilla(target, head, sizes, 8 if tiny else 32)
    head3 = random_eagle3_head(target, dtype, device, 64 if tiny else 32000)
    report["lossless_eagle3_head"] = check_lossless(target, head3, sizes, 8 if tiny else 24,
                                                    modes=("eagle2", "chain"))
    report["eagle3_vs_vanilla"] = eagle2_vs_vanilla(target, head3, sizes, 8 if tiny else 32)
    del target, head, head3
    if not tiny:
        torch.cuda.empty_cache()
        big = random_target("llama-3-70b-layers", dtype, device)
        report["forward_cost_70b_4_layers"] = forward_cost(big, [1, 8], [1, 16, 64], reps, True)
        del big
    report["imported_forbidden"] = [m for m in FORBIDDEN if m in sys.modules]
    checks = [v.get("equal_to_vanilla", v.get("ran"))
              for key in ("lossless", "lossless_eagle3_head") for v in report[key].values()]
    report["passed"] = all(checks) and not report["imported_forbidden"]
    report["wall_s"] = round(time.time() - t_start, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle2.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu-check.json")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on CPU in fp32 (the CI version); default on a "
                             "machine without CUDA")
    args = parser.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("device", "passed", "lossless", "wall_s")}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
