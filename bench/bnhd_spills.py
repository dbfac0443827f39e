"""Registers and spills of every hopper_fwd record of a GPU's shipped table, compiled as measured
(the dense render) and as its bnhd render (Variant.bnhd: q/k/v in (B, N, H, D) memory), each at
its bucket's head dim, dtype and causality, for sm_90 with this Triton (no GPU needed).

    python3 bench/bnhd_spills.py --gpu H100 --jobs 16 --out bnhd_spills.jsonl

Prints the records whose bnhd render spills more than the dense one (exit 1 if any)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "0"


def _compile(case):
    from flashtune.codegen import Variant
    from flashtune.compile_check import check_variant
    name, d, dtype, causal = case
    v = Variant.parse(name)
    out = {}
    for tag, var in (("dense", v), ("bnhd", dataclasses.replace(v, bnhd=True))):
        try:
            out[tag] = check_variant(var, d, dtype, causal=causal)
        except Exception as e:  # noqa: BLE001 -- a render that does not build is a result
            out[tag] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"variant": name, "head_dim": d, "dtype": dtype, "causal": causal, **out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from flashtune import targets
    from flashtune.cli_kernels import _table_cases
    cases = [(v.name, d, dt, c) for v, d, dt, c in
             _table_cases(targets.get(a.gpu), None, None, None, ("hopper_fwd",))]
    worse = 0
    out = open(a.out, "w") if a.out else None
    with ProcessPoolExecutor(a.jobs) as pool:
        for row in pool.map(_compile, cases):
            if out:
                out.write(json.dumps(row) + "\n")
            dense, bnhd = row["dense"], row["bnhd"]
            spill = {t: sum(k.get("spill_bytes", 0) for k in r.values())
                     if "error" not in r else None for t, r in (("dense", dense), ("bnhd", bnhd))}
            if spill["bnhd"] is None or (spill["dense"] is not None
                                         and spill["bnhd"] > spill["dense"]):
                worse += 1
                print(f"WORSE d={row['head_dim']} {row['dtype']} causal={row['causal']} "
                      f"{row['variant']}: dense {spill['dense']} B, bnhd {spill['bnhd']} B "
                      f"{bnhd.get('error', '')}")
    print(f"{len(cases)} records compiled both ways; {worse} spill more as bnhd")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
