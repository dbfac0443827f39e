#!/usr/bin/env bash
# One device call: install what the GPU machine lacks, then run the steps named in $STEPS.
#   STEPS="fwdtests fwdbench" bash bench/device_run.sh
# Everything it prints and writes lands under $OUT (fetched back by the device tool).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export FLASHTUNE_CACHE_DIR=/tmp/flashtune-cache
# the image's site-packages hold no bytecode for some packages (sympy, which every search worker
# imports) and are not ours to write: Python compiled their sources in every process, every call
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
# the tuned records a step dispatches from: "shipped" (the tables alone) or a tuned DB's URL
use_db() { if [ "$1" = shipped ]; then unset FLASHTUNE_DB; else export FLASHTUNE_DB=$1; fi; }
for step in ${STEPS:-fwdtests}; do
  echo "=== $step $(date +%T)"
  case $step in
    fwdtests) timeout 240 python3 -m pytest -q -x tests/test_forward.py tests/test_forward_gpu.py \
                tests/test_api_errors.py tests/test_codegen.py 2>&1 | tee "$OUT/fwdtests.log" | tail -25 ;;
    fwdbench) timeout ${FWDBENCH_TIMEOUT:-420} python3 bench/fwd_bench.py ${FWDBENCH_ARGS:---sweep} 2>&1 | tee "$OUT/fwdbench.log" | tail -45 ;;
    masktests) timeout ${MASKTESTS_TIMEOUT:-300} python3 -m pytest -q -x tests/test_masks.py 2>&1 | tee "$OUT/masktests.log" | tail -15 ;;
    masks)    # issue 11: window sweep 128..N and density sweep 5..100 % at N=16k (D=128, bf16) beside
              # Flex (compiled, same mask) and SDPA (explicit mask); dense rows for before/after
              timeout ${MASKS_TIMEOUT:-540} python3 bench/mask_bench.py ${MASKS_ARGS:-} 2>&1 \
                | tee "$OUT/masks.log" | tail -60 ;;
    gputests) # GPUTESTS_K: a pytest -k expression (quoted as one argument)
              # -v -rfE into the log: a step cut by its timeout still names every test that ran
              # (session 33: -q left a row of dots and no summary)
              timeout ${GPUTESTS_TIMEOUT:-300} python3 -m pytest -v -rfE -m gpu ${GPUTESTS_ARGS:-tests} \
                ${GPUTESTS_K:+-k "$GPUTESTS_K"} 2>&1 | tee -a "$OUT/gputests.log" \
                | grep -v " PASSED \| SKIPPED " | tail -30
              echo "gputests: $(grep -c ' PASSED ' "$OUT/gputests.log") passed, $(grep -c ' FAILED ' \
                "$OUT/gputests.log") failed lines in the log" ;;
    dispatch) timeout 120 python3 bench/dispatch_overhead.py 2>&1 | tee "$OUT/dispatch.log" | tail -22 ;;
    sweep)    timeout 290 python3 bench/sweep.py --budget 240 2>&1 | tee "$OUT/sweep.log" | tail -8 ;;
    faults)   timeout 180 python3 bench/faults.py 2>&1 | tee "$OUT/faults.log" | tail -14 ;;
    search)   /usr/bin/time -f "search wall %e s" timeout 240 flashtune search --gpu auto --head-dim 64,128 \
                --seqlen 1024,4096 --causal both --trials 20 --time-budget 150 \
                --storage sqlite:////tmp/ft-optuna.db --db sqlite:////tmp/ft-tuned.db --progress lines 2>&1 \
                | tee "$OUT/search.log" | tail -16
              flashtune db export --gpu "$(python3 -c "import torch;print(torch.cuda.get_device_name())")" --db sqlite:////tmp/ft-tuned.db -o "$OUT/tuned_table.json" 2>&1 | tail -2 ;;
    bwdtests) timeout 300 python3 -m pytest -q -m gpu tests/test_backward.py tests/test_compile.py 2>&1 \
                | tee "$OUT/bwdtests.log" | tail -25 ;;
    bwdbench) timeout ${BWDBENCH_TIMEOUT:-270} python3 bench/bwd_bench.py ${BWDBENCH_ARGS:-} 2>&1 | tee "$OUT/bwdbench.log" | tail -50 ;;
    bwdfp32) timeout 200 python3 -m pytest -q tests/test_backward.py -k "float32" 2>&1 | tail -6 ;;
    table)    # the shipped table: the standard grid, then head dims the defaults were not measured on
              for args in "--head-dim 64,128" "--head-dim 256 --seqlen 1024,4096"; do
                /usr/bin/time -f "search wall %e s" timeout 260 flashtune search --gpu auto $args \
                  --trials ${TRIALS:-24} --time-budget 240 --storage sqlite:////tmp/ft-optuna.db \
                  --db sqlite:////tmp/ft-tuned.db --progress lines 2>&1 | tee -a "$OUT/table_search.log" \
                  | grep -v "measured so far" | tail -30
              done
              flashtune db export --gpu "$(python3 -c "import torch;print(torch.cuda.get_device_name())")" \
                --db sqlite:////tmp/ft-tuned.db -o "$OUT/table.json" 2>&1 | tail -2 ;;
    tunedbench) FLASHTUNE_DB=sqlite:////tmp/ft-tuned.db timeout 300 python3 bench/fwd_bench.py 2>&1 \
                | tee "$OUT/tunedbench.log" | tail -30 ;;
    bwdtable) /usr/bin/time -f "bwd search wall %e s" timeout 330 flashtune search --gpu auto --family bwd \
                --head-dim 64,128 --seqlen 1024,4096 --trials ${BWD_TRIALS:-16} --time-budget 300 \
                --storage sqlite:////tmp/ft-bwd-optuna.db --db sqlite:////tmp/ft-bwd-tuned.db \
                --progress lines 2>&1 | tee "$OUT/bwd_search.log" | grep -v "measured so far" | tail -16
              flashtune db export --gpu "$(python3 -c "import torch;print(torch.cuda.get_device_name())")" \
                --db sqlite:////tmp/ft-bwd-tuned.db -o "$OUT/bwd_table.json" 2>&1 | tail -2 ;;
    gpusearchtests) timeout 240 python3 -m pytest -q -m gpu tests/test_search_bwd.py tests/test_search_gpu.py \
                2>&1 | tail -5 ;;
    workers)  nvidia-smi -L
              for w in 1 2; do
                /usr/bin/time -f "workers=$w wall %e s" timeout 280 flashtune search --gpu auto --workers $w \
                  --fresh --head-dim 64,128 --seqlen 1024,4096 --causal both --trials ${TRIALS:-32} \
                  --seed 0 --storage sqlite:////tmp/ft-w$w.db --db sqlite:////tmp/tuned-w$w.db \
                  --progress lines 2>&1 | tee "$OUT/workers$w.log" | grep -v "^\[" | tail -14
              done ;;
    bwdall)   timeout 330 python3 -m pytest -q tests/test_backward.py tests/test_compile.py 2>&1 \
                | tee "$OUT/bwdall.log" | tail -6 ;;
    quicksearch) /usr/bin/time -f "search wall %e s" timeout 120 flashtune search --gpu auto --fresh \
                --head-dim 128 --seqlen 4096 --causal both --trials 16 --storage sqlite:////tmp/q.db \
                --db sqlite:////tmp/qt.db --progress lines 2>&1 | grep -v "^\[" | tail -6 ;;
    searchgpu) timeout 200 python3 -m pytest -q tests/test_search_gpu.py 2>&1 | tail -5 ;;
    newtests) timeout ${NEWTESTS_TIMEOUT:-360} python3 -m pytest -q --maxfail=8 tests/test_splitkv.py tests/test_varlen.py \
                tests/test_bf16_cpu.py tests/test_return_lse.py tests/test_force.py tests/test_forward_gpu.py \
                2>&1 | tee "$OUT/newtests.log" | tail -25 ;;
    decode)   # DECODE_NAME: decode_NAME.jsonl/.log, so two runs of one call do not collide
              n=decode${DECODE_NAME:+_$DECODE_NAME}
              timeout ${DECODE_TIMEOUT:-420} python3 bench/decode_bench.py --out "$OUT/$n.jsonl" ${DECODE_ARGS:-} \
                2>&1 | tee "$OUT/$n.log" | tail -${DECODE_TAIL:-60} ;;
    decodelaunch) # eager decode steps (no CUDA graph: what a caller without graphs pays) at batch 1, Triton's
              # launches against launcher.Launcher's direct ones, one process each
              for mode in 1 0; do
                echo "--- FLASHTUNE_SLOW_LAUNCH=$mode"
                FLASHTUNE_SLOW_LAUNCH=$mode timeout 150 python3 bench/decode_bench.py --batches 1 \
                  --seqlens 2048,32768 --no-dense --pages 256 --out "$OUT/decode_launch$mode.jsonl" 2>&1 | tail -12
              done ;;
    varlen)   timeout ${VARLEN_TIMEOUT:-240} python3 bench/varlen_bench.py --out "$OUT/varlen.jsonl" ${VARLEN_ARGS:-} \
                2>&1 | tee "$OUT/varlen.log" | tail -30 ;;
    hf)       [ -n "${HF_NO_TESTS:-}" ] || timeout ${HF_TIMEOUT:-240} python3 -m pytest -q \
                tests/test_transformers_backend.py 2>&1 | tail -5
              timeout 240 python3 bench/transformers_bench.py --out "$OUT/transformers.json" ${HF_ARGS:-} 2>&1 \
                | tee "$OUT/transformers.log" | tail -20 ;;
    scaling)  # the same search with --gpus 0, then 0,1 (SCALING_GPUS="0 0,1 0,1,2,3" on 4 GPUs): wall,
              # trials/s, winners compared; --warm fills Triton's cache first (SCALING_ARGS=--cold: none)
              nvidia-smi -L; nvidia-smi topo -m
              # each GPU's SM clock, power and temperature every second of the runs: whether a GPU
              # that times its trials slower than the others is clocked lower (session 20: two of four)
              nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,utilization.gpu \
                --format=csv,noheader -l 1 > "$OUT/scaling-smi.csv" 2>/dev/null & smi=$!
              # FLASHTUNE_TIMELINE: each process's milestones (start-up, first trial, wind-down) in its log
              FLASHTUNE_TIMELINE=${FLASHTUNE_TIMELINE:-1} \
              timeout ${SCALING_TIMEOUT:-590} python3 bench/search_scaling.py --gpus ${SCALING_GPUS:-0 0,1} \
                ${SCALING_ARGS:---warm} --out "$OUT/scaling.json" 2>&1 | tee "$OUT/scaling.log" | tail -24
              kill $smi 2>/dev/null
              # the device tool brings back 8 files: the runs' journals travel as one archive
              (cd "$OUT" && ls *.journal >/dev/null 2>&1 && tar czf scaling-journals.tgz *.journal && rm -f *.journal) ;;
    startprobe) # issue 12: where a search's start-up goes on this machine -- the CLI's imports, torch's
              # alone, then a small --gpus search twice (the second with warm caches) with its timeline
              python3 -X importtime -c "import flashtune.cli" 2> /tmp/imp.txt
              sort -t'|' -k2 -n /tmp/imp.txt | tail -${STARTPROBE_TAIL:-10} | tee "$OUT/startprobe.log"
              /usr/bin/time -f "import torch %e s" python3 -c "import torch" 2>&1 | tee -a "$OUT/startprobe.log"
              for i in 1 2; do
                /usr/bin/time -f "search wall %e s" env FLASHTUNE_TIMELINE=1 timeout 120 flashtune search \
                  --gpu auto --gpus ${STARTPROBE_GPUS:-0} --fresh --head-dim 64 --seqlen 1024 --causal false \
                  --trials 6 --storage /tmp/sp.journal --db sqlite:////tmp/sp.db --progress none 2>&1 \
                  | grep "timeline\|wall" | tee -a "$OUT/startprobe.log"
              done ;;
    firstcompile) # issue 12: where a compile worker's first compile goes (fresh processes, cold then
              # warm caches; the warm one profiled)
              timeout ${FIRSTCOMPILE_TIMEOUT:-120} python3 bench/first_compile_probe.py 2>&1 \
                | tee "$OUT/first_compile.log" | tail -${FIRSTCOMPILE_TAIL:-70} ;;
    detect)   # the target as NVML names it (no CUDA start) against the one torch reads off the device
              python3 -c "
import time, torch; t0 = time.perf_counter()
from flashtune import nvml, targets
print('nvml driver', nvml.driver_version(), 'names', nvml.gpu_names())
t = targets.detect(); print('detect', t.slug if t else None, f'{time.perf_counter() - t0:.3f} s',
      'cuda initialized:', torch.cuda.is_initialized())
print('torch', torch.cuda.get_device_name(0), targets.detect(0).slug)" 2>&1 | tee "$OUT/detect.log" ;;
    cudainit) # where a multi-GPU search's start-up goes: each GPU's CUDA start alone, at once, beside
              # busy processes, one after another (bench/cuda_init_probe.py)
              timeout 200 python3 bench/cuda_init_probe.py --gpus $(nvidia-smi -L | wc -l) \
                --out "$OUT/cuda_init.json" 2>&1 | tee "$OUT/cuda_init.log" | tail -30 ;;
    proposalcost) # one driver per storage, then two drivers on one journal (a bucket each; one bucket),
              # flashtune's journal file beside Optuna's own
              timeout 200 python3 bench/proposal_cost.py --trials ${PC_TRIALS:-120} --storages \
                memory,sqlite,journal,journal-optuna --json "$OUT/proposal_cost.json" 2>&1 \
                | tee "$OUT/proposal_cost.log" | tail -4
              for sh in "" --shared; do
                timeout 200 python3 bench/proposal_cost.py --trials ${PC_TRIALS:-120} --procs 2 $sh \
                  --storages journal,journal-optuna --json "$OUT/proposal_cost2$sh.json" 2>&1 \
                  | tee -a "$OUT/proposal_cost.log" | grep drivers
              done ;;
    tables)   # every family on its grid, resumable over calls: the Optuna journal and the tuned DB live
              # in $TABLES_STATE (default tables_state/); they come back as one file, $OUT/tables_state.tgz
              # (a call returns at most 8 files) -- `tar -xzf tables_state.tgz -C tables_state && gzip -f
              # tables_state/*.journal` here, then carry=["tables_state"] to the next call, which resumes
              st=$(realpath -m "${TABLES_STATE:-tables_state}"); mkdir -p "$st" "$OUT/tables"
              name=$(python3 -c "import torch;print(torch.cuda.get_device_name())")
              slug=$(python3 -c "from flashtune import targets;print(targets.slug_of('$name'))")
              gpus=${TABLES_GPUS:-$(python3 -c "import torch;print(','.join(map(str,range(torch.cuda.device_count()))))")}
              [ -f "$st/$slug.journal.gz" ] && gunzip -f "$st/$slug.journal.gz"
              t0=$(date +%s)
              timeout ${TABLES_TIMEOUT:-570} flashtune search --gpu auto --gpus "$gpus" --trials ${TRIALS:-40} \
                --time-budget ${TABLES_BUDGET:-480} --in-order --storage "$st/$slug.journal" \
                --db "sqlite:///$st/$slug.db" --progress lines ${TABLES_ARGS:-} 2>&1 | tee -a "$OUT/tables_search.log" \
                | grep -v "measured so far\|^\[all\]" | tail -30
              echo "$(date -u +%FT%TZ) $name --gpus $gpus: $(( $(date +%s) - t0 )) s" >> "$st/$slug.calls"
              flashtune search --gpu auto --status --trials ${TRIALS:-40} --storage "$st/$slug.journal" ${TABLES_ARGS:-} \
                > "$OUT/tables_status.txt"; tail -2 "$OUT/tables_status.txt"
              flashtune db export --gpu "$name" --db "sqlite:///$st/$slug.db" -o "$OUT/tables/$slug.json" 2>&1 | tail -2
              # TABLES_INSTALL=1: later steps of this call (bench, tuningvalue) dispatch through it
              [ -n "${TABLES_INSTALL:-}" ] && cp "$OUT/tables/$slug.json" tuned_db/tables/
              tar -C "$st" -czf "$OUT/tables_state.tgz" "$slug.journal" "$slug.db" "$slug.calls"
              echo "calls so far:"; cat "$st/$slug.calls" ;;
    timeragree) # issue 12: the bench's timer vs tuning_value's interleaved re-timing on the hopper_fwd
              # records tuning_value read below their default (bench/timer_agreement.py): the shipped
              # record, the family default, the re-search's winner and the generic default, per bucket
              timeout 120 python3 bench/timer_agreement.py --d 128 --n 1024 --causal 0 \
                hopper_fwd-m64-n128-w4-s3-causal_split=false-pingpong=true-persistent=true-lr40 \
                hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24 \
                hopper_fwd-m64-n128-w4-s3-pingpong=true-persistent=true-lr32 fwd-m64-n64-w4-s3 2>&1 | tail -32
              timeout 120 python3 bench/timer_agreement.py --d 128 --n 512 --causal 1 \
                hopper_fwd-m64-n64-w4-s4-causal_split=false-pingpong=true-lr24 \
                hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24 fwd-m64-n64-w4-s3 2>&1 | tail -26 ;;
    timerprobe) # issues 10/12 (session 20): the search timed a few small-tile pointer-load variants 5-8%
              # faster than the bench did through the API, the defaults alike in both: each path
              # timed in turn (bench/timer_agreement.py), with the SM clock after each pass
              # (TIMERPROBE_NS: the bwd cells' N; TIMERPROBE_FWD=0 leaves out the fwd probe)
              for n in ${TIMERPROBE_NS:-4096 16384}; do
                timeout 150 python3 bench/timer_agreement.py --mode bwd --d 128 --n $n --causal 0 \
                  bwd-m64-n64-w4-s2-dq=fused-mq64-nq64 \
                  bwd-m64-n128-w8-s3-loads=descriptor-dq=fused-mq128-nq64 2>&1 | tee -a "$OUT/timerprobe.log" | tail -40
              done
              [ "${TIMERPROBE_FWD:-1}" = 1 ] && timeout 120 python3 bench/timer_agreement.py --mode fwd --d 64 \
                --n 8192 --causal 1 fwd-m64-n64-w4-s3 hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24 2>&1 \
                | tee -a "$OUT/timerprobe.log" | tail -40 ;;
    masksearch) # issue 11: tune the bench's masked buckets (D=128, N=4k/16k: the causal 256-key window, the
              # non-causal block mask of density ~1/4) for every family into /tmp/ms.db (a fresh tuned DB);
              # FLASHTUNE_DB=sqlite:////tmp/ms.db makes a later bench step of this call dispatch through them;
              # the records come back in $OUT/tables/masked.json (merged into the shipped table by hand)
              name=$(python3 -c "import torch;print(torch.cuda.get_device_name())")
              # MASKSEARCH_SPECS: "mask causal" pairs, ';'-separated; MASKSEARCH_SEQLENS: the bucket lengths;
              # MASKSEARCH_BATCH: batch sizes (default: the standard grid's B*N = 16k; the mask bench
              # runs B=1, H=16, two octaves of B*H from those buckets)
              IFS=';' read -ra specs <<< "${MASKSEARCH_SPECS:-window=256 true;density=0.25 false}"
              for spec in "${specs[@]}"; do
                set -- $spec
                timeout ${MASKSEARCH_TIMEOUT:-200} flashtune search --gpu auto --family ${MASKSEARCH_FAMILIES:-fwd,bwd,hopper_fwd,hopper_bwd} \
                  --head-dim 128 --seqlen ${MASKSEARCH_SEQLENS:-4096,16384} ${MASKSEARCH_BATCH:+--batch $MASKSEARCH_BATCH} \
                  --mask "$1" --causal "$2" --trials ${TRIALS:-40} \
                  --time-budget ${MASKSEARCH_BUDGET:-170} --in-order --storage /tmp/ms.journal --db sqlite:////tmp/ms.db \
                  --progress lines 2>&1 | tee -a "$OUT/masksearch.log" | grep -v "measured so far\|^\[all\]" | tail -12
              done
              mkdir -p "$OUT/tables"
              # why trials failed (session 16: 9 of hopper_fwd's 30 at the 10% mask, unexplained)
              python3 bench/trial_phases.py --failed /tmp/ms.journal 2>&1 | tee "$OUT/masksearch_failed.log" | tail -12
              flashtune db export --gpu "$name" --db sqlite:////tmp/ms.db -o "$OUT/tables/masked.json" 2>&1 | tail -1 ;;
    hoppersearch) # issue 12: the Gluon families' compile-ahead (JIT warm-up on meta tensors): a short
              # fresh search of one hopper_fwd and one hopper_bwd bucket, then each trial's stage,
              # first call in the timing worker (~0.02 s when the binary came from the compile
              # pool, 1-4 s when it was compiled again there) and notes; then the shipped-table test
              for fam in hopper_fwd hopper_bwd; do
                timeout 150 flashtune search --gpu auto --family $fam --head-dim 128 --seqlen 2048 \
                  --causal false --trials ${HS_TRIALS:-12} --fresh --storage /tmp/hs-$fam.journal \
                  --db sqlite:////tmp/hs.db --progress lines 2>&1 | grep -v "measured so far" | tail -3
                python3 bench/trial_phases.py /tmp/hs-$fam.journal | tee -a "$OUT/hoppersearch.log" | tail -16
              done
              timeout 120 python3 -m pytest -q -m gpu tests/test_tables_gpu.py 2>&1 | tail -4 ;;
    splitkvtests) timeout ${SPLITKV_TIMEOUT:-200} python3 -m pytest -v -rfE -x ${SPLITKV_ARGS:-tests/test_splitkv.py} \
                2>&1 | tee "$OUT/splitkvtests.log" | grep -v " PASSED \| SKIPPED " | tail -20 ;;
    warpsplit) # issue 9 (session 35's lead): the warp-split partial prototype beside the shipped plan at
              # MQA B=1 (bench/warp_split_probe.py; WS_ARGS e.g. "--cells 32768 --configs 4/16/3")
              timeout ${WS_TIMEOUT:-300} python3 bench/warp_split_probe.py --out "$OUT/warp_split.jsonl" \
                ${WS_ARGS:-} 2>&1 | tee "$OUT/warp_split.log" | grep -v max_diff | tail -40 ;;
    overlap)  # issue 9 (session 36): the 16-layer read ceiling with each layer's read overlapping the
              # last (PDL: wait / l2 / early orders) beside flashtune (bench/overlap_ceiling.py)
              timeout ${OVERLAP_TIMEOUT:-300} python3 bench/overlap_ceiling.py --out "$OUT/overlap.jsonl" \
                ${OVERLAP_ARGS:-} 2>&1 | tee "$OUT/overlap.log" | tail -40 ;;
    partialncu) # issue 9: the MQA B=1 partial kernel beside a plain read of its bytes under Nsight
              # Compute, one eager launch each (bench/partial_ncu.py); PNCU_ARGS: its arguments
              # (--nk, --variant, --reader), several runs separated by "|"
              IFS='|' read -ra pncu_runs <<< "${PNCU_ARGS:- }"
              for i in "${!pncu_runs[@]}"; do
                timeout ${PNCU_TIMEOUT:-150} ncu --clock-control none --profile-from-start off \
                  -k "regex:partial|_pdl_read" --section SpeedOfLight --section Occupancy \
                  --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
                  --section SchedulerStats python3 bench/partial_ncu.py ${pncu_runs[$i]} \
                  > "$OUT/partial_ncu_$i.txt" 2>&1
                echo "-- ${pncu_runs[$i]}"
                grep -E "^  [a-z_]|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Registers Per|Block Limit (Reg|Shared)|splits" \
                  "$OUT/partial_ncu_$i.txt" | head -30
              done ;;
    tmaread)  # issue 9 (session 36): a Gluon TMA-ring reader at one program per SM beside the Triton
              # reads, MQA B=1 16-layer steps (bench/tma_read_probe.py; TMAREAD_ARGS)
              timeout ${TMAREAD_TIMEOUT:-300} python3 bench/tma_read_probe.py --out "$OUT/tma_read.jsonl" \
                ${TMAREAD_ARGS:-} 2>&1 | tee "$OUT/tma_read.log" | grep -v "leaked\|nanobind" | tail -40 ;;
    gluondecode) # issue 9 (session 36): a Gluon TMA/wgmma split-KV partial kernel beside the shipped
              # plan at MQA B=1, 16-layer steps (bench/gluon_decode_probe.py; GD_ARGS)
              timeout ${GD_TIMEOUT:-300} python3 bench/gluon_decode_probe.py --out "$OUT/gluon_decode.jsonl" \
                ${GD_ARGS:-} 2>&1 | tee "$OUT/gluon_decode.log" | grep -v "leaked\|nanobind" | tail -40 ;;
    gluonkv)  # issue 9 (session 36): the dispatched splitkv variant beside its gluon render (Variant.gluon),
              # 16-layer steps (bench/gluon_splitkv.py; GKV_ARGS); its tests: GPUTESTS_ARGS=tests/test_splitkv_gluon.py.
              # GKV_PAGES: once per page size ("0": contiguous, the default; 256: --page 256):
              # gluon_splitkv.jsonl, then gluon_splitkv_p256.jsonl, ..
              for pg in ${GKV_PAGES:-0}; do
                name=gluon_splitkv; [ "$pg" = 0 ] || name=gluon_splitkv_p$pg
                echo "--- page $pg"
                timeout ${GKV_TIMEOUT:-200} python3 bench/gluon_splitkv.py --out "$OUT/$name.jsonl" \
                  --page $pg ${GKV_ARGS:-} 2>&1 | tee -a "$OUT/gluon_splitkv.log" \
                  | grep -v "leaked\|nanobind" | tail -40
              done ;;
    timeline) # issue 9 (session 38): %globaltimer stamps of the gluon partial kernel's programs over
              # 16-layer steps, beside the unstamped step (bench/splitkv_timeline.py; TL_ARGS), once per
              # combine shape in TLC_SHAPES ("-": the launch's own, the default; TILE/WARPS:
              # splitkv_timeline.py --combine): timeline.jsonl, then timeline_2.jsonl, ..
              n=0; for shape in ${TLC_SHAPES:--}; do n=$((n + 1))
                extra=""; [ "$shape" != "-" ] && extra="--combine $shape"
                name=timeline; [ $n = 1 ] || name=timeline_$n
                echo "--- combine $shape"
                timeout ${TL_TIMEOUT:-240} python3 bench/splitkv_timeline.py --out "$OUT/$name.jsonl" \
                  ${TL_ARGS:-} $extra 2>&1 | tee -a "$OUT/timeline.log" | grep -v "leaked\|nanobind" | tail -30
              done ;;
    pagedtiming) # issue 9 (session 47): paged against contiguous decode steps under flashtune bench's timer
              # and the probes' (do_bench), through the bench's, the probes' and sequential block tables
              timeout ${PT_TIMEOUT:-240} python3 bench/paged_timing_probe.py --out "$OUT/paged_timing.jsonl" \
                ${PT_ARGS:-} 2>&1 | tee "$OUT/paged_timing.log" | grep -v "leaked\|nanobind" | tail -40 ;;
    dsweep)   timeout ${DSWEEP_TIMEOUT:-330} python3 bench/decode_sweep.py --out "$OUT/decode_sweep.jsonl" ${DSWEEP_ARGS:-} \
                --budget ${DSWEEP_BUDGET:-300} 2>&1 | tee "$OUT/decode_sweep.log" | tail -20 ;;
    hopperncu) # issue 10: one launch of each worst-bucket kernel (and a good bucket) under Nsight Compute,
              # flashtune as dispatched, hopper_fwd forced, cuDNN (bench/hopper_ncu.py): the sections' details,
              # then the raw page of the warp-state and compute sections (every stall reason, the pipes' use)
              timeout ${HOPPERNCU_TIMEOUT:-240} ncu --clock-control none --profile-from-start off \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
                --section Occupancy --section LaunchStats --section SchedulerStats \
                --section MemoryWorkloadAnalysis --csv --page details \
                python3 bench/hopper_ncu.py ${HOPPERNCU_ARGS:-} > "$OUT/hopper_ncu.csv" 2> "$OUT/hopper_ncu.err"
              tail -3 "$OUT/hopper_ncu.err"
              timeout ${HOPPERNCU_TIMEOUT:-240} ncu --clock-control none --profile-from-start off \
                --section WarpStateStats --section ComputeWorkloadAnalysis --csv --page raw \
                python3 bench/hopper_ncu.py ${HOPPERNCU_ARGS:-} > "$OUT/hopper_ncu_raw.csv" 2> "$OUT/hopper_ncu_raw.err"
              tail -3 "$OUT/hopper_ncu_raw.err"
              python3 bench/hopper_ncu.py --summary "$OUT/hopper_ncu.csv" | tail -40
              python3 bench/hopper_ncu.py --stalls "$OUT/hopper_ncu_raw.csv" | tail -40 ;;
    srcprof)  # issue 10: per-SASS-instruction stall samples (ncu SourceCounters, PC sampling) of the
              # hopper kernels bench/hopper_ncu.py runs (SRCPROF_ARGS; SRCPROF_SCRIPT another script,
              # e.g. bench/paged_ncu.py with SRCPROF_KERNEL=splitkv), the source page as CSV; then
              # bench/sass_stalls.py's summary (which instructions the warps wait at, and on what)
              timeout ${SRCPROF_TIMEOUT:-240} ncu --clock-control none --profile-from-start off \
                -k "regex:${SRCPROF_KERNEL:-attn_fwd_hopper}" --section SourceCounters --section WarpStateStats \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --import-source no -f -o /tmp/srcprof \
                python3 ${SRCPROF_SCRIPT:-bench/hopper_ncu.py} ${SRCPROF_ARGS---cases fwd-d256-4k,fwd-d128-4k --only hopper_fwd} \
                > "$OUT/srcprof.log" 2>&1
              tail -4 "$OUT/srcprof.log"
              ncu -i /tmp/srcprof.ncu-rep --page details --csv > "$OUT/srcprof_details.csv" 2>&1
              ncu -i /tmp/srcprof.ncu-rep --page source --csv --print-source sass \
                > "$OUT/srcprof_sass.csv" 2> "$OUT/srcprof_page.err"
              tail -3 "$OUT/srcprof_page.err"; wc -c "$OUT/srcprof_sass.csv"
              python3 bench/sass_stalls.py "$OUT/srcprof_sass.csv" 2>&1 | tail -60 ;;
    dncu)     timeout 200 ncu --clock-control none -k "regex:splitkv|sdpa|fmha|cudnn|attn" \
                --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers \
                --csv python3 bench/decode_sweep.py --ncu > "$OUT/decode_ncu.csv" 2> "$OUT/decode_ncu.err"
              tail -3 "$OUT/decode_ncu.err"; wc -l "$OUT/decode_ncu.csv" ;;
    varlentests) timeout ${VARLENTESTS_TIMEOUT:-240} python3 -m pytest -q -x tests/test_varlen.py 2>&1 \
                | tee "$OUT/varlentests.log" | tail -6 ;;
    varlenhopper) # hopper_bwd's varlen render: its tests (40 GPU cases, each compiling its kernels;
              # ~2-3 s a case) and the varlen suite on the GPU (the `device` fixture's cuda cases),
              # then the varlen bench with the backward forced to it and to the generic bwd's
              # D=128 records (causal, non-causal), every row in one run
              timeout ${VARLENHOPPER_TIMEOUT:-330} python3 -m pytest -q \
                tests/test_hopper_bwd_varlen.py tests/test_varlen.py 2>&1 \
                | tee "$OUT/varlenhopper_tests.log" | tail -12
              timeout 240 python3 bench/varlen_bench.py --out "$OUT/varlen_hopper.jsonl" --no-padded \
                --force-bwd hopper_bwd-m64-n64-w4-s2-dq=gluon \
                --force-bwd bwd-m64-n128-w8-s3-causal_split=false-dq=fused-mq128-nq64 \
                --force-bwd bwd-m64-n64-w4-s2-dq=fused-mq64-nq64 2>&1 | tee "$OUT/varlen_hopper.log" | tail -30 ;;
    bnhd)     # q/k/v in (B, N, H, D) memory on the Hopper families (hopper_fwd's bnhd render,
              # hopper_bwd's RowsBwd): their GPU tests (~240 s), the
              # shipped hopper_fwd records' spills compiled both ways (triton 3.6), then both layouts
              # timed beside SDPA's cuDNN and flash backends (D 64/128, N 1k/4k)
              timeout ${BNHD_TIMEOUT:-300} python3 -m pytest -q tests/test_hopper_bnhd.py \
                ${BNHD_K:+-k "$BNHD_K"} 2>&1 | tee "$OUT/bnhd_tests.log" | tail -8
              [ -n "${BNHD_K:-}" ] || timeout 150 python3 bench/bnhd_spills.py --jobs 16 --out "$OUT/bnhd_spills.jsonl" 2>&1 \
                | grep -v "leak\|nanobind\|^ - \|skipped remainder" | tee "$OUT/bnhd_spills.log" | tail -12
              timeout ${LAYOUT_TIMEOUT:-300} python3 bench/layout_bench.py --out "$OUT/layout.jsonl" 2>&1 \
                | tee "$OUT/layout.log" | tail -44 ;;
    fbprof)   # the kernels of a fwd+bwd step against its passes timed apart, per layout
              timeout 200 python3 bench/fb_profile.py --out "$OUT/fb_profile.json" ${FBPROF_ARGS:-} 2>&1 \
                | tee "$OUT/fb_profile.log" | tail -40 ;;
    hfstatic) # the static-cache generate() tests, with CUDA graph trees recording where every pool
              # allocation came from (their "tensor not tracked as outputs" error then names it)
              timeout 240 python3 -c "import sys, pytest, torch._inductor.config as c
c.triton.cudagraph_trees_history_recording = True
sys.exit(pytest.main(['-q', '-x', '--tb=long', 'tests/test_transformers_backend.py', '-k', 'static']))" \
                2>&1 | tee "$OUT/hfstatic.log" | tail -60 ;;
    # flashtune bench: BENCH_ARGS narrows it (--section dense --mode fwd --head-dim 128 ...) to
    # fit a call; BENCH_NAME names the folder, so two runs of one call do not collide. The JSON
    # is rewritten after every case (a run cut by the timeout keeps its rows; put it in the
    # worktree and add `--resume that/bench.json` to BENCH_ARGS to go on from there). Plots and
    # the merged report: `flashtune bench --from A/bench.json --from B/bench.json --out DIR`.
    bench)    # BENCH_DBS: tuned DBs to dispatch from, one run each ("shipped": the tables alone;
              # a research step's sqlite:////tmp/rs.db: its records first)
              # BENCH_ARGS may hold several runs, ';'-separated (folders _1, _2, ... after the first)
              IFS=';' read -ra runs <<< "${BENCH_ARGS:-}"; [ ${#runs[@]} -gt 0 ] || runs=("")
              for db in ${BENCH_DBS:-shipped}; do
                use_db $db
                for i in "${!runs[@]}"; do
                  d="$OUT/bench${BENCH_NAME:+_$BENCH_NAME}"; [ $i = 0 ] || d="${d}_$i"
                  [ $db = shipped ] || d="${d}_db"
                  timeout ${BENCH_TIMEOUT:-560} flashtune bench --no-plots --progress lines --out "$d" \
                    ${runs[$i]} > "$d.log" 2>&1; echo "rc $? ($db)"; tail -${BENCH_TAIL:-60} "$d.log"
                done
              done
              use_db shipped ;;
    benchquick) timeout ${BENCH_TIMEOUT:-560} flashtune bench --quick --no-plots --progress lines \
                --out "$OUT/benchquick" ${BENCH_ARGS:-} > "$OUT/benchquick.log" 2>&1; echo "rc $?"
              tail -${BENCH_TAIL:-60} "$OUT/benchquick.log" ;;
    hopper)   # the Gluon Hopper forward: its GPU tests, then correctness + the standard grid vs SDPA
              timeout ${HOPPER_TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_hopper.py 2>&1 \
                | tee "$OUT/hopper_tests.log" | tail -15
              timeout ${HOPPER_TIMEOUT:-330} python3 bench/hopper_check.py ${HOPPER_ARGS:---per-dim 2 --budget 300} 2>&1 \
                | tee "$OUT/hopper_check.log" | tail -40 ;;
    hoppercheck) # bench/hopper_check.py alone (no GPU tests): HC_ARGS, e.g. --variants a@128,b@64
              # --head-dims 64,128 --bench-dims 64,128 --seqlens 512,1024 --baselines cudnn
              timeout ${HC_TIMEOUT:-560} python3 bench/hopper_check.py ${HC_ARGS:-} 2>&1 \
                | tee "$OUT/hopper_check.log" | tail -${HC_TAIL:-50} ;;
    hopperbwd) # the Gluon Hopper backward (hopper_bwd, forced): its GPU tests, then the standard grid
              # (bf16, D=64/128) beside the generic bwd (dispatched, atomic, separate) and SDPA flash/cuDNN
              timeout ${HOPPERBWD_TESTS_TIMEOUT:-300} python3 -m pytest -q -x -m gpu tests/test_hopper_bwd.py \
                ${HOPPERBWD_TESTS_ARGS:-} 2>&1 \
                | tee "$OUT/hopperbwd_tests.log" | tail -15
              timeout ${HOPPERBWD_TIMEOUT:-300} python3 bench/bwd_bench.py --hopper ${HOPPERBWD_ARGS:-} 2>&1 \
                | tee "$OUT/hopperbwd_bench.log" | tail -40 ;;
    probe)    # what this machine's Triton offers the next kernels (seconds): Triton proper's TMA reduce-add
              # (tensor_descriptor.atomic_add, for the generic bwd's atomic dQ), Gluon's (tma.async_atomic_add),
              # and whether pynvml is there (else the timing workers read the driver through ctypes)
              python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import importlib.util
import triton
import triton.language as tl
print("triton", triton.__version__)
print("tl.tensor_descriptor.atomic_add:", hasattr(tl.tensor_descriptor, "atomic_add"))
try:
    from triton.experimental.gluon.language.nvidia.hopper import tma
    print("gluon hopper tma.async_atomic_add:", hasattr(tma, "async_atomic_add"))
except Exception as e:  # noqa: BLE001
    print("gluon hopper tma:", type(e).__name__, e)
print("pynvml:", importlib.util.find_spec("pynvml") is not None)
PY
              ;;
    hopperset) # issue 10: one of bench/hopper_check.py's candidate sets timed beside cuDNN, without the
              # correctness checks (HOPPERSET_ARGS, e.g. "--set d256 --head-dims 256 --bench-dims 256")
              timeout ${HOPPERSET_TIMEOUT:-330} python3 bench/hopper_check.py --skip-check ${HOPPERSET_ARGS:---set d256 \
                --head-dims 256 --bench-dims 256 --seqlens 1024,4096,16384 --baselines cudnn --budget 300} 2>&1 \
                | tee "$OUT/hopperset.log" | tail -30 ;;
    hopper_noloader)  # hopper_fwd without a loader partition (loader_regs 0): its forced GPU tests, then
              # correctness + the standard grid (D=64,128) vs cuDNN beside each D's default
              timeout ${HOPPER_TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_hopper.py -k "not lr" 2>&1 \
                | tee "$OUT/hopper_noloader_tests.log" | tail -15
              timeout ${HOPPER_TIMEOUT:-420} python3 bench/hopper_check.py --set no_loader ${HOPPER_ARGS:---budget 390} 2>&1 \
                | tee "$OUT/hopper_noloader_check.log" | tail -40 ;;
    hopperfwdtiles) # issue 10: hopper_fwd's 128-key steps with a loader warp (P converted right after the
              # softmax, causal_split): the forced GPU tests of the new tiles (bf16; HOPPERTILES_K="tiles"
              # for fp16 too), a smoke of the masked renders (their loop and P changed too), then the
              # standard grid (D=128, 256, 64; causal or not) vs cuDNN and SDPA flash in the same run,
              # causal_split on and off, each D's default beside -> hopper_fwd.jsonl
              timeout ${HOPPERTILES_TESTS_TIMEOUT:-190} python3 -m pytest -q -m gpu tests/test_hopper.py \
                -k "${HOPPERTILES_K:-tiles and bf16}" 2>&1 | tee "$OUT/hopperfwdtiles_tests.log" | tail -15
              timeout 60 python3 -m pytest -q -m gpu tests/test_hopper_masks.py -k "pingpong and not noloader" \
                2>&1 | tee "$OUT/hopperfwdtiles_masks.log" | tail -4
              timeout 45 python3 -m pytest -q -m gpu tests/test_hopper_block_sparse.py -k "persistent" \
                2>&1 | tee "$OUT/hopperfwdtiles_sparse.log" | tail -4
              timeout ${HOPPERTILES_TIMEOUT:-235} python3 bench/hopper_check.py --set tiles --skip-check \
                --baselines cudnn,flash --bench-dims 128,256,64 ${HOPPERTILES_ARGS:---budget 220} 2>&1 \
                | tee "$OUT/hopperfwdtiles_bench.log" | tail -30 ;;
    hopperqbuf) # issue 10: hopper_fwd with a second Q buffer per consumer (q_buffers 2: the loader runs a tile
              # ahead of a persistent program's consumers): its forced GPU tests over many tiles (bf16 and fp16,
              # causal or not, window/softcap), then the persistent winners with 1 and 2 Q buffers on the
              # standard grid beside cuDNN and the generic fwd default in the same run -> hopper_fwd.jsonl
              timeout ${HOPPERQBUF_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_hopper.py \
                -k "two_q_buffers" 2>&1 | tee "$OUT/hopperqbuf_tests.log" | tail -8
              timeout ${HOPPERQBUF_TIMEOUT:-330} python3 bench/hopper_check.py --set qbuf --skip-check \
                --baselines cudnn,fwd --head-dims 64,128,256 --bench-dims 128,64,256 \
                --seqlens ${HOPPERQBUF_SEQLENS:-512,1024,2048,8192} --budget ${HOPPERQBUF_BUDGET:-310} 2>&1 \
                | tee "$OUT/hopperqbuf_bench.log" | tail -20 ;;
    hopperl2) # issue 10: hopper_fwd's causal tile order in L2-sized sections of heads (l2_order): its forced GPU
              # tests over several sections (bf16 and fp16, persistent and not), then the H100 table's short
              # causal records and the defaults without and with it beside cuDNN and the generic fwd default
              timeout ${HOPPERL2_TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_hopper.py \
                -k "l2_order" 2>&1 | tee "$OUT/hopperl2_tests.log" | tail -8
              timeout ${HOPPERL2_TIMEOUT:-300} python3 bench/hopper_check.py --set l2order --skip-check \
                --baselines cudnn,fwd --head-dims 64,128,256 --bench-dims 128,256,64 \
                --seqlens ${HOPPERL2_SEQLENS:-512,1024,2048,4096,16384} --budget ${HOPPERL2_BUDGET:-280} 2>&1 \
                | tee "$OUT/hopperl2_bench.log" | tail -40 ;;
    hopperdefaults) # issue 10: hopper_fwd's D=64/128 defaults (the 128-key ping-pong, s3): their forced GPU
              # tests (bf16 and fp16, causal or not), then the standard grid beside cuDNN, SDPA flash and
              # the generic fwd's default in the same run -> hopper_fwd.jsonl
              timeout ${HOPPERDEF_TESTS_TIMEOUT:-170} python3 -m pytest -q -m gpu tests/test_hopper.py \
                -k "matches_reference and lr24 and n128 and s3" 2>&1 | tee "$OUT/hopperdefaults_tests.log" | tail -6
              timeout ${HOPPERDEF_TIMEOUT:-120} python3 bench/hopper_check.py --skip-check --baselines cudnn,flash,fwd \
                --variants hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24@64,hopper_fwd-m64-n128-w4-s3-pingpong=true-lr24@128 \
                --head-dims 64,128 --bench-dims 64,128 --budget ${HOPPERDEF_BUDGET:-110} 2>&1 \
                | tee "$OUT/hopperdefaults_bench.log" | tail -12 ;;
    hoppermasks) # hopper_fwd's window/softcap renders (issue 11): its forced GPU tests against the float64
              # reference (every schedule), then the causal sliding window at N=4k/16k, W=256..4096 (D=128,
              # bf16, B=1, H=16): hopper_fwd forced vs the generic fwd as dispatched vs compiled Flex
              timeout ${HOPPERMASKS_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_hopper_masks.py 2>&1 \
                | tee "$OUT/hoppermasks_tests.log" | tail -15
              timeout ${HOPPERMASKS_TIMEOUT:-150} python3 bench/hopper_mask_bench.py --out "$OUT/hopper_masks.jsonl" \
                ${HOPPERMASKS_ARGS:-} 2>&1 | tee "$OUT/hoppermasks_bench.log" | tail -40 ;;
    hopperbwdmasks) # hopper_bwd's window/softcap renders (issue 11): its forced GPU tests against the float64
              # reference, then the causal sliding-window backward at N=4k/16k, W=256..4096 (D=128, bf16, B=1,
              # H=16): hopper_bwd forced vs the generic bwd as dispatched vs compiled Flex
              timeout ${HOPPERBWDMASKS_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_hopper_bwd_masks.py 2>&1 \
                | tee "$OUT/hopperbwdmasks_tests.log" | tail -15
              timeout ${HOPPERBWDMASKS_TIMEOUT:-150} python3 bench/hopper_mask_bench.py --bwd \
                --out "$OUT/hopper_bwd_masks.jsonl" ${HOPPERBWDMASKS_ARGS:-} 2>&1 \
                | tee "$OUT/hopperbwdmasks_bench.log" | tail -40 ;;
    hopperblocksparse) # hopper_fwd's block_sparse render (issue 11): its forced GPU tests against the
              # float64 reference (every schedule, 20 compiles), then random 128-blocks at N=4k/16k x
              # density 10/30/60/100 % (D=128, bf16, B=1, H=16): hopper_fwd forced vs the generic fwd
              # as dispatched vs compiled Flex, one JSON line per row
              timeout ${HOPPERBLOCKSPARSE_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu \
                tests/test_hopper_block_sparse.py 2>&1 | tee "$OUT/hopperblocksparse_tests.log" | tail -15
              timeout ${HOPPERBLOCKSPARSE_TIMEOUT:-120} python3 bench/hopper_sparse_bench.py \
                --out "$OUT/hopper_sparse.jsonl" ${HOPPERBLOCKSPARSE_ARGS:-} 2>&1 \
                | tee "$OUT/hopperblocksparse_bench.log" | tail -30 ;;
    hopperbwdblocksparse) # hopper_bwd's block_sparse render (issue 11): its forced GPU tests against the
              # float64 reference (15 compiles: D=64/128/256, block sizes 64..256, element masks, GQA),
              # then the backward of random 128-blocks at N=4k/16k x density 10/30/60/100 % (D=128,
              # bf16, B=1, H=16): hopper_bwd forced vs the generic bwd as dispatched vs compiled Flex
              timeout ${HOPPERBWDBS_TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu \
                tests/test_hopper_bwd_block_sparse.py 2>&1 | tee "$OUT/hopperbwdblocksparse_tests.log" | tail -15
              timeout ${HOPPERBWDBS_TIMEOUT:-180} python3 bench/hopper_sparse_bench.py --bwd \
                --out "$OUT/hopper_bwd_sparse.jsonl" ${HOPPERBWDBS_ARGS:-} 2>&1 \
                | tee "$OUT/hopperbwdblocksparse_bench.log" | tail -30 ;;
    sparseprof16k) # issue 11: the 16k density sweep's 5% and 10% block masks (mask_bench's patterns) and
              # the dense call under torch.profiler: which kernel keeps the 5% backward at the 10% one's time
              timeout ${SPARSEPROF_TIMEOUT:-180} python3 bench/sparse_profile.py --n 16384 --densities 5,10 \
                --only dense,sweep --steps 5 --out "$OUT/sparse_profile16k.jsonl" 2>&1 \
                | grep -v "^USDT\|profiler_st" | tee "$OUT/sparse_profile16k.log" | tail -40 ;;
    launcher) # launcher.Launcher's direct launches: GPU tests of the families that launch through it (the
              # Gluon ones: every LAUNCHER_EVERY-th of their GPU tests, to fit a call), splitkv's, then the
              # 4k block-sparse backward against Flex with Triton's launches and with direct ones
              timeout ${LAUNCHER_TESTS_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_launcher.py \
                tests/test_forward_gpu.py tests/test_backward.py tests/test_varlen.py 2>&1 \
                | tee "$OUT/launcher_tests.log" | tail -4
              python3 -m pytest --collect-only -q -m gpu tests/test_hopper.py tests/test_hopper_bwd.py \
                tests/test_hopper_masks.py tests/test_hopper_bwd_block_sparse.py 2>/dev/null | grep "::" \
                | awk -v n=${LAUNCHER_EVERY:-9} 'NR % n == 1' > /tmp/launcher_sample.txt
              echo "Gluon sample: $(wc -l < /tmp/launcher_sample.txt) tests"
              timeout ${LAUNCHER_GLUON_TIMEOUT:-200} xargs -d '\n' -a /tmp/launcher_sample.txt python3 -m pytest -q 2>&1 \
                | tee "$OUT/launcher_gluon.log" | tail -6
              timeout 200 python3 -m pytest -q tests/test_splitkv.py 2>&1 | tee "$OUT/launcher_splitkv.log" | tail -4
              if [ -n "${LAUNCHER_SPARSE:-}" ]; then
                for mode in 1 0; do
                  echo "--- FLASHTUNE_SLOW_LAUNCH=$mode"
                  FLASHTUNE_SLOW_LAUNCH=$mode timeout 150 python3 bench/hopper_sparse_bench.py --bwd --n 4096 \
                    --out "$OUT/sparse_bwd_launch$mode.jsonl" 2>&1 | tail -12
                done
              fi ;;
    maskexplain) # issue 11: what serves the 4k masked calls on this GPU (the 100% block mask's forward took
              # 0.36 ms against 0.22 for the dense one, session 14), fwd and bwd, D=128, bf16, B=1, H=16
              for fam in fwd bwd; do for m in none density=1 density=0.3 density=0.1 window=1024; do
                echo "--- $fam $m"
                flashtune dispatch explain --family $fam --dtype bf16 --head-dim 128 --seqlen-q 4096 \
                  --mask $m 2>&1 | grep -v "^note  *no user DB"
              done; done 2>&1 | tee "$OUT/maskexplain.log" | tail -80 ;;
    decodemask) # issue 11: splitkv's block_sparse render (decode-shaped dense calls with a block mask): its
              # GPU tests, then decode GB/s at 10/50/100 % of 128-key blocks beside compiled Flex
              timeout ${DECODEMASK_TESTS_TIMEOUT:-150} python3 -m pytest -q tests/test_splitkv_block_sparse.py \
                2>&1 | tee "$OUT/decodemask_tests.log" | tail -4
              timeout ${DECODEMASK_TIMEOUT:-300} python3 bench/decode_mask_bench.py --out "$OUT/decode_mask.jsonl" \
                ${DECODEMASK_ARGS:-} 2>&1 | tee "$OUT/decode_mask.log" | tail -40 ;;
    hostprof) # issue 11: the host time of a fwd+bwd in pieces (forward, backward called directly, its
              # plan's run, autograd, a bare Triton launch) and cProfile of the backward, N=512
              timeout ${HOSTPROF_TIMEOUT:-150} python3 bench/host_profile.py --out "$OUT/host_profile.json" \
                ${HOSTPROF_ARGS:-} 2>&1 | tee "$OUT/host_profile.log" | head -${HOSTPROF_LINES:-400} | tail -200 ;;
    sparseprof) # issue 11: where a masked fwd+bwd spends its time (torch.profiler kernel table: no mask,
              # block masks 100% and 10%, window 1024, softcap, block 10% + causal + softcap, Flex on
              # the 100% mask; N=4k, D=128, bf16; host runtime calls per step), then the host time
              # per call of each mask case against the dense call at a host-bound N=512 (and the
              # device->host syncs one repeated call makes: must be 0)
              timeout ${SPARSEPROF_TIMEOUT:-180} python3 bench/sparse_profile.py --out "$OUT/sparse_profile.jsonl" \
                ${SPARSEPROF_ARGS:-} 2>&1 | tee "$OUT/sparse_profile.log" | tail -100
              timeout ${MASKHOST_TIMEOUT:-120} python3 bench/mask_host_overhead.py \
                --out "$OUT/mask_host_overhead.jsonl" 2>&1 | tee "$OUT/mask_host_overhead.log" | tail -14 ;;
    tuningvalue) # issue 12: the tuned table vs the built-in defaults and the single best config, per
              # bucket interleaved (bench/tuning_value.py). Default: the shipped table of this GPU, all
              # its families. The H100 table used on an H200 (run on nvidia-h200):
              #   TV_ARGS="--table tuned_db/tables/nvidia-h100-80gb-hbm3.json"
              # Narrow a call with TV_ARGS="--family fwd" (or --head-dim 128, --seqlen 4096).
              timeout ${TV_TIMEOUT:-520} python3 bench/tuning_value.py --budget ${TV_BUDGET:-400} \
                --out "$OUT/tuning_value.jsonl" ${TV_ARGS:-} 2>&1 | tee "$OUT/tuning_value.log" | tail -${TV_TAIL:-30} ;;
    bwdablation) # issue 10: hopper_bwd's kernels per variant and ablation (no-atomics: dQ's adds
              # masked off), split by the CUDA profiler (bench/bwd_ablation.py; BWDABL_ARGS)
              timeout ${BWDABL_TIMEOUT:-300} python3 bench/bwd_ablation.py --out "$OUT/bwd_ablation.jsonl" \
                ${BWDABL_ARGS:---d 256 --n 4096,16384 --causal 0,1} 2>&1 | tee "$OUT/bwd_ablation.log" | tail -30 ;;
    bwdcands) # issues 10/11: bwd candidates (flex-like tiles, fused dQ, ...) forced vs the bwd as
              # dispatched vs compiled Flex vs SDPA cuDNN/flash, backward only, bf16: N=16k window 1024,
              # then dense N=16k/4k/1k causal and not (D=128; BWDCANDS_ARGS="--head-dims 64 --no-window"
              # for D=64). Compiles ahead in a process pool; stops starting cases at --budget-s 380
              timeout ${BWDCANDS_TIMEOUT:-420} python3 bench/bwd_cands_bench.py --out "$OUT/bwd_cands${BWDCANDS_NAME:+_$BWDCANDS_NAME}.jsonl" \
                ${BWDCANDS_ARGS:-} 2>&1 | tee "$OUT/bwd_cands${BWDCANDS_NAME:+_$BWDCANDS_NAME}.log" | grep -v "^warm " | tail -${BWDCANDS_TAIL:-70} ;;
    research) # a re-search of some families' buckets on the standard grid after their spaces grew
              # (RESEARCH_SPECS: "family head_dims budget_s" triples, ';'-separated; RESEARCH_GPUS="0,1"
              # shares the buckets between a multi-GPU machine's GPUs) into /tmp/rs.*;
              # the records come back in $OUT/tables/research.json, merged with `db import --keep-faster`;
              # a spec's fields after the third go to that search ("hopper_fwd 128 120 --seqlen 512")
              name=$(python3 -c "import torch;print(torch.cuda.get_device_name())")
              IFS=';' read -ra specs <<< "${RESEARCH_SPECS:-hopper_fwd 128 170}"
              for spec in "${specs[@]}"; do
                set -- $spec
                timeout $(( $3 + 60 )) flashtune search --gpu auto --family $1 --head-dim $2 \
                  ${RESEARCH_GPUS:+--gpus $RESEARCH_GPUS} \
                  --trials ${TRIALS:-40} --time-budget $3 --in-order --storage /tmp/rs.journal ${RESEARCH_ARGS:-} "${@:4}" \
                  --db sqlite:////tmp/rs.db --progress lines 2>&1 | tee -a "$OUT/research.log" \
                  | grep -v "measured so far\|^\[all\]" | tail -16
              done
              python3 bench/trial_phases.py --failed /tmp/rs.journal 2>&1 | tail -8
              mkdir -p "$OUT/tables"
              flashtune db export --gpu "$name" --db sqlite:////tmp/rs.db -o "$OUT/tables/research.json" 2>&1 | tail -1 ;;
    forcerecords) # the research step's hopper_fwd records forced on odd lengths with GQA against the
              # float64 reference, and their other families' runner-ups (bench/force_records.py)
              timeout ${FORCE_TIMEOUT:-150} python3 bench/force_records.py "$OUT/tables/research.json" \
                2>&1 | tee "$OUT/force_records.log" | tail -40 ;;
    gqa)      # GQA (Llama 16/4, D=128, causal): dispatched now and before session 28's rule, beside SDPA
              # cuDNN / flash and Flex (bench/gqa_bench.py)
              timeout ${GQA_TIMEOUT:-300} python3 bench/gqa_bench.py --out "$OUT/gqa.jsonl" ${GQA_ARGS:-} \
                2>&1 | tee "$OUT/gqa.log" | tail -30 ;;
    decodehost) # a DynamicCache decoding loop (torch.cat per step) timed eagerly: flashtune, with session
              # 28's host fixes undone one by one, and SDPA (bench/decode_host.py)
              timeout ${DHOST_TIMEOUT:-200} python3 bench/decode_host.py --out "$OUT/decode_host.json" \
                ${DHOST_ARGS:-} 2>&1 | tee "$OUT/decode_host.log" | tail -12 ;;
    decodeprobe) # issue 9: MQA B=1 32k/128k (kernel durations, partial shapes, read ceiling, cuDNN) and
              # paged B=1 2k against contiguous, interleaved (bench/decode_probe.py)
              timeout ${DPROBE_TIMEOUT:-300} python3 bench/decode_probe.py --out "$OUT/decode_probe.jsonl" \
                ${DPROBE_ARGS:-} 2>&1 | tee "$OUT/decode_probe.log" | tail -60 ;;
    decodecell) # one decode cell (bench/decode_cell.py, DCELL_ARGS) per peer, each in its own process,
              # flashtune's with and without PDL; DCELL_SANITIZE=peer: that one under compute-sanitizer
              for p in ${DCELL_PEERS:-plain-read flashtune flashtune-paged256}; do
                for pdl in 1 0; do
                  [ $pdl = 0 ] && [ "${p#flashtune}" = "$p" ] && continue
                  echo "--- $p FLASHTUNE_PDL=$pdl"
                  FLASHTUNE_PDL=$pdl timeout 120 python3 bench/decode_cell.py ${DCELL_ARGS:-} --peers $p 2>&1 \
                    | grep -v Warning | tail -4
                done
              done 2>&1 | tee "$OUT/decodecell.log"
              if [ -n "${DCELL_SANITIZE:-}" ]; then
                timeout 240 compute-sanitizer --print-limit 4 python3 bench/decode_cell.py ${DCELL_ARGS:-} \
                  --peers $DCELL_SANITIZE --layers 2 2>&1 | tee "$OUT/decodecell_sanitizer.log" | tail -40
              fi ;;
    hostbwd)  # issue 10: a backward's GPU time against the host time to issue it, and cProfile of
              # the issue (bench/host_bwd.py; HOSTBWD_ARGS, default the bench's D=128 causal 512 cell)
              timeout ${HOSTBWD_TIMEOUT:-150} python3 bench/host_bwd.py ${HOSTBWD_ARGS:-} 2>&1 \
                | tee "$OUT/host_bwd.log" | tail -${HOSTBWD_TAIL:-40} ;;
    parity)   # the backward beside Flex on PARITY_SEQLENS (default 512), PARITY_RUNS times, as
              # dispatched -- from the shipped table, then from $PARITY_DB (a research step's /tmp/rs.db) when set
              for i in $(seq ${PARITY_RUNS:-3}); do
                for db in shipped ${PARITY_DB:-}; do
                  echo "--- run $i, tuned records: $db" | tee -a "$OUT/parity.log"
                  use_db $db
                  timeout 150 python3 bench/bwd_bench.py --flex --only flashtune,flex \
                    --head-dims ${PARITY_D:-128} --seqlens ${PARITY_SEQLENS:-512} 2>&1 \
                    | tee -a "$OUT/parity.log" | tail -6
                done
              done
              use_db shipped ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date +%T)"
