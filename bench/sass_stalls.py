"""Where a kernel's warps wait, per SASS instruction: a summary of Nsight Compute's source page.

    ncu ... --section SourceCounters -o rep python3 bench/hopper_ncu.py ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 bench/sass_stalls.py sass.csv [--top 25]

For each kernel in the file: the instructions with the most warp-state samples (PC sampling:
where the warps were when sampled, and why they could not issue), their share of the kernel's
samples, the samples summed per opcode, and a work summary: the idle warps' share (a
warp-specialized kernel parks its default partition on one NOP for the whole run) and where the
working warps wait -- mbarriers, the tensor cores, wgmma issue, CTA barriers, the rest. The page's columns differ between ncu versions, so
they are found by name; a file whose columns are not recognised gets its header printed instead.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def tables(path: str):
    """(title, header, rows) per kernel: a header row is one that names a 'Source' column; any
    non-table line before it (a kernel's name) becomes the title."""
    title, header, rows = "", None, []
    with open(path, newline="", errors="replace") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if "Source" in row and any("Address" in c for c in row):
                if header is not None:
                    yield title, header, rows
                header, rows = row, []
                continue
            if header is None or len(row) != len(header):
                if header is not None and rows:
                    yield title, header, rows
                    header, rows = None, []
                title = " ".join(row)[:160]
                continue
            rows.append(row)
    if header is not None:
        yield title, header, rows


def opcode(src: str) -> str:
    """The SASS opcode without predicate and modifiers' operands: '@P0 HGMMA.64x64x16...' ->
    'HGMMA.64x64x16...' cut at the first space."""
    s = re.sub(r"^@!?U?P\w+\s+", "", src.strip())
    return s.split(" ")[0] if s else "?"


def summarise(title, header, rows, top: int) -> None:
    col = {c: i for i, c in enumerate(header)}
    samp = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
    if samp is None:
        print(f"## {title}\n(no sampling column recognised) header: {header}")
        for r in rows[:3]:
            print("   ", r)
        return
    src = col["Source"]
    addr = next(i for c, i in col.items() if "Address" in c)
    # per-reason columns, where this ncu version prints them (names start with 'stall_' or end
    # in '(Samples)'); else only the totals
    reasons = [c for c in header if c.startswith("stall_") or
               (c.endswith("Samples)") and not c.startswith("Warp Stall Sampling"))]
    total = sum(_num(r[col[samp]]) for r in rows) or 1.0
    print(f"## {title}\n{len(rows)} instructions, {int(total)} samples ({samp})")
    ranked = sorted(rows, key=lambda r: -_num(r[col[samp]]))
    for r in ranked[:top]:
        s = _num(r[col[samp]])
        why = ""
        if reasons:
            top_r = sorted(((_num(r[col[c]]), c) for c in reasons), reverse=True)[:3]
            why = "  " + ", ".join(f"{c.replace('stall_', '')} {v / max(s, 1):.0%}"
                                   for v, c in top_r if v > 0)
        print(f"  {r[addr]:>8} {100 * s / total:5.1f}%  {r[src].strip()[:70]}{why}")
    per_op = defaultdict(float)
    for r in rows:
        per_op[opcode(r[src])] += _num(r[col[samp]])
    print("  by opcode: " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in
                                      sorted(per_op.items(), key=lambda kv: -kv[1])[:14]))


def _idle(rows, i, col, samp) -> bool:
    """A sample of a warp that does no work: warp_specialize parks its default partition's warps
    (and padding) on the NOP after a BAR.SYNC for the whole kernel, waiting for the worker
    partitions (25-38% of a Hopper forward's samples, H100, session 18). Not a working warp's
    stall: the work summary leaves them out."""
    src = rows[i][col["Source"]].strip()
    prev = rows[i - 1][col["Source"]].strip() if i else ""
    total = _num(rows[i][col[samp]])
    bar = _num(rows[i][col["stall_barrier"]]) if "stall_barrier" in col else total
    return src == "NOP" and "BAR.SYNC" in prev and total > 0 and bar >= 0.9 * total


def _kind(src: str, row, col, samp) -> str:
    """Where a working warp waits, by instruction: on an mbarrier (a try-wait loop's branch,
    long-scoreboard), on the tensor cores (the wgmma wait), issuing a wgmma, at a CTA barrier, or
    anything else (the softmax, address arithmetic)."""
    op = opcode(src)
    if op.startswith("HGMMA"):
        return "wgmma issue"
    if "DEPBAR" in op and op.startswith("WARPGROUP"):
        return "wgmma wait"
    if op.startswith("BAR.SYNC"):
        return "bar.sync"
    if op == "BRA" and "stall_long_sb" in col and \
            _num(row[col["stall_long_sb"]]) > 0.5 * _num(row[col[samp]]):
        return "mbarrier wait"
    return "other"


def work_summary(header, rows) -> str:
    """One line per kernel: the idle warps' share of the samples, then the working warps' samples
    by kind (_kind) and their top stall reasons."""
    col = {c: i for i, c in enumerate(header)}
    samp = next((c for c in header if c.startswith("Warp Stall Sampling (All")), None)
    if samp is None:
        return "(no sampling column)"
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    idle, kinds, why = 0.0, defaultdict(float), defaultdict(float)
    for i, r in enumerate(rows):
        if _idle(rows, i, col, samp):
            idle += _num(r[col[samp]])
            continue
        kinds[_kind(r[col["Source"]], r, col, samp)] += _num(r[col[samp]])
        for c in reasons:
            why[c] += _num(r[col[c]])
    work = sum(kinds.values()) or 1.0
    wsum = sum(why.values()) or 1.0
    return (f"idle warps {100 * idle / (idle + work):.0f}% of samples | working warps: "
            + ", ".join(f"{k} {100 * v / work:.0f}%" for k, v in
                        sorted(kinds.items(), key=lambda kv: -kv[1]))
            + " | stalls: " + ", ".join(f"{c[6:]} {100 * v / wsum:.0f}%" for c, v in
                                        sorted(why.items(), key=lambda kv: -kv[1])[:6]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    n = 0
    for title, header, rows in tables(args.csv):
        summarise(title, header, rows, args.top)
        print("  " + work_summary(header, rows))
        n += 1
    if not n:
        print("no source table found; the file starts:")
        with open(args.csv, errors="replace") as f:
            print(f.read(1500))
    return 0


if __name__ == "__main__":
    sys.exit(main())
