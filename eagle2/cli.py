"""The `eagle2` command line: generate, bench, train-head, plan, serve, client, soak.

`serve` and `client` live in `services/` (Ray Serve and gRPC); they are imported only when
those commands run, so the algorithm package itself never imports Ray or gRPC.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from eagle2.config import MODES

# command -> module with add_arguments(parser) and run(args) -> int
COMMANDS = {
    "generate": ("eagle2.cli", "generate a completion in-process"),
    "bench": ("eagle2.bench.run", "benchmark speculative modes against plain decoding"),
    "bench-forward": ("eagle2.bench.forward", "the target forward's cost curve vs the roofline"),
    "train-head": ("eagle2.train.run", "train an EAGLE draft head for a target"),
    "build-ngram": ("eagle2.train.build_ngram", "build the n-gram store of the target's answers"),
    "calibrate": ("eagle2.bench.calibrate", "fit a head's value calibration on held-out prompts"),
    "plan": ("eagle2.plan", "plan GPU placement and memory for a model"),
    "serve": ("services.cli_serve", "start Ray Serve with the gRPC service (port 9000)"),
    "client": ("services.client", "call a running service over gRPC"),
    "bench-service": ("services.bench_service",
                      "benchmark the service's OpenAI endpoint against the in-process engine"),
    "soak": ("services.soak", "run a bounded mixed load against the service, with a verdict"),
}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None,
                   help="draft head directory, or 'untrained' (default: the shipped head)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: auto)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")


def add_tree_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default="eagle2", choices=MODES)
    p.add_argument("--total-tokens", type=int, default=None, help="tree size incl. the root")
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--tree-top-k", type=int, default=None, help="draft tree branching")
    add_lookup_argument(p)
    p.add_argument("--budget", choices=("auto", "fixed"), default="auto",
                   help="auto: the sizes are maxima and the engine keeps what pays each step "
                        "on this machine; fixed: exactly these sizes")


def add_lookup_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=int, default=None, metavar="D",
                   help="longest prompt-lookup chain in the eagle2 tree (suffix matches "
                        "against the prompt and output; 0: off; default: TreeConfig's)")


def tree_from_args(args):
    from eagle2.config import TreeConfig

    fields = {"mode": args.mode, "budget": getattr(args, "budget", "auto")}
    for name in ("total_tokens", "depth", "lookup"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    if getattr(args, "tree_top_k", None) is not None:
        fields["top_k"] = args.tree_top_k
    return TreeConfig(**fields)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the text without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", default="auto",
                   help="CPU threads: a number, or auto (EAGLE2_THREADS / OMP_NUM_THREADS if "
                        "set, else the count that decodes fastest here, measured once per "
                        "machine and cached)")
    add_model_arguments(p)
    add_tree_arguments(p)


def run(args) -> int:
    from eagle2.api import Eagle2
    from eagle2.config import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))
    tree = tree_from_args(args)
    threads = args.threads if args.threads == "auto" else int(args.threads)
    llm = Eagle2.load(args.target, args.draft, tree=tree, dtype=args.dtype, device=args.device,
                      max_batch=1, threads=threads)
    out = llm.generate([args.prompt], params, chat=not args.raw)[0]
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens, "num_steps": out.num_steps,
            "tau": round(out.tau, 4),  # new tokens / steps, the prefill counted as a step
            # tokens per verification step (the EAGLE papers' definition)
            "tau_decode": round((len(out.token_ids) - 1) / (out.num_steps - 1), 4)
            if out.num_steps > 1 else None,
            "tokens_per_s": round(out.tokens_per_s, 3),
            "wall_s": round(out.wall_s, 4), "mode": tree.mode,
        }))
    else:
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, {out.num_steps} steps, tau {out.tau:.2f}, "
              f"{out.tokens_per_s:.1f} tokens/s, mode {tree.mode}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle2", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    wanted = next((a for a in argv if a in COMMANDS), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:  # import only the module of the command that runs
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args)
    except ValueError as e:
        print(f"eagle2 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
