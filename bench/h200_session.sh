#!/usr/bin/env bash
# One device call per mode (run from the repo root on the H200, .whl carried). Results and logs go
# to $OUT: run.log plus results.tgz (bench/results/*-$SUF* and the tile tables), fetched back here.
#   SUF=<commit> bash bench/h200_session.sh kernels   # build, GPU tests, tile search, ATMM + switch benches
#   SUF=<commit> bash bench/h200_session.sh engine    # GPU tests, §3 engine bench (+ profile, A/B runs), scale bench
#   bash bench/h200_session.sh profile                 # ncu of the kernels (bench.profile_kernels)
#   SUF=<commit> bash bench/h200_session.sh layers    # LoRA cost per projection by method + engine kernel tables
#   (engine: SEARCH=1 [BEFORE_SEARCH=1: the engine on the committed table first] SEARCH_SHAPES/RANKS/TOKENS
#    or SEARCH_SPECS="HxN:RANK ..." with SEARCH_TOKENS, SEARCH_BUDGET_S,
#    SKIP_EXPAND=1 skips bench/expand_bench.py)
#   SUF=<commit> bash bench/h200_session.sh multigpu  # (2+ GPUs) TP GPU tests (+GPU_TESTS), 7B worker scaling, TP worker,
#                                                     # 13B-like engine at TP 1 and N, 13B-shape TP layer bench
#   SUF=<commit> bash bench/h200_session.sh serve     # docs/workloads.md: mixed-vision on one GPU, closed loop
#                                                     # CONC (128) x2 then Poisson RATE (30 req/s) x2, REQUESTS (1024) a run
#   (serve: SERVE_ARGS adds serve_bench options, e.g. "--env VALORA_MAX_PREFILLS_PER_STEP=8"; SERVE_S bounds it, 420 s;
#    PYSPY=1 samples the worker, TRACE=1 writes and sums up the engine's step trace)
#   SUF=<commit> SERVE_CONFIGS="a:<args>|b:<args>" bash bench/h200_session.sh serve-ab  # serve runs per worker setting
#   SUF=<commit> bash bench/h200_session.sh long      # bench/long_context_bench.py (7B shape, one 16k request)
#   SUF=<commit> STEP_CONFIGS="a:|walk:VALORA_SAMPLER_TRIES=6" bash bench/h200_session.sh steps
#                                                     # bench.step_profile once per environment (STEP_ARGS: its options)
#   SUF=<commit> bash bench/h200_session.sh paged     # paged KV: GPU tests, paged decode/prefill attention benches, §3 engine bench
#                                                     # (valora only) and its 32-adapter r8 batch-32 variant
#   SUF=<commit> LOADS="8:8" bash bench/h200_session.sh orchestration  # issue 23, docs/workloads.md two-app: the 7B
#                                                     # worker under valora, slora, punica, dlora; per "streams:rate" load
#   (orchestration: ORCH_ARGS adds orchestration_bench options; ORCH_S bounds each load, 420 s; DURATION (60) and
#    WARMUP_S (10) are seconds per policy: at the defaults one load fills a call)
#   SUF=<commit> bash bench/h200_session.sh release   # issue 23: early release's throughput x per setting (random 7B
#                                                     # adapters: accuracy needs trained ones), bench/release_bench.py
#   SUF=<commit> bash bench/h200_session.sh generation  # issue 24: the generator's LoRA training on the GPU in bf16
#                                                     # (tiny base pretrained here, the built-in tasks, --compare)
set -uo pipefail
MODE=${1:?kernels|engine|profile|layers|multigpu|serve|serve-ab|long|steps|paged|orchestration|release|generation}
SUF=${SUF:-run}
OUT=${OUT:-/tmp/valora_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHL:-.whl}/*.whl \
  || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # lent hosts: multicast off
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VALORA_KERNELS_CACHE=/tmp/valora_kernels MAX_JOBS=16 VALORA_GIT_COMMIT=$SUF
LOG=$OUT/run.log
# results are named by the card that ran them (the device tool lends H100s as well as H200s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E "h100|h200|a100|l40s" | tr A-Z a-z)
GPU=${GPU:-gpu}
t0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
python3 -m kernels.build >> "$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
say build
if [ "$MODE" = profile ]; then  # ncu of the ATMM and switch kernels
  timeout 120 python3 -m bench.profile_kernels 2>&1 | tail -40
  python3 - > "$OUT/reject.log" 2>&1 <<'PY'
import re, subprocess, sys
src = open("tests/gpu/test_kernels_gpu.py").read()
script = re.search(r'_REJECT_SCRIPT = r"""(.*?)"""', src, re.S).group(1)
r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True)
print(r.returncode); print(r.stdout); print(r.stderr[:6000])
PY
  head -c 3000 "$OUT/reject.log"
  timeout 200 ncu --clock-control none -k regex:'atmm|switch' --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 -m bench.profile_kernels --once > "$OUT/ncu.txt" 2>&1
  grep -E "atmm_|switch_kernel|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Duration|Waves Per SM|Grid Size" "$OUT/ncu.txt" | head -120
  say profile
elif [ "$MODE" = kernels ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_kernels_atmm.py 2>&1 | tail -25 | tee -a "$LOG"
  say tests
  timeout 90 python3 -m kernels.tile_search --shapes 4096x4096 --ranks 16,64 --tokens 16,64,256 --segments 16,64 \
    --merge --budget-s 60 --validate 2 --name "tile_search_$SUF" 2>&1 | grep -v "━" | tail -8 | tee -a "$LOG"
  say search
  timeout 120 python3 -m bench.atmm_bench --suite headline --suffix "$SUF" --name "atmm_headline_$SUF" \
    --methods atmm,atmm_fused,atmm_nopdl,triton_sgmv,gather_bmm,padded_bmm,grouped_mm,loop 2>&1 | tail -24 | tee -a "$LOG"
  say atmm_bench
  timeout 120 python3 -m bench.switch_bench --suffix "$SUF" 2>&1 | tail -30 | tee -a "$LOG"
  say switch_bench
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* kernels/tile_tables/*.json 2>/dev/null
elif [ "$MODE" = layers ]; then  # where the mixed-adapter step's extra time goes
  timeout 200 python3 -m bench.lora_layer_bench --name "lora_layer-$SUF" 2>&1 | tee -a "$LOG"
  say lora_layer_bench
  timeout 300 python3 -m bench.engine_bench --skip-peer --reps 3 --name "engine-$SUF-profile" \
    --profile "${PROFILE:-base,unmerged_mixed}" ${AB:-} 2>&1 | grep -v -E "Loading|Writing" | tee -a "$LOG"
  say engine_bench
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = multigpu ]; then  # issue 10 on a host of NGPU (default 2) GPUs
  NGPU=${NGPU:-2}
  nvidia-smi topo -m >> "$LOG" 2>&1
  [ -n "${SKIP_TESTS:-}" ] || timeout -s INT "${TESTS_S:-200}" python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_tp_engine_gpu.py ${GPU_TESTS:-} ${TESTS_K:+-k "$TESTS_K"} > "$OUT/tests.log" 2>&1; tail -8 "$OUT/tests.log" | tee -a "$LOG"
  say tests
  # 7B workers, one per GPU (the issue's scaling), then one worker over all NGPU GPUs (tensor parallel)
  W=1; WS=1; while [ $(( W * 2 )) -le "$NGPU" ]; do W=$(( W * 2 )); WS="$WS,$W"; done
  WS=${WORKERS:-$WS}
  if [ -n "${PYSPY:-}" ]; then  # the busiest worker's threads sampled by py-spy (.whl) while it serves
    # once the run with PYSPY_WORKERS (default: the largest count) workers starts its measured requests
    # (scale_bench writes their pids to $MARK/measuring-N; fixed delays caught idle workers), PYSPY_DELAY s
    # more, then the one with the most CPU over one second
    MARK=/tmp/scale_marks; rm -rf "$MARK"; mkdir -p "$MARK"; export SCALE_BENCH_MARK_DIR=$MARK
    ( f=$MARK/measuring-${PYSPY_WORKERS:-$NGPU}; for _ in $(seq 900); do [ -s "$f" ] && break; sleep 1; done
      sleep "${PYSPY_DELAY:-1}"
      P=$(python3 -c 'import sys, time
pids = open(sys.argv[1]).read().split()
def cpu(p):
    try:
        f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except OSError:
        return 0
a = {p: cpu(p) for p in pids}; time.sleep(1); print(max(pids, key=lambda p: cpu(p) - a[p]))' "$f")
      echo "sampling worker $P"; /tmp/site/bin/py-spy record --threads --idle --nonblocking -r 50 -d "${PYSPY_S:-15}" \
        -f raw -o "$OUT/worker-pyspy.txt" --pid "$P" ) > "$OUT/pyspy.log" 2>&1 &
    PYSPY_PID=$!
  fi
  # SCALE_ARGS: more scale_bench options, e.g. "--load-per-worker" (concurrency, requests per worker)
  SCALE="--device cuda --arch qwen2-vl-7b --atmm --requests ${REQUESTS:-256} --concurrency ${CONC:-64} --image-size 448 --max-batch-size 32 --env VALORA_MAX_PREFILLS_PER_STEP=8 ${SCALE_ARGS:-}"
  top -b -d 2 -c -w 200 -o %CPU | awk '/^top -/{n=0} n++ < 24 {print; fflush()}' > "$OUT/top.log" 2>&1 &  # who saturates
  TOP=$!
  timeout -s TERM 240 python3 -m bench.scale_bench $SCALE --workers "$WS" --out "bench/results/scale-7b-h200x$NGPU-$SUF.json" \
    2>&1 | tail -16 | tee -a "$LOG"
  say scale_bench
  # A/B: the same with extra service environment, e.g. SCALE_ENV="OMP_NUM_THREADS=4"
  for kv in ${SCALE_ENV:-}; do
    timeout -s TERM 240 python3 -m bench.scale_bench $SCALE --workers "$WS" --env "$kv" \
      --out "bench/results/scale-7b-h200x$NGPU-$SUF-${kv%%=*}.json" 2>&1 | tail -8 | tee -a "$LOG"
    say "scale_bench $kv"
  done
  kill $TOP
  [ -z "${PYSPY:-}" ] || { wait "$PYSPY_PID"; python3 -m bench.pyspy_summary "$OUT/worker-pyspy.txt" --threads 4 --top 40 --match valora-engine \
    > "$OUT/worker-pyspy-summary.txt" 2>&1; gzip -f "$OUT/worker-pyspy.txt"; }
  [ -n "${SKIP_SCALE_TP:-}" ] || timeout -s TERM 150 python3 -m bench.scale_bench $SCALE --workers 1 --tp "$NGPU" \
    --out "bench/results/scale-7b-tp$NGPU-h200x$NGPU-$SUF.json" 2>&1 | tail -12 | tee -a "$LOG"
  say scale_bench_tp
  # the engine itself (decode CUDA graphs with the all-reduces inside) on the 13B-like shape, TP 1 then NGPU
  [ -n "${SKIP_ENGINE_TP:-}" ] || for t in 1 "$NGPU"; do
    timeout "${ENGINE_TP_S:-300}" python3 -m bench.engine_bench --arch qwen2-vl-13b-like --tp "$t" --reps "${REPS:-3}" --skip-peer \
      --name "engine-13b-tp$t-h200x$NGPU-$SUF" 2>&1 | grep -v -E "Loading|Writing" | tail -8 | tee -a "$LOG"
    say "engine_bench tp $t"
  done
  [ -n "${SKIP_TP_BENCH:-}" ] || timeout 240 python3 -m bench.tp_bench --gpus "$NGPU" --atmm auto --reps "${REPS:-5}" \
    --name "scale-tp-h200x$NGPU-$SUF" 2>&1 | tail -16 | tee -a "$LOG"
  say tp_bench
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = serve ]; then  # issue "Engine v2": the 7B worker (random weights) behind the public API
  # ~20 s start + ~25 s images/adapters + warm-up, then 4 runs of ~25-70 s each (1024 requests at 40-15 req/s;
  # Poisson 1024 arrivals over 34 s, longer when the worker falls behind); SIGTERM at SERVE_S still writes the rows
  # PYSPY=1 (py-spy in .whl): PYSPY_DELAY s (5) after measured run PYSPY_RUN (1) starts (serve_bench writes
  # the worker's pid to $MARK/measuring-N; a fixed delay from the start once caught the worker idle), the
  # worker's threads sampled for PYSPY_S s -> $OUT/worker-pyspy-summary.txt (where the engine thread's time goes)
  if [ -n "${PYSPY:-}" ]; then
    MARK=/tmp/serve_marks; rm -rf "$MARK"; mkdir -p "$MARK"; export SERVE_BENCH_MARK_DIR=$MARK
    ( for _ in $(seq "${SERVE_S:-420}"); do [ -f "$MARK/measuring-${PYSPY_RUN:-1}" ] && break; sleep 1; done
      [ -f "$MARK/measuring-${PYSPY_RUN:-1}" ] || { echo "no measured run started"; exit 0; }
      sleep "${PYSPY_DELAY:-5}"
      P=$(cat "$MARK/measuring-${PYSPY_RUN:-1}"); echo "sampling worker $P"
      /tmp/site/bin/py-spy record --threads --idle --nonblocking -r 50 -d "${PYSPY_S:-20}" -f raw \
        -o "$OUT/worker-pyspy.txt" --pid "$P"
      python3 -m bench.pyspy_summary "$OUT/worker-pyspy.txt" --threads 4 --top 40 --match valora-engine \
        > "$OUT/worker-pyspy-summary.txt" 2>&1; gzip -f "$OUT/worker-pyspy.txt" ) > "$OUT/pyspy.log" 2>&1 &
  fi
  # TRACE=1: the engine's step trace (VALORA_STEP_TRACE), summarised over measured run PYSPY_RUN (1)'s first
  # TRACE_S (30) s -> $OUT/steps-summary.json (each phase's host and device time, the queues)
  TRACE_ARGS=""; [ -z "${TRACE:-}" ] || { rm -f /tmp/steps.jsonl; TRACE_ARGS="--env VALORA_STEP_TRACE=/tmp/steps.jsonl"
    [ -n "${PYSPY:-}" ] || { MARK=/tmp/serve_marks; rm -rf "$MARK"; mkdir -p "$MARK"; export SERVE_BENCH_MARK_DIR=$MARK; }; }
  OUT="$OUT" timeout -s TERM "${SERVE_S:-420}" python3 -m bench.serve_bench --device cuda --arch qwen2-vl-7b --atmm \
    --dtype bfloat16 --concurrency "${CONC:-128}" --rate "${RATE:-30}" --requests "${REQUESTS:-1024}" --repeat 2 \
    --out "bench/results/serve-$GPU-$SUF.json" $TRACE_ARGS ${SERVE_ARGS:-} 2>&1 | grep -v "━" | tail -30 | tee -a "$LOG"
  say serve_bench
  [ -z "${TRACE:-}" ] || { python3 -m bench.step_trace_summary /tmp/steps.jsonl --duration "${TRACE_S:-30}" \
    --start "$(stat -c %Y "$MARK/measuring-${PYSPY_RUN:-1}")" --json "$OUT/steps-summary.json" | tee -a "$LOG"
    gzip -c /tmp/steps.jsonl > "$OUT/steps.jsonl.gz"; }
  # the services' warnings and errors, counted by event (the cluster's home is kept: /tmp/valora-serve-*)
  cat /tmp/valora-serve-*/logs/*.log 2>/dev/null | grep -E "warning|error" | sed -E 's/^[0-9 :-]+//' | cut -c1-300 \
    | sort | uniq -c | sort -rn | head -60 > "$OUT/service-warnings.txt"
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = serve-ab ]; then  # several worker settings in one call, each a serve run of its own:
  # SERVE_CONFIGS="name:serve_bench args|name2:args2" (SERVE_ARGS: common to all), results under $OUT/<name>
  # with SUF <commit>-<name>, e.g. SERVE_CONFIGS="b4:--env VALORA_MAX_PREFILLS_PER_STEP=4|fill:--env
  # VALORA_MAX_PREFILLS_PER_STEP=8 --env VALORA_MAX_PREFILL_TOKENS=2048 --env VALORA_PREFILL_FILL_PADDING=1"
  IFS='|' read -ra CFGS <<< "${SERVE_CONFIGS:?name:args|...}"
  for c in "${CFGS[@]}"; do
    OUT="$OUT/${c%%:*}" SUF="$SUF-${c%%:*}" SERVE_ARGS="${SERVE_ARGS:-} ${c#*:}" bash "$0" serve
    say "serve ${c%%:*}"
  done
elif [ "$MODE" = orchestration ]; then  # issue 23: video analytics + visual retrieval under every policy
  # ~20 s start + adapters, then per policy: scheduler restart (~2 s), ~3000 images drawn, warm-up (WARMUP_S + every task
  # once), the DURATION s schedule; SIGTERM at ORCH_S still writes the rows of the policies done
  for load in ${LOADS:-8:8}; do
    streams=${load%%:*}; rate=${load#*:}
    OUT="$OUT" timeout -s TERM "${ORCH_S:-420}" python3 -m bench.orchestration_bench --device cuda --arch qwen2-vl-7b \
      --atmm --dtype bfloat16 --streams "$streams" --rate "$rate" --duration "${DURATION:-60}" --warmup-s "${WARMUP_S:-10}" \
      --out "bench/results/orchestration-$GPU-$SUF-s${streams}r${rate}.json" ${ORCH_ARGS:-} 2>&1 | grep -v "━" | tail -24 \
      | tee -a "$LOG"
    say "orchestration_bench $load"
  done
  # the services' warnings and errors, counted by event (a failed run keeps its home: /tmp/valora-orchestration-*)
  cat /tmp/valora-orchestration-*/logs/*.log 2>/dev/null | grep -E "warning|error" | sed -E 's/^[0-9 :-]+//' \
    | cut -c1-300 | sort | uniq -c | sort -rn | head -60 > "$OUT/service-warnings.txt"
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = release ]; then  # issue 23: early adapter release measured on the 7B worker
  OUT="$OUT" timeout -s TERM "${RELEASE_S:-420}" python3 -m bench.release_bench --device cuda --arch qwen2-vl-7b --atmm \
    --dtype bfloat16 --out "bench/results/release-$GPU-$SUF.json" ${RELEASE_ARGS:-} 2>&1 | grep -v "━" | tail -24 | tee -a "$LOG"
  say release_bench
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = generation ]; then  # issue 24: training on the GPU (bf16 weights, float32 LoRA)
  M=/tmp/tiny-qwen2-vl
  python3 -m services.worker.tiny_model "$M" >> "$LOG" 2>&1 && python3 -m services.generator pretrain --model-path "$M" \
    --out /tmp/tiny-pretrained >> "$LOG" 2>&1
  say pretrain
  timeout "${GEN_S:-420}" python3 -m services.generator generate --model-path /tmp/tiny-pretrained --out /tmp/gen-out \
    --device cuda --dtype bfloat16 --compare --results "bench/results/generation-$GPU-$SUF.json" ${GEN_ARGS:-} 2>&1 \
    | grep -v "━" | tail -30 | tee -a "$LOG"
  say generate
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = long ]; then  # issue "Engine v2": 31 streams beside one 16k-token request at batch 32
  timeout "${LONG_S:-300}" python3 -m bench.long_context_bench --name "long-context-$GPU-$SUF" 2>&1 \
    | grep -v -E "Loading|Writing" | tail -120 | tee -a "$LOG"
  say long_context_bench
elif [ "$MODE" = steps ]; then  # where a served step's device time goes, per worker environment
  IFS='|' read -ra CFGS <<< "${STEP_CONFIGS:-default:}"
  for c in "${CFGS[@]}"; do
    env ${c#*:} timeout "${STEP_S:-240}" python3 -m bench.step_profile --graphs auto --rows 110 --top-p-every 2 \
      --name "step-profile-$SUF-${c%%:*}" ${STEP_ARGS:-} 2>&1 | grep -v -E "Loading|Writing" | tail -40 | tee -a "$LOG"
    say "step_profile ${c%%:*}"
  done
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = paged ]; then  # issue "Engine v2", first slice: paged KV + graphs keyed by batch bucket
  [ -n "${SKIP_TESTS:-}" ] || timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_paged_attention_gpu.py \
    tests/gpu/test_paged_prefill_gpu.py tests/gpu/test_decode_graphs_gpu.py tests/gpu/test_prefill_gpu.py tests/unit/test_engine.py tests/unit/test_kv_cache.py \
    tests/unit/test_decode_graphs.py ${GPU_TESTS:-} > "$OUT/tests.log" 2>&1; tail -12 "$OUT/tests.log" | tee -a "$LOG"
  say tests
  timeout 150 python3 -m bench.paged_attention_bench --name "paged-attention-$SUF" 2>&1 | tail -30 | tee -a "$LOG"
  say paged_attention_bench
  timeout 150 python3 -m bench.paged_prefill_bench --name "paged-prefill-$SUF" 2>&1 | tail -30 | tee -a "$LOG"
  say paged_prefill_bench
  timeout 240 python3 -m bench.engine_bench --skip-peer --reps "${REPS:-5}" --name "engine-$SUF" 2>&1 \
    | grep -v -E "Loading|Writing" | tail -14 | tee -a "$LOG"
  say engine_bench
  [ -n "${SKIP_WIDE:-}" ] || timeout 200 python3 -m bench.engine_bench --skip-peer --reps 3 --adapters 32 --rank 8 --batch 32 \
    --name "engine-$SUF-a32r8b32" 2>&1 | grep -v -E "Loading|Writing" | tail -14 | tee -a "$LOG"
  say engine_bench_wide
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
elif [ "$MODE" = engine ]; then
  [ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_layer_ops_gpu.py tests/gpu/test_prefill_gpu.py \
    tests/gpu/test_decode_graphs_gpu.py tests/unit/test_engine.py tests/gpu/test_kernels_gpu.py ${GPU_TESTS:-} \
    -k "gpu or graphs or atmm or switcher" > "$OUT/tests.log" 2>&1; tail -8 "$OUT/tests.log" | tee -a "$LOG"
  say tests
  [ -n "${SKIP_EXPAND:-}" ] || timeout 120 python3 -m bench.expand_bench --name "expand-$SUF" 2>&1 | tee -a "$LOG"
  say expand_bench
  if [ -n "${SEARCH:-}" ] && [ -n "${BEFORE_SEARCH:-}" ]; then  # the engine on the committed table first (A/B)
    timeout 200 python3 -m bench.engine_bench --skip-peer --reps "${REPS:-5}" --name "engine-$SUF-before-search" 2>&1 \
      | grep -E "^valora|x[0-9.]+ of" | tee -a "$LOG"
    say "engine_bench before search"
  fi
  if [ -n "${SEARCH:-}" ]; then  # buckets of the 7B shapes (8 adapters), merged into the table the engine reads
    # (default: the projection groups' shapes — q|k|v 3584x4608, gate|up 3584x37888 — at their summed ranks)
    # SEARCH_SPECS="HxN:RANK ..." searches one shape at one rank each (no shapes x ranks cross product)
    for spec in ${SEARCH_SPECS:-"${SEARCH_SHAPES:-3584x4608,3584x37888}:${SEARCH_RANKS:-32,48,64,96}"}; do
      timeout 150 python3 -m kernels.tile_search --shapes "${spec%%:*}" --ranks "${spec##*:}" \
        --tokens "${SEARCH_TOKENS:-16,4096}" --segments 16 --merge --budget-s "${SEARCH_BUDGET_S:-120}" --validate "${SEARCH_VALIDATE:-1}" \
        --name "tile_search_groups_$SUF-${spec%%:*}" 2>&1 | grep -v "━" | tail -4 | tee -a "$LOG"
    done
    cp kernels/tile_tables/nvidia_h200-sm90-bfloat16.json "$OUT/"  # the merged table, to commit
    say search
  fi
  timeout 400 python3 -m bench.engine_bench --name "engine-$SUF" --reps "${REPS:-5}" --profile "${PROFILE:-base,unmerged_mixed}" 2>&1 \
    | grep -v -E "Loading|Writing" | tee -a "$LOG"
  say engine_bench
  # A/B: the same engine with one optimisation off per run (valora only), e.g. AB="--no-fused-layers --no-shrink-overlap"
  for flag in ${AB:-}; do
    timeout 200 python3 -m bench.engine_bench --skip-peer --reps "${REPS:-5}" --name "engine-$SUF$flag" $flag 2>&1 \
      | grep -E "^valora|x[0-9.]+ of" | tee -a "$LOG"
    say "engine_bench $flag"
  done
  [ -n "${SKIP_SCALE:-}" ] || timeout -s TERM 100 python3 -m bench.scale_bench --device cuda --dtype float32 --workers 1,2,4 --requests 128 \
    --warmup 32 --concurrency 32 --max-new-tokens 16 --out "bench/results/scale-$SUF.json" 2>&1 | tail -20 | tee -a "$LOG"
  say scale_bench
  tar czf "$OUT/results.tgz" bench/results/*"$SUF"* 2>/dev/null
fi
say done
