"""GQA on the H100 (session 28): the dispatcher gave every GQA call the generic kernels (the tables
tune heads that are not shared, so no family had a record of a GQA bucket, and the Hopper families'
heuristics said no); dispatch._comparable now lets each family's record of the call's shape
without GQA compete. This times, per cell, the forward, the backward and fwd+bwd of:

  flashtune            as dispatched now
  flashtune-before     as dispatched before (the old rule: records compete only for their own
                       bucket, GQA included), in the same run
  sdpa-cudnn, sdpa-flash, flex    the peers (enable_gqa; Flex compiled, enable_gqa=True)

on Llama-style GQA (16 query heads of D=128 and 4 kv heads, 4:1; --heads takes others),
causal, bf16, 16k tokens (B = 16384 / N), q in (B, N, H, D) memory and k, v contiguous -- how a
transformers model hands them after RoPE (--layout bhnd: all contiguous). TFLOP/s in the
FlashAttention convention (4 B H N^2 D, halved for causal; the backward 2.5x), medians of
triton's do_bench (L2 flushed).

    python3 bench/gqa_bench.py --out gqa.jsonl [--seqlens 1024,2048,4096,8192] [--heads 16/4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

import flashtune  # noqa: E402
from flashtune import dispatch, ops  # noqa: E402
from varlen_bench import time_passes  # noqa: E402


def _old_rule(ex, rex):  # session 27's: each record of the problem's own bucket, GQA included
    return dispatch._same_shape(ex) and dispatch._same_shape(rex)


def impls():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def peer(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=True, enable_gqa=True)
        return run
    out = {"flashtune": lambda q, k, v: flashtune.attention(q, k, v, causal=True),
           "flashtune-before": lambda q, k, v: flashtune.attention(q, k, v, causal=True),
           "sdpa-cudnn": peer(SDPBackend.CUDNN_ATTENTION),
           "sdpa-flash": peer(SDPBackend.FLASH_ATTENTION)}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
        masks = {}

        def run_flex(q, k, v):
            n = q.shape[2]
            if n not in masks:
                masks[n] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n)
            return flex(q, k, v, block_mask=masks[n], enable_gqa=True)
        out["flex"] = run_flex
    except Exception:  # noqa: BLE001 -- no Flex here: the row says so
        pass
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--seqlens", default="1024,2048,4096")
    ap.add_argument("--heads", default="16/4", help="Hq/Hk pairs, comma-separated")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layout", default="mixed", choices=["mixed", "bhnd"])
    a = ap.parse_args(argv)
    out = open(a.out, "w") if a.out else None
    env = {"kind": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "layout": a.layout}
    print(env)
    if out:
        out.write(json.dumps(env) + "\n")
    gen = torch.Generator(device="cuda").manual_seed(0)
    real_rule = dispatch._comparable
    print(f"{'Hq/Hk':>6} {'D':>4} {'N':>6} {'impl':<17} {'fwd':>7} {'bwd':>7} {'fwd+bwd':>8}  TFLOP/s")
    for heads in a.heads.split(","):
        hq, hk = (int(x) for x in heads.split("/"))
        for n in (int(x) for x in a.seqlens.split(",")):
            b, d = max(1, 16384 // n), a.dim

            def rand(*shape):
                return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            q = (rand(b, n, hq, d).transpose(1, 2) if a.layout == "mixed" else rand(b, hq, n, d))
            k, v = rand(b, hk, n, d), rand(b, hk, n, d)
            flops = 4 * b * hq * n * n * d / 2
            for name, fn in impls().items():
                dispatch._comparable = _old_rule if name == "flashtune-before" else real_rule
                dispatch.clear_cache()
                ops._plans.clear()
                ops._bwd_plans.clear()
                row = {"kind": "result", "Hq": hq, "Hk": hk, "D": d, "N": n, "B": b, "impl": name}
                try:
                    if name.startswith("flashtune"):
                        row["fwd_variant"] = flashtune.explain(q, k, v, causal=True).variant.name
                        row["bwd_variant"] = flashtune.explain(q, k, v, causal=True,
                                                               family="bwd").variant.name
                    # compiled and planned first: do_bench sizes its sample count from its
                    # first calls, and a compile among them left one sample (session 28, call 7)
                    xs = [t.detach().requires_grad_() for t in (q, k, v)]
                    o = fn(*xs)
                    torch.autograd.grad(o, xs, torch.randn_like(o))
                    torch.cuda.synchronize()
                    ms = time_passes(fn, (q, k, v), gen, do_like_out=True)
                    row.update({f"ms_{p}": t for p, t in ms.items()})
                    row.update({f"tflops_{p}": flops * mult / t / 1e9 for p, mult, t in (
                        ("fwd", 1, ms["fwd"]), ("bwd", 2.5, ms["bwd"]),
                        ("fwd+bwd", 3.5, ms["fwd+bwd"]))})
                    print(f"{heads:>6} {d:>4} {n:>6} {name:<17} {row['tflops_fwd']:7.0f} "
                          f"{row['tflops_bwd']:7.0f} {row['tflops_fwd+bwd']:8.0f}", flush=True)
                except Exception as e:  # noqa: BLE001 -- a failing peer is a row
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{heads:>6} {d:>4} {n:>6} {name:<17} {row['error'][:80]}", flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    dispatch._comparable = real_rule
    dispatch.clear_cache()


if __name__ == "__main__":
    main()
