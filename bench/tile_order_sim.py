"""How evenly a persistent hopper_fwd grid's static schedule (program i runs tiles i, i + grid,
...) spreads causal work over its programs, for the causal tile orders of
codegen/templates/attn_hopper_fwd.py.tmpl's _tile_coords. No GPU: a model, where a tile of query
block m costs m + 1 key blocks plus a fixed 1.5 (its prologue and epilogue). Prints the busiest
program's work over the mean (1.000: even) on the bench's standard grid (B*N = 16k, hidden 2048).

    python3 bench/tile_order_sim.py [--grid 132]

Session 24 chose head_order's rotation from this: rotating by the head's index alone gives each
program of a 132-program grid one query block when 132 / num_m is even (D=64's 256-row tiles at
N=512: 1.20), so the rotation also counts the grid rounds there.
"""
from __future__ import annotations

import argparse


def head_order(t: int, num_m: int, grid: int) -> int:
    """The template's head_order _tile_coords: the query block of tile t."""
    bh = t // num_m
    shift = bh
    if grid % num_m == 0 and (grid // num_m) % 2 == 0:
        shift = bh + (bh * num_m) // grid
    return num_m - 1 - (t % num_m + shift) % num_m


def head_only(t: int, num_m: int, grid: int) -> int:
    """head_order rotated by the head's index alone (its first render, session 24)."""
    return num_m - 1 - (t % num_m + t // num_m) % num_m


def longest_first(t: int, num_m: int, grid: int, heads: int = 0) -> int:
    """Every head's last query block first (l2_order's order within one section)."""
    return num_m - 1 - t // heads


def imbalance(order, grid: int, num_m: int, heads: int) -> float:
    work = [0.0] * grid
    for t in range(num_m * heads):
        m = order(t, num_m, grid, heads) if order is longest_first else order(t, num_m, grid)
        work[t % grid] += m + 1 + 1.5
    return max(work) / (sum(work) / grid)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", type=int, default=132, help="programs (the H100's SM count)")
    a = ap.parse_args()
    cases = []
    for d, rows in ((64, 256), (128, 128), (256, 128)):  # the causal records' tile rows
        for n in (512, 1024, 2048, 4096):
            cases.append((f"D={d} N={n}", -(-n // rows), 16384 // n * (2048 // d)))
    print(f"{'':14}" + "".join(f"{name:>14}" for name, _, _ in cases))
    for label, order in (("head_order", head_order), ("head index", head_only),
                         ("longest first", longest_first)):
        print(f"{label:14}" + "".join(f"{imbalance(order, a.grid, m, h):14.3f}"
                                      for _, m, h in cases))


if __name__ == "__main__":
    main()
