"""A split-KV combine that keeps off the SMs the next layer's partial kernel loads on (issue 9,
session 44). splitkv_timeline's stamps (session 44, call 3) put the combine's work at MQA B=1 32k
at 1.15 us where the next layer's program on its SM had started 1.7-2.3 us before (its preload
landed) and at 1.92 us where it had started 0.2-0.6 us before: the combine's L2 reads wait
behind the TMA loads in flight on their own SM. Here the combine is a Gluon kernel of one program
per (sequence, head, token) row that holds PAD KiB of shared memory it does not need: more than a
ring-alone partial program leaves free (n128-s2: 144 KiB of 228), so no combine program shares
an SM with a partial program, and no partial program can start on an SM a combine program
holds: with the partial kernel's programs on sms - k SMs, the combine runs on the k SMs left.
The arithmetic is the shipped combine's (one load of every split's LSE and O row, the weights
from the LSE's max), so its output is the same. Measured (session 44, call 4): slower, its 8
programs on 4 SMs pull the partials through those SMs' ports (docs/benchmarks.md).

    from quiet_combine import install; install(plan, pad_kib=96)
    python3 bench/quiet_combine.py --compile    # the kernel for sm_90, no GPU
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402


@gluon.jit
def _quiet_combine(O_PART, LSE_PART, O, LSE, H, Nq, num_splits, stride_ob, stride_om,
                   stride_oh, HEAD_DIM: gl.constexpr, BLOCK_S: gl.constexpr,
                   CHUNK_D: gl.constexpr, PAD_A: gl.constexpr, PAD_B: gl.constexpr,
                   TRIGGER_FIRST: gl.constexpr, WARPS: gl.constexpr):
    # grid (rows, HEAD_DIM // CHUNK_D): a row's CHUNK_D slice a program (the shipped combine's)
    # the shared memory that keeps partial programs off this SM (and this program off theirs):
    # two buffers of PAD_A and PAD_B rows of 512 bytes (each a power of two)
    pad_lay: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pad = gl.allocate_shared_memory(gl.int32, [PAD_A, 128], pad_lay)
    pad_b = gl.allocate_shared_memory(gl.int32, [PAD_B, 128], pad_lay)
    if TRIGGER_FIRST:
        gdc_launch_dependents()
    gdc_wait()
    if not TRIGGER_FIRST:
        gdc_launch_dependents()
    row = gl.program_id(0).to(gl.int64)
    TPW_D: gl.constexpr = CHUNK_D // 4 if CHUNK_D < 128 else 32
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TPW_D, TPW_D], [WARPS, 1], [1, 0])
    offs_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, lay))
    offs_d = gl.program_id(1) * CHUNK_D + gl.arange(0, CHUNK_D, layout=gl.SliceLayout(0, lay))
    s_ok = offs_s < num_splits
    lse_s = gl.load(LSE_PART + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    o_s = gl.load(O_PART + (row * num_splits + gl.expand_dims(offs_s, 1)) * HEAD_DIM
                  + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(s_ok, 1), other=0.0)
    m = gl.max(lse_s, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w = gl.exp(lse_s - m_safe)  # an empty split (-inf) weighs 0
    denom = gl.sum(w, 0)
    seen = denom > 0.0
    d_safe = gl.where(seen, denom, 1.0)
    acc = gl.sum(gl.expand_dims(w, 1) * o_s, 0) / d_safe
    if gl.program_id(1) == 0:
        gl.store(LSE + row, gl.where(seen, m_safe + gl.log(d_safe), float("-inf")))
    tok = row % Nq
    head = (row // Nq) % H
    b = row // (Nq * H)
    gl.store(O + b * stride_ob + tok * stride_om + head * stride_oh + offs_d,
             acc.to(O.dtype.element_ty))
    zl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, WARPS], [1, 0])
    pad.slice(0, 1, dim=0).store(gl.zeros([1, 128], gl.int32, zl))
    pad_b.slice(0, 1, dim=0).store(gl.zeros([1, 128], gl.int32, zl))


def pad_rows(pad_kib: int) -> tuple:
    """pad_kib as two powers of two of 512-byte rows (PAD_A, PAD_B): 96 -> (128, 64)."""
    rows = pad_kib * 2
    a = 1 << (rows.bit_length() - 1)
    b = rows - a
    if b & (b - 1):
        raise ValueError(f"pad_kib {pad_kib}: not two powers of two of half KiB")
    return a, max(b, 1)


def install(plan, pad_kib: int, chunked: bool = False) -> None:
    """Launch `plan`'s combines (launch_splitkv.SplitKVPlan) as _quiet_combine holding pad_kib
    KiB of shared memory: one program of 8 warps a row (D=HEAD_DIM <= 128 columns at once), or
    (chunked) the shipped combine's grid of (row, CHUNK_D slice) programs of 4 warps."""
    from flashtune.launch_splitkv import combine_tile

    pa, pb = pad_rows(pad_kib)
    d = plan.shape[3]

    class Launch:
        def __init__(self, s, early, first):
            self.block_s, chunk = combine_tile(s, plan.kwargs["BLOCK_D"])
            self.chunk = chunk if chunked else d
            self.warps = 4 if chunked else 8
            self.first = bool(first) if early else False

        def __call__(self, grid, o_part, l_part, o, lse, h, nq, s, sob, som, soh):
            _quiet_combine[(grid[0], d // self.chunk)](
                o_part, l_part, o, lse, h, nq, s, sob, som, soh, HEAD_DIM=d,
                BLOCK_S=self.block_s, CHUNK_D=self.chunk, PAD_A=pa, PAD_B=pb,
                TRIGGER_FIRST=self.first, WARPS=self.warps, num_warps=self.warps,
                launch_pdl=plan.pdl)

    orig = plan._launcher

    def launcher(key):
        if key[0] != "combine":
            return orig(key)
        got = plan._launchers.get(("quiet",) + key)
        if got is None:
            got = plan._launchers[("quiet",) + key] = Launch(*key[1:])
        return got
    plan._launcher = launcher


def compile_only() -> None:
    from codegen.aot import compile_for
    for pad, chunk, block_s, warps in ((96, 128, 128, 8), (96, 16, 256, 4), (144, 16, 256, 4)):
        pa, pb = pad_rows(pad)
        out = compile_for(_quiet_combine, {"HEAD_DIM": 128, "BLOCK_S": block_s,
                                           "CHUNK_D": chunk, "PAD_A": pa, "PAD_B": pb,
                                           "TRIGGER_FIRST": True, "WARPS": warps},
                          "bfloat16", warps, 1, usage=True,
                          types={"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*bf16",
                                 "LSE": "*fp32", "H": "i32", "Nq": "i32", "num_splits": "i32",
                                 "stride_ob": "i32", "stride_om": "i32", "stride_oh": "i32"})
        print(f"pad {pad} KiB chunk {chunk}", "smem", out["smem"], "regs", out.get("regs"), "spill",
              out.get("spill_bytes"))


if __name__ == "__main__":
    if "--compile" in sys.argv:
        compile_only()
