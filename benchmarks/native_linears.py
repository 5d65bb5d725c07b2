# ruff: noqa: I001  (eagle2 before torch: passive OpenMP waiting)
"""The native FMA linear alone, on the embedded model's shapes (docs/DESIGN.md, "CPUs with
AVX2 only"): ms per pass over all 30 layers' linears and the lm_head (random bf16 weights of
the same shapes), one thread, best of 6, for each row count. Prints and writes JSON.

    .venv/bin/python benchmarks/native_linears.py [--rows 1,2,3,4,6,8,16] [--out FILE]
"""

import argparse
import json
import time

import eagle2  # noqa: F401  (first: passive OpenMP waiting)
import torch

from eagle2.native import cpu_ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,16")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("eagle2's native CPU operations are not built here")
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [(torch.randn(s, generator=g) / 24).bfloat16() for s in shapes]
    packed = [ops.pack_linear(w) for w in weights]
    rows = [int(r) for r in args.rows.split(",")]
    xs = {k: torch.randn(max(rows), k, generator=g).bfloat16() for k in (576, 1536)}
    ms = {}
    with torch.inference_mode():
        for m in rows:
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for w, p in zip(weights, packed, strict=True):
                    ops.linear_fma(xs[w.shape[1]][:m], p, w.shape[0])
                best = min(best, time.perf_counter() - t0)
            ms[m] = round(best * 1e3, 2)
    size = sum(w.numel() * 2 for w in weights)
    result = {"isa": ops.isa(), "weight_bytes": size, "ms": ms,
              "x_one_row": {m: round(t / ms[rows[0]], 2) for m, t in ms.items()}}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
