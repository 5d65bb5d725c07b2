"""`eagle2 build-ngram`: the n-gram store of the target's own answers (`eagle2.ngram`), written
beside the head as `ngram.npz`.

Reads self-distilled conversations (the head's training data: data-stage directories with
`conversations/chunk_*.json`, or their `.tar.xz` archives), holds out every `--holdout`-th
conversation, builds a store from the rest and fits each cell's rate on the held-out answers
(how often the target's own next token is the store's), then builds the shipped store from
all conversations with those rates. Prints the held-out check per context order and writes
it, with the sizes, into the store's `info`.

    eagle2 build-ngram --data data/smollm2-135m-instruct/self.tar.xz \
        data/smollm2-135m-instruct/synthetic.tar.xz --out eagle2/heads/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from eagle2.ngram import FILE_NAME, MAX_ORDER, SHARE_BINS, TOTAL_EDGES, NgramStore, fit_rates

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "data" / "smollm2-135m-instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", default=None,
                   help="data-stage directories or .tar.xz archives of conversations (default: "
                        f"the archives in {DEFAULT_DATA} when present)")
    p.add_argument("--out", default=None,
                   help="head directory to write ngram.npz into (default: the shipped head)")
    p.add_argument("--holdout", type=int, default=10,
                   help="every N-th conversation fits the rates and is left out of that store")
    p.add_argument("--max-order", type=int, default=MAX_ORDER)
    p.add_argument("--min-total", type=int, default=2,
                   help="keep contexts seen at least this many times")
    p.add_argument("--prompt-tail", type=int, default=MAX_ORDER,
                   help="prompt tokens before each answer that give its first tokens a context")


def read_conversations(sources: list[str]) -> list[dict]:
    from eagle2.train.data import load_conversations, unpack_archive

    convs: list[dict] = []
    for src in sources:
        path = Path(src)
        if path.is_dir():
            convs += load_conversations(path)
        elif path.name.endswith(".tar.xz"):
            with tempfile.TemporaryDirectory() as tmp:
                unpack_archive(path, Path(tmp))
                convs += load_conversations(Path(tmp))
        else:
            raise ValueError(f"{src}: neither a data directory nor a .tar.xz archive")
    if not convs:
        raise ValueError(f"no conversations in {', '.join(sources)}")
    return convs


def check(cells, hits, rates, positions: int, max_order: int) -> dict:
    """Held-out outcomes (`NgramStore.outcomes` over `positions` answer tokens): hit rate
    against the rates' prediction, per context order."""
    orders = cells // (SHARE_BINS * len(TOTAL_EDGES)) + 1
    out = {"positions": positions, "covered": len(cells),
           "hit_rate": round(float(hits.mean()), 4) if len(hits) else 0.0,
           "predicted": round(float(rates[cells].mean()), 4) if len(cells) else 0.0,
           "by_order": {}}
    for o in range(1, max_order + 1):
        m = orders == o
        if m.any():
            out["by_order"][str(o)] = {
                "n": int(m.sum()), "hit_rate": round(float(hits[m].mean()), 4),
                "predicted": round(float(rates[cells[m]].mean()), 4)}
    return out


def run(args) -> int:
    from eagle2.api import shipped_head_dir
    from eagle2.target import EMBEDDED_NAME

    sources = args.data or [str(p) for p in sorted(DEFAULT_DATA.glob("*.tar.xz"))]
    if not sources:
        raise SystemExit(f"no --data given and no archives in {DEFAULT_DATA}")
    out = Path(args.out) if args.out else shipped_head_dir(EMBEDDED_NAME)
    if out is None or not out.is_dir():
        raise SystemExit(f"--out {out}: not a head directory")
    if args.holdout < 2:
        raise SystemExit("--holdout must be >= 2")
    t0 = time.perf_counter()
    convs = read_conversations(sources)
    answers = [(c["prompt_ids"][-args.prompt_tail:] if args.prompt_tail else [],
                c["answer_ids"]) for c in convs]
    held = answers[:: args.holdout]
    rest = [a for i, a in enumerate(answers) if i % args.holdout]
    fitting = NgramStore.build(rest, args.max_order, args.min_total)
    cells, hits = fitting.outcomes(held)
    rates = fit_rates(cells, hits)
    report = {"sources": [Path(s).name for s in sources], "conversations": len(convs),
              "answer_tokens": sum(len(a) for _, a in answers), "holdout": args.holdout,
              "max_order": args.max_order, "min_total": args.min_total,
              "held_out": check(cells, hits, rates, sum(len(a) for _, a in held),
                                args.max_order)}
    store = NgramStore.build(answers, args.max_order, args.min_total, rates)
    report["contexts"] = len(store)
    report["build_s"] = round(time.perf_counter() - t0, 1)
    store = store.with_rates(rates, report)
    path = out / FILE_NAME
    store.save(path)
    print(json.dumps(report, indent=1))
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(store)} contexts)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
