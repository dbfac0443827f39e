"""attention_varlen on a batch of mixed lengths beside the dense path on the same work.

    python3 bench/varlen_bench.py --out varlen.jsonl            # H=16, D=128, bf16, ~16k tokens
    python3 bench/varlen_bench.py --quick --out varlen.jsonl    # ~4k tokens, smoke run

Inputs: self-attention sequence lengths drawn uniformly in [--min-len, --max-len] (seeded) until
they sum to ~--tokens (the last one clipped, never below --min-len), packed as (total, H, D).

Rows, each causal and not, for "fwd", "bwd" (autograd.grad on one saved graph) and "fwd+bwd":
  varlen        flashtune.attention_varlen on the packed batch.
  dense-equal   flashtune.attention on B equal-length sequences doing the same work without
                padding: N = round(sum(l^2) / sum(l)) (the FLOP-weighted mean length, so that
                B*N ~ total tokens and B*N^2 ~ sum(l^2)), B = round(total / N). Its throughput is
                what varlen should reach if per-sequence bookkeeping and short sequences' tails
                cost nothing.
  dense-padded  flashtune.attention on the batch padded to the longest sequence (what a caller
                without varlen pays); its TFLOP/s counts the useful FLOPs only (the varlen batch's).
  varlen[NAME]  (--force-bwd NAME, repeatable) the varlen rows with the backward forced to NAME
                (the forward as dispatched): e.g. the generic bwd beside the hopper_bwd the
                dispatcher picks, in the same run.
FLOPs (DESIGN.md): fwd = 4*H*D*sum(len_q*len_k), halved for causal; bwd = 2.5x fwd;
fwd+bwd = 3.5x. Times: triton.testing.do_bench medians (L2 flushed between runs). Compare the
rows of one run as ratios. Output: JSON lines to --out (and a table on stdout).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

import flashtune  # noqa: E402
from flashtune.bench.grid import draw_lengths as _draw  # noqa: E402
from flashtune.bench.runner import environment as _environment  # noqa: E402


def draw_lengths(tokens: int, lo: int, hi: int, seed: int) -> list[int]:
    return list(_draw(tokens, lo, hi, seed))


def environment() -> dict:
    return _environment("cuda")


def fwd_flops(h: int, d: int, lens_q, lens_k, causal: bool) -> float:
    f = 4.0 * h * d * sum(a * b for a, b in zip(lens_q, lens_k))
    return f / 2 if causal else f


PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def time_passes(fwd, inputs, gen, do_like_out: bool = False):
    """{pass: median ms} for fwd alone, bwd alone (one saved graph) and fwd+bwd; do_like_out: dO
    in the output's layout (as a model's gradient comes), else contiguous."""
    xs = [t.detach().requires_grad_() for t in inputs]
    out = fwd(*xs)
    do = (torch.empty_like(out).normal_(generator=gen) if do_like_out else
          torch.randn(out.shape, device=out.device, dtype=out.dtype, generator=gen))
    with torch.no_grad():
        ms_f = triton.testing.do_bench(lambda: fwd(*inputs), warmup=10, rep=50,
                                       return_mode="median")
    ms_b = triton.testing.do_bench(lambda: torch.autograd.grad(out, xs, do, retain_graph=True),
                                   warmup=10, rep=50, return_mode="median")
    ms_fb = triton.testing.do_bench(lambda: torch.autograd.grad(fwd(*xs), xs, do), warmup=10,
                                    rep=50, return_mode="median")
    return {"fwd": ms_f, "bwd": ms_b, "fwd+bwd": ms_fb}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="~4k tokens, lengths 128..1024")
    ap.add_argument("--no-padded", action="store_true", help="skip the dense-padded rows")
    ap.add_argument("--out", default=None, help="JSON lines file (default: stdout only)")
    ap.add_argument("--force-bwd", action="append", default=[], metavar="NAME",
                    help="also time the varlen rows with the backward forced to this variant")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.min_len, a.max_len = 4096, 128, 1024
    h, d, dtype, dev = a.heads, a.head_dim, torch.bfloat16, "cuda"
    lens = draw_lengths(a.tokens, a.min_len, a.max_len, a.seed)
    total = sum(lens)
    n_eq = max(1, round(sum(n * n for n in lens) / total))
    b_eq = max(1, round(total / n_eq))
    gen = torch.Generator(device=dev).manual_seed(a.seed)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    packed = [rand(total, h, d) for _ in range(3)]
    equal = [rand(b_eq, n_eq, h, d).transpose(1, 2) for _ in range(3)]  # (B, N, H, D) memory
    padded = [rand(len(lens), max(lens), h, d).transpose(1, 2) for _ in range(3)]

    out = open(a.out, "w") if a.out else None

    def emit(row):
        line = json.dumps(row)
        if out:
            out.write(line + "\n")
            out.flush()

    emit({"kind": "env", **environment(), "lengths": lens, "total_tokens": total, "H": h, "D": d,
          "dtype": "bfloat16", "dense_equal": {"B": b_eq, "N": n_eq},
          "dense_padded": {"B": len(lens), "N": max(lens)}})
    print(f"{len(lens)} sequences, {total} tokens, lengths {min(lens)}..{max(lens)}; "
          f"dense-equal B={b_eq} N={n_eq}; dense-padded B={len(lens)} N={max(lens)}")
    print(f"{'impl':<13} {'causal':<6} {'pass':<8} {'ms':>9} {'TFLOP/s':>8}")
    for causal in (False, True):
        useful = fwd_flops(h, d, lens, lens, causal)
        cases = [
            ("varlen", packed, useful, lambda q, k, v, c=causal: flashtune.attention_varlen(
                q, k, v, cu, cu, max(lens), max(lens), causal=c)),
            ("dense-equal", equal, fwd_flops(h, d, [n_eq] * b_eq, [n_eq] * b_eq, causal),
             lambda q, k, v, c=causal: flashtune.attention(q, k, v, causal=c)),
        ]
        if not a.no_padded:
            cases.append(("dense-padded", padded, useful,
                          lambda q, k, v, c=causal: flashtune.attention(q, k, v, causal=c)))
        for name in a.force_bwd:
            def forced(q, k, v, c=causal, name=name):
                with flashtune.force(name):  # carried to the backward by the op (call_forced)
                    return flashtune.attention_varlen(q, k, v, cu, cu, max(lens), max(lens),
                                                      causal=c)
            cases.append((f"varlen[{name}]", packed, useful, forced))
        if causal is False:
            # sanity: the first sequence through varlen equals it alone through the dense path
            first = flashtune.attention_varlen(*packed, cu, cu, max(lens), max(lens))[:lens[0]]
            alone = flashtune.attention(*(t[:lens[0]].transpose(0, 1)[None] for t in packed))
            err = (first.float() - alone[0].transpose(0, 1).float()).abs().max().item()
            emit({"kind": "check", "max_abs_diff_first_sequence": err})
            print(f"check: first sequence varlen vs dense max |diff| {err:.3g}")
        for impl, inputs, flops, fn in cases:
            for name, ms in time_passes(fn, inputs, gen).items():
                tf = flops * PASS_FACTOR[name] / (ms * 1e-3) / 1e12
                emit({"kind": "result", "impl": impl, "causal": causal, "pass": name, "ms": ms,
                      "tflops": tf, "flops": flops * PASS_FACTOR[name]})
                print(f"{impl:<13} {str(causal):<6} {name:<8} {ms:9.3f} {tf:8.1f}")
    if out:
        out.close()


if __name__ == "__main__":
    main()
