"""Decoding with a block mask (issue 11, split-KV's block_sparse render): one query token per
sequence over Nk keys, random 128-key blocks kept per sequence (shared by the heads), against
compiled FlexAttention with the same mask and flashtune without one, same run. GB/s of the K and
V bytes the kept blocks hold; each step timed as a CUDA-graph replay where it can be captured
(flashtune.bench.timing.measure, the note says how).

    python3 bench/decode_mask_bench.py --out decode_mask.jsonl               # GPU
    TRITON_INTERPRET=1 python3 bench/decode_mask_bench.py --smoke --no-flex  # CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashtune  # noqa: E402
from flashtune.bench.timing import measure  # noqa: E402


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def flex_call(blocks, nq: int, nk: int, device: str):
    """Compiled flex_attention with the block matrix `blocks` (B, 1, 1, NKB) as its mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    b = blocks.shape[0]
    kept = blocks[:, 0, 0].to(device)

    def mask_mod(bb, hh, qi, ki):
        return kept[bb, ki // 128]
    fbm = create_block_mask(mask_mod, b, 1, nq, nk, device=device, BLOCK_SIZE=128)
    flex = torch.compile(flex_attention)
    return lambda q, k, v: flex(q, k, v, block_mask=fbm, enable_gqa=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=_ints, default=[1, 8])
    ap.add_argument("--seqlens", type=_ints, default=[8192, 32768, 131072])
    ap.add_argument("--densities", type=_ints, default=[10, 50, 100], help="percent of blocks")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, float16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16 if cuda else torch.float16
    hq, hk = (int(x) for x in args.heads.split("/"))
    if args.smoke:
        args.batches, args.seqlens, args.densities, args.dim = [2], [1024], [30], 64
    out = open(args.out, "w") if args.out else None
    print(f"{'B':>3} {'Nk':>7} {'dens':>5} {'impl':<18} {'ms':>8} {'GB/s':>7}  note")
    for b in args.batches:
        for nk in args.seqlens:
            g = torch.Generator().manual_seed(nk + b)
            q = torch.randn(b, hq, 1, args.dim, generator=g).to(dev, dt)
            k, v = (torch.randn(b, hk, nk, args.dim, generator=g).to(dev, dt) for _ in range(2))
            nkb = -(-nk // 128)
            for pct in args.densities:
                blocks = torch.rand(b, 1, 1, nkb, generator=g) < pct / 100
                blocks[..., -1] = True  # the newest keys: a decode step always sees some
                kept = float(blocks.sum()) / blocks.numel()
                bm = flashtune.BlockMask.from_dense(blocks.to(dev), (1, nk), block_size=128)
                impls = {"flashtune": lambda bm=bm: flashtune.attention(q, k, v, block_mask=bm),
                         "flashtune no mask": lambda: flashtune.attention(q, k, v)}
                if not args.no_flex and cuda:
                    try:
                        f = flex_call(blocks, 1, nk, dev)
                        impls["flex"] = lambda f=f: f(q, k, v)
                    except Exception as e:  # noqa: BLE001 -- a peer that cannot run is a row
                        print(f"flex unavailable: {type(e).__name__}: {e}")
                for name, fn in impls.items():
                    row = {"B": b, "Hq": hq, "Hk": hk, "D": args.dim, "Nk": nk,
                           "density": pct, "kept": kept, "impl": name}
                    try:
                        if name == "flashtune":
                            row["variant"] = flashtune.explain(q, k, v, block_mask=bm).variant.name
                        ms, note = measure(fn, dev, graph=cuda)
                        share = 1.0 if name == "flashtune no mask" else kept
                        nbytes = 2 * b * hk * nk * args.dim * q.element_size() * share
                        row.update(ms=ms, gbps=nbytes / ms / 1e6, note=note)
                        print(f"{b:3} {nk:7} {pct:4}% {name:<18} {ms:8.4f} {row['gbps']:7.0f}  "
                              f"{note} {row.get('variant', '')}")
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        print(f"{b:3} {nk:7} {pct:4}% {name:<18} failed: {row['error']}")
                    if out:
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
