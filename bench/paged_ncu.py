"""Where a paged decode step loses to the contiguous one (issue 9: B=1, 2k keys, paged at
0.95x contiguous): one launch of each splitkv kernel under Nsight Compute, contiguous and paged
(256-key pages, shuffled table), GQA 32/8 and MQA 8/1, D=128, bf16, --batch sequences (1), the
dispatched variant as bench/decode_probe.py runs it. Every plan runs a few times first; only the
profiled calls lie between cudaProfilerStart and cudaProfilerStop (so `ncu --profile-from-start
off` sees one launch of each kernel of each case). Through device_run.sh:

    STEPS=srcprof SRCPROF_SCRIPT=bench/paged_ncu.py SRCPROF_KERNEL=splitkv SRCPROF_ARGS= \\
        bash bench/device_run.sh

The kernels are told apart by their order in the report: per case (GQA, then MQA) the
contiguous plan's partial and combine kernels, then the paged plan's (printed below too).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashtune import kvcache  # noqa: E402
from flashtune.launch_splitkv import SplitKVPlan  # noqa: E402

D, NK, PAGE = 128, 2048, 256


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    b = ap.parse_args().batch
    runs = []
    for hq, hk in ((32, 8), (8, 1)):
        q = torch.randn(b, 1, hq, D, dtype=torch.bfloat16, device="cuda")
        kc = torch.randn(b, NK, hk, D, dtype=torch.bfloat16, device="cuda")
        vc = torch.randn_like(kc)
        sl = torch.full((b,), NK, dtype=torch.int32, device="cuda")
        per = NK // PAGE
        bt = torch.stack([i * per + torch.randperm(per) for i in range(b)]).to(
            device="cuda", dtype=torch.int32)
        contiguous = kvcache._variant(q, kc, vc, False, False, NK)
        paged = kvcache.fit_pages(contiguous, PAGE)
        kp, vp = kc.view(-1, PAGE, hk, D), vc.view(-1, PAGE, hk, D)
        for label, v, k, vv, table in (("contiguous", contiguous, kc, vc, None),
                                       ("paged", paged, kp, vp, bt)):
            plan = SplitKVPlan(q, k, False, None, v)
            runs.append((f"{hq}/{hk} {label} {v.name} splits={plan.num_splits(NK)}",
                         lambda plan=plan, k=k, vv=vv, table=table:
                         plan.run(q, k, vv, sl, table, NK)))
    for _, fn in runs:
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in runs:
        print("profiled:", label, flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
