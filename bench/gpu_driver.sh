#!/bin/bash
# GPU driver (runtime-only TVM), run from the repo root on the GPU machine. Usage: bash bench/gpu_driver.sh STEP... ; steps: gemm nvfp4 attn gemv gdn sampler check mem bench spec specforced dflash ringattn vision moe sass hf serve harness agent moebench script overlap pdl
set -u
REPO=$PWD
export PYTHONUNBUFFERED=1
SITE=$(python3 -c 'import site;print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/tvmrt/whl/*.whl >/dev/null 2>&1 || { echo "whl install failed"; exit 1; }
mkdir -p /tmp/site && tar -xJf .gpu/tvmrt/site.tar.xz -C /tmp/site
mkdir -p /tmp/pkg/ninfer_mlc && cp -r ${SNAP:-.}/ninfer_mlc/* /tmp/pkg/ninfer_mlc/ && ln -sfn $REPO/${SNAP:-.}/runtime /tmp/pkg/ninfer_mlc/runtime && ln -sfn $REPO/${SNAP:-.}/compile /tmp/pkg/ninfer_mlc/compile
CUDART=$(ls /usr/local/cuda/lib64/libcudart.so.13* /usr/local/cuda*/targets/x86_64-linux/lib/libcudart.so.13* $SITE/nvidia/cu13/lib/libcudart.so.13* $SITE/nvidia/cuda_runtime/lib/libcudart.so.13* 2>/dev/null | head -1)
export LD_LIBRARY_PATH=$(dirname "$CUDART"):${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/pkg:/tmp/site TVM_USE_RUNTIME_LIB=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv,noheader | tee $OUT/nvsmi.txt
T0=$(date +%s)
run() { # name timeout cmd...
  local name=$1 to=$2; shift 2
  local t=$(date +%s)
  timeout $to "$@" > $OUT/$name.log 2>&1; local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t ))s" | tee -a $OUT/summary.txt
}
servewhl() { # the HTTP server's wheels (bench/serve_wheels.sh), once
  [ -n "${SERVEWHL_DONE:-}" ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ${SERVEWHL:-.gpu/servewhl}/*.whl >/dev/null 2>&1 \
    || echo "server wheels install failed (run bench/serve_wheels.sh, carry .gpu/servewhl)" | tee -a $OUT/summary.txt
  SERVEWHL_DONE=1
}
for step in "$@"; do
  case $step in
    gemm) [ -d .gpu/gemm ] && run gemm 120 python3 ${BENCH:-bench}/gemm_gpu_check.py run .gpu/gemm $OUT/gemm.json ;;
    nvfp4) [ -d ${NVFP4_PREP:-.gpu/dq} ] && run nvfp4 200 python3 bench/nvfp4_prefill_check.py run ${NVFP4_PREP:-.gpu/dq} $OUT/nvfp4.json ;;
    attn) [ -d .gpu/attn ] && run attn ${ATTN_TIMEOUT:-150} python3 bench/attn_gpu_check.py run .gpu/attn $OUT/attn.json ${ATTN_ARGS:-} ;;
    gemv) G=${GEMV_DIR:-.gpu/gemv}; [ -d $G ] && run gemv ${GEMV_TIMEOUT:-150} python3 ${BENCH:-bench}/gemv_gpu_check.py run $G $OUT/gemv.json ${GEMV_ARGS:-} ;;
    gdn) [ -d .gpu/gdn ] && run gdn 150 python3 bench/gdn_gpu_check.py run .gpu/gdn $OUT/gdn.json ;;
    sampler) [ -d .gpu/sampler ] && run sampler 200 python3 bench/sampler_gpu_check.py run .gpu/sampler $OUT/sampler.json ;;
    check) run check 200 python3 ${BENCH:-bench}/gpu_bench.py check ${PREP:-.gpu/prep} $OUT/check.json ;;
    mem) run mem 300 python3 bench/prefill_memory.py ${MEM_ART:-${PREP:-.gpu/prep}/tiny-bf16} --device cuda --lengths ${MEM_LENGTHS:-30} ${MEM_ARGS:-} ;;
    bench) run bench ${BENCH_TIMEOUT:-540} python3 ${BENCH:-bench}/gpu_bench.py bench ${PREP:-.gpu/prep} $OUT/bench.json ${BENCH_ARGS:-} ;;
    spec) [ -d .gpu/spec ] && run spec 300 python3 bench/spec_gpu_bench.py run .gpu/spec $OUT/spec.json --skip-forced ;;
    specforced) S=${SPEC_DIR:-.gpu/spec}; [ -d $S/q27b-taps ] && run specforced 560 python3 ${BENCH:-bench}/spec_gpu_bench.py run $S $OUT/spec_forced.json --skip-27b --skip-tiny --budget-s 520 ${FORCED_ARGS:-} ;;
    dflash) [ -d .gpu/dflash ] && run dflash 300 python3 bench/dflash_gpu_check.py run .gpu/dflash $OUT/dflash.json ;;
    ringattn) [ -d .gpu/ringattn ] && run ringattn 200 python3 bench/ring_attn_gpu_check.py run .gpu/ringattn $OUT/ringattn.json ;;
    serve) servewhl; run serve ${SERVE_TIMEOUT:-570} python3 ${BENCH:-bench}/serve_bench.py ${SERVE_ART:-.gpu/serve} \
             --serve-args="${SERVE_FLAGS:-}" --server-log $OUT/serve_server.log -o $OUT/serve.json ${SERVE_BENCH_ARGS:-} ;;
    overlap) run overlap ${OVERLAP_TIMEOUT:-540} python3 ${BENCH:-bench}/overlap_gpu_check.py ${SERVE_ART:-.gpu/serve} \
             -o $OUT/overlap.json ${OVERLAP_ARGS:-} ;;
    pdl) run pdl ${PDL_TIMEOUT:-560} python3 ${BENCH:-bench}/pdl_ab.py ${PDL_ARTS:-${SERVE_ART:-.gpu/serve}} \
             --decode ${PDL_DECODE:-8192x1,8192x8} --steps ${PDL_STEPS:-30} -o $OUT/pdl.json ;;
    harness) run harness ${HARNESS_TIMEOUT:-300} python3 bench/serve_harness.py ${HARNESS_ART:-${SERVE_ART:-.gpu/serve}} \
             -o $OUT/harness.json ${HARNESS_ARGS:-} ;;
    agent) servewhl; run agent ${AGENT_TIMEOUT:-570} python3 ${BENCH:-bench}/agent_replay.py ${SERVE_ART:-.gpu/serve} \
             --serve-args="${SERVE_FLAGS:-}" --server-log $OUT/agent_server.log -o $OUT/agent.json ${AGENT_ARGS:-} ;;
    vision) [ -d .gpu/vision ] && run vision 540 python3 bench/vision_gpu_bench.py run .gpu/vision $OUT/vision.json ${VISION_ARGS:-} ;;
    moe) M=${MOE_DIR:-.gpu/moe}; [ -d $M ] && { run moe_check 240 python3 ${BENCH:-bench}/moe_gpu_bench.py check $M $OUT/moe_check.json
         run moe_kernels 240 python3 ${BENCH:-bench}/moe_gpu_bench.py kernels $M $OUT/moe_kernels.json
         run moe_bench ${MOE_TIMEOUT:-540} python3 ${BENCH:-bench}/moe_gpu_bench.py bench $M $OUT/moe_bench.json ${MOE_BENCH_ARGS:-}
         # MOE_BEFORE=dir: the same bench on an earlier prep's libraries (before / after in one call)
         [ -n "${MOE_BEFORE:-}" ] && run moe_bench_before ${MOE_TIMEOUT:-540} python3 ${BENCH:-bench}/moe_gpu_bench.py bench $MOE_BEFORE $OUT/moe_bench_before.json ${MOE_BENCH_ARGS:-}; } ;;
    script) run ${SCRIPT_NAME:-script} ${SCRIPT_TIMEOUT:-300} python3 $SCRIPT ;;  # SCRIPT="path/to/x.py args" (with SNAP=dir: a branch's package)
    moebench) [ -d ${MOE_DIR:-.gpu/moe} ] && run moe_bench ${MOE_TIMEOUT:-540} python3 ${BENCH:-bench}/moe_gpu_bench.py bench ${MOE_DIR:-.gpu/moe} $OUT/moe_bench.json ${MOE_BENCH_ARGS:-} ;;
    hf) (unset PYTHONPATH TVM_USE_RUNTIME_LIB; run hf 400 python3 bench/hf_gpu_baseline.py $OUT/hf.json ${HF_ARGS:---ctx 8192 --batches 8 --steps 4 --prefill 0}) ;;
    sass)
      { for f in .gpu/sass/*.fatbin; do
          [ -f "$f" ] || continue
          echo "== $f"; cuobjdump -sass "$f" > /tmp/sass.txt 2>&1
          echo "-- tensor-core / FP4 ops:"; grep -oE '\b(OMMA|QMMA|HMMA|HGMMA|UTC[A-Z0-9]*|IMMA)[A-Z0-9_.]*' /tmp/sass.txt | sort | uniq -c
          echo "-- functions with OMMA/QMMA:"; awk '/Function :/{fn=$3} /OMMA|QMMA/{print fn}' /tmp/sass.txt | sort | uniq -c | head
        done; } > $OUT/sass.txt 2>&1
      echo "== sass $(wc -l < $OUT/sass.txt) lines" | tee -a $OUT/summary.txt ;;
  esac
done
echo; echo "######## tails"; for f in $OUT/*.log; do echo "---- $f"; grep -v Warning $f | tail -${TAIL:-14}; done
echo "######## summary ($(( $(date +%s) - T0 ))s)"; cat $OUT/summary.txt
