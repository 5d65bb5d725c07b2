# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The native FMA linear alone, on the embedded model's shapes (docs/cpu-backend.md, "CPUs with
AVX2 only"): ms per pass over all 30 layers' linears and the lm_head (random bf16 weights of
the same shapes), one thread (`--threads`), best of `--repeats`, for each row count. Prints
and writes JSON.

    .venv/bin/python benchmarks/native_linears.py [--rows 1,2,3,4,6,8,16] [--out FILE] \
        [--against OTHER/cpu_ops.cpp] [--march haswell]

--against: another source of the operators (e.g. a worktree at an older commit), built under
its own namespace (`native.load_variant`) and timed in the same process, the two in turn each
round; every output is checked to be bitwise the same. --march: build this source (and the
other) for another instruction set (haswell: the AVX2 build).
"""

import argparse
import json
import time
from pathlib import Path

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2.cpu.native import SOURCE, cpu_ops, load_variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--against", default=None)
    ap.add_argument("--march", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = {"this": load_variant("eagle2_lin_this", SOURCE, args.march) if args.march
           else cpu_ops()}
    if ops["this"] is None:
        raise SystemExit("eagle2's native CPU operations are not built here")
    if args.against:
        ops["against"] = load_variant("eagle2_lin_base", Path(args.against),
                                      args.march or "native")
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [(torch.randn(s, generator=g) / 24).bfloat16() for s in shapes]
    packed = [ops["this"].pack_linear(w) for w in weights]
    rows = [int(r) for r in args.rows.split(",")]
    xs = {k: torch.randn(max(rows), k, generator=g).bfloat16() for k in (576, 1536)}
    ms = {name: {} for name in ops}
    with torch.inference_mode():
        for m in rows:
            best = dict.fromkeys(ops, float("inf"))
            for _ in range(args.repeats):
                for name, o in ops.items():
                    t0 = time.perf_counter()
                    for w, p in zip(weights, packed, strict=True):
                        o.linear_fma(xs[w.shape[1]][:m], p, w.shape[0])
                    best[name] = min(best[name], time.perf_counter() - t0)
            for name in ops:
                ms[name][m] = round(best[name] * 1e3, 2)
            if len(ops) > 1:  # every output bitwise the same (one pass, outside the timing)
                for w, p in zip(weights, packed, strict=True):
                    a = ops["this"].linear_fma(xs[w.shape[1]][:m], p, w.shape[0])
                    b = ops["against"].linear_fma(xs[w.shape[1]][:m], p, w.shape[0])
                    if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
                        raise SystemExit(f"outputs differ at {m} rows, weight {tuple(w.shape)}")
            print(m, {name: ms[name][m] for name in ops}, flush=True)
    size = sum(w.numel() * 2 for w in weights)
    result = {"isa": ops["this"].isa(), "march": args.march or "native", "weight_bytes": size,
              "ms": ms["this"], "x_one_row": {m: round(t / ms["this"][rows[0]], 2)
                                             for m, t in ms["this"].items()}}
    if args.against:
        result.update(against=args.against, ms_against=ms["against"], bitwise_equal=True)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
