"""Paged against contiguous decoding through the public API, as `flashtune bench`'s
flashtune-paged256 peer calls it (each sequence's 256-key pages shuffled within its own range,
one table for every layer), at B=1 and B=64, 2k keys, GQA 32/8 and MQA 8/1, D=128, bf16:

- every layer's paged output against the contiguous one (bit for bit expected: the same keys in
  the same splits), and layer 0 against the float64 reference on two sequences;
- GB/s (K+V bytes over time) of a 16-layer CUDA graph replay (L2 flushed between replays,
  bench/decode_bench.py's timing), contiguous and paged interleaved over --reps repetitions.

    python3 bench/paged_api_check.py --out paged_api.jsonl [--batches 1,64] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import decode_bench as db  # noqa: E402
import flashtune  # noqa: E402
from flashtune.reference import reference  # noqa: E402

D, NK, PAGE, LAYERS = 128, 2048, 256, 16


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    db.GRAPH = True
    out = open(a.out, "a")

    def write(row):
        print(row, flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    for hq, hk in ((32, 8), (8, 1)):
        for b in (int(x) for x in a.batches.split(",")):
            q = torch.randn(b, 1, hq, D, dtype=torch.bfloat16, device="cuda")
            kcs = [torch.randn(b, NK, hk, D, dtype=torch.bfloat16, device="cuda")
                   for _ in range(LAYERS)]
            vcs = [torch.randn_like(k) for k in kcs]
            sl = torch.full((b,), NK, dtype=torch.int32, device="cuda")
            per = NK // PAGE
            gen = torch.Generator().manual_seed(0)
            table = torch.stack([i * per + torch.randperm(per, generator=gen)
                                 for i in range(b)]).to(device="cuda", dtype=torch.int32)

            def contiguous(i):
                return lambda: flashtune.attention_with_kvcache(q, kcs[i], vcs[i],
                                                                cache_seqlens=sl)

            def paged(i):
                return lambda: flashtune.attention_with_kvcache(
                    q, kcs[i].view(-1, PAGE, hk, D), vcs[i].view(-1, PAGE, hk, D),
                    cache_seqlens=sl, block_table=table)
            worst = max(float((contiguous(i)() - paged(i)()).abs().max()) for i in range(LAYERS))
            o = paged(0)()
            ref_err = 0.0
            for s in (0, b - 1):
                ref = reference(q[s:s + 1].transpose(1, 2), kcs[0][s:s + 1].transpose(1, 2),
                                vcs[0][s:s + 1].transpose(1, 2))
                ref_err = max(ref_err, float((o[s:s + 1].transpose(1, 2).double().cpu()
                                              - ref.cpu()).abs().max()))
            times = {"contiguous": [], "paged": []}
            for _ in range(a.reps):
                for name, make in (("contiguous", contiguous), ("paged", paged)):
                    times[name].append(db.bench_ms(db.layered(make, LAYERS)) / LAYERS)
            kv = 2 * b * NK * hk * D * 2
            ms = {k: statistics.median(v) for k, v in times.items()}
            write({"Hq": hq, "Hk": hk, "B": b, "Nk": NK, "paged_vs_contiguous_max_diff": worst,
                   "paged_vs_fp64_max_err": ref_err,
                   "contiguous_gbps": kv / ms["contiguous"] / 1e6,
                   "paged_gbps": kv / ms["paged"] / 1e6,
                   "paged_over_contiguous": ms["contiguous"] / ms["paged"],
                   "ms_all": times})
            del q, kcs, vcs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
