"""Calibration data of the splitkv feasibility model: attn_splitkv_partial compiled for sm_90 without a
GPU over tiles, stages and loads; writes JSON lines (docs/data/splitkv_compile_sm90_*.jsonl)."""
import json, itertools, sys, os
os.environ["TRITON_INTERPRET"]="0"
from flashtune.codegen import Variant
from flashtune.families import splitkv
out=open(sys.argv[1] if len(sys.argv) > 1 else 'splitkv_compile_sm90.jsonl', 'w')
for d, tails in ((128, False), (64, False), (128, True)):
    for bn, st, loads, bm in itertools.product([16,32,64,128,256],[1,2,3,4,5],["pointer","descriptor"],[16,64]):
        if bn*d > 128*128*2: continue
        v=Variant("splitkv", block_m=bm, block_n=bn, num_warps=4, num_stages=st, loads=loads)
        try:
            r=splitkv.compile_check(v, d, "bfloat16", False, tails, 90, True)
            p=r["partial"]
            out.write(json.dumps({"d":d,"tails":tails,"bn":bn,"st":st,"loads":loads,"bm":bm,**{k:p[k] for k in p if k in ("smem","regs","spills")}})+"\n")
        except Exception as e:
            out.write(json.dumps({"d":d,"tails":tails,"bn":bn,"st":st,"loads":loads,"bm":bm,"error":str(e)[:200]})+"\n")
        out.flush()
