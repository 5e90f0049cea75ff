"""Where a GEMV stage's time goes when stages are kernels chained by programmatic dependent launch (PDL).

The megakernel's per-stage timeline (`benchmarks/megakernel.py --stages`) shows a 0.6B GEMV stage spending
2-3 us after its `griddepcontrol.wait` even when its weights were loaded before it (o_proj). This isolates
the parts with a chain of square GEMV links `x_{i+1} = W_i @ x_i` (N = K, bf16, one row tile per program, the
tile loaded before the wait, as in `decode_stage`), one kernel per link, captured in a CUDA graph:

  full       weights before the wait, the activation after it (the megakernel's GEMV stages)
  no_act     the activation is not read after the wait (a constant): what the dependent L2 load costs
  no_weight  no weights (a constant tile): what streaming them costs
  empty      neither: the boundary, the reductions and the store

`--replicas R`: every link writes R copies of its output and program p reads copy p % R, so that fewer
programs read the same L2 lines (132 programs read every line of x once per link otherwise).

    python benchmarks/pdl_chain.py --n 2048 1024 --replicas 1 8
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from megakernel import timed  # benchmarks/megakernel.py: ms per call, replayed from a CUDA graph

from rlbench.engine.megakernel.triton_stages import _stage_boundary

MODES = ("full", "no_act", "no_weight", "empty")


@triton.jit
def link(w_ptr, x_in, x_out, N: tl.constexpr, ROWS: tl.constexpr, REPL: tl.constexpr, WEIGHTS: tl.constexpr,
         ACT: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    ks = tl.arange(0, N)
    if WEIGHTS:
        w = tl.load(w_ptr + rows[:, None] * N + ks[None, :], cache_modifier=".cg")
    else:
        w = tl.full([ROWS, N], 1.0 / N, tl.bfloat16)
    _stage_boundary(PDL)
    if ACT:
        x = tl.load(x_in + (pid % REPL) * N + ks, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.full([N], 1.0, tl.float32)
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(tl.bfloat16)
    for r in tl.static_range(REPL):
        tl.store(x_out + r * N + rows, y)


def per_link_us(n: int, links: int, mode: str, repl: int, pdl: bool, iters: int, programs: int) -> float:
    rows = n // programs
    w = torch.randn(links, n, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    xs = [torch.randn(repl, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    flags = dict(WEIGHTS=mode in ("full", "no_act"), ACT=mode in ("full", "no_weight"))

    def chain(k):
        for i in range(k):
            link[(programs,)](w[i], xs[i % 2], xs[(i + 1) % 2], N=n, ROWS=rows, REPL=repl, PDL=pdl, **flags,
                              num_warps=8, launch_pdl=pdl and i > 0)

    return (timed(lambda: chain(links), iters) - timed(lambda: chain(1), iters)) * 1e3 / (links - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 1024], help="N = K of the square GEMV links")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--links", type=int, default=112)
    ap.add_argument("--programs", type=int, default=128, help="programs per link (rows = N / programs)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3)
    args = ap.parse_args()
    for n in args.n:
        floor = n * n * 2 / (args.bandwidth_tbs * 1e12) * 1e6
        print(f"N = K = {n}: {n * n * 2 / 1e6:.1f} MB of weights per link, {floor:.2f} us at "
              f"{args.bandwidth_tbs} TB/s; {args.programs} programs x {n // args.programs} rows", flush=True)
        for repl in args.replicas:
            for pdl in (True, False):
                cells = [f"{m} {per_link_us(n, args.links, m, repl, pdl, args.iters, args.programs):5.2f}"
                         for m in args.modes]
                print(f"  replicas {repl} {'pdl  ' if pdl else 'plain'}: us per link: " + ", ".join(cells),
                      flush=True)


if __name__ == "__main__":
    main()
