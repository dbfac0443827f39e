"""Compile the splitkv kernels for sm_90 without a GPU (Triton's AOT path): every template branch
(pointer/descriptor x contiguous/paged x bf16/fp32 x scratch/direct output) and the combine
kernel, printing shared memory per config. Run with TRITON_INTERPRET unset:

    TRITON_INTERPRET=0 python bench/splitkv_compile_check.py

(flashtune kernels check does not know the splitkv family yet: the family registry will.)"""
import itertools, time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashtune.codegen import Variant, load
PTR = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
def compile(fn, consts, sigtypes, warps, stages):
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts: sig[n] = "constexpr"
        else:
            sig[n] = sigtypes.get(n, "i32")
            if sig[n].startswith("*") or n.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    return k.metadata.shared
for name, dt, paged, direct in itertools.product(
        ["splitkv-m64-n64-w4-s3", "splitkv-m64-n64-w4-s3-loads=descriptor", "splitkv-m16-n128-w8-s4", "splitkv-m64-n32-w2-s2"],
        ["bf16", "fp32"], [False, True], [False, True]):
    v = Variant.parse(name + ("-paged=true" if paged else ""))
    mod = load(v)
    t = time.time()
    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=min(v.block_m, 16), BLOCK_N=v.block_n, IS_CAUSAL=True, GROUP=4,
                  PAGE=64 if paged else 0, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", PRECISE=dt == "fp32")
    types = dict(Q=PTR[dt], K=PTR[dt], V=PTR[dt], BLOCK_TABLE="*i32", SEQLENS="*i32",
                 O=PTR[dt] if direct else "*fp32", LSE="*fp32", sm_scale="fp32")
    try:
        smem = compile(mod.attn_splitkv_partial, consts, types, v.num_warps, v.num_stages)
        print("ok ", v.name, dt, "direct" if direct else "scratch", "smem", smem, f"{time.time()-t:.1f}s", flush=True)
    except Exception as e:
        print("BAD", v.name, dt, type(e).__name__, str(e)[:400], flush=True)
for dt in ["bf16", "fp16", "fp32"]:
    mod = load(Variant.parse("splitkv-m64-n64-w4-s3"))
    smem = compile(mod.attn_splitkv_combine, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_R=16),
                   dict(O_PART="*fp32", LSE_PART="*fp32", O=PTR[dt], LSE="*fp32"), 4, 3)
    print("ok combine", dt, smem)
