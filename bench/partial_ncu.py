"""One eager launch each of the MQA B=1 decode step's partial kernel (the dispatched variant, PDL
off) and of the plain streaming read of the same caches (flashtune/bench/read_ceiling.py, 4
programs per SM), for Nsight Compute: where the partial kernel reads slower than a plain read
(session 35: 1,663 against 2,006 GB/s at 32k keys, both chained 16 layers in a graph).

    ncu --clock-control none -k regex:"partial|_stream_read" --profile-from-start off ... \
        python3 bench/partial_ncu.py --nk 32768
    STEPS=srcprof SRCPROF_SCRIPT=bench/partial_ncu.py SRCPROF_KERNEL="attn_splitkv_partial" \
        SRCPROF_ARGS="--nk 32768" bash bench/device_run.sh   # stalls per SASS instruction
"""
from __future__ import annotations

import argparse

import torch

from flashtune import kvcache
from overlap_ceiling import reader
from flashtune.launch_splitkv import SplitKVPlan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nk", type=int, default=32768)
    ap.add_argument("--variant", default=None, help="splitkv variant (default: dispatched)")
    ap.add_argument("--reader", default="4:8/2048/3",
                    help="the plain read's programs per SM:warps/elements a step/stages")
    a = ap.parse_args()
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, a.nk, 1, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sl = torch.full((1,), a.nk, dtype=torch.int32, device="cuda")
    from flashtune.codegen import Variant
    var = (Variant.parse(a.variant) if a.variant
           else kvcache._variant(q, k, v, False, False, a.nk))
    plan = SplitKVPlan(q, k, False, None, var)
    plan.pdl = False
    plan.kwargs["USE_PDL"] = False
    per_sm, shape = a.reader.split(":")
    read = reader(k, v, int(per_sm) * torch.cuda.get_device_properties(0).multi_processor_count,
                  "plain", False, tuple(int(x) for x in shape.split("/")))
    for _ in range(3):  # compiled and warm
        plan.run(q, k, v, sl, None, a.nk)
        read()
    torch.cuda.synchronize()
    # the fourth launch of each alone lies between cudaProfilerStart and Stop: with ncu
    # --profile-from-start off (device_run.sh srcprof) it is the one profiled; without, ncu
    # --launch-skip 3 --launch-count 2 picks the same two
    torch.cuda.cudart().cudaProfilerStart()
    plan.run(q, k, v, sl, None, a.nk)
    read()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(var.name, plan.num_splits(a.nk), "splits")


if __name__ == "__main__":
    main()
