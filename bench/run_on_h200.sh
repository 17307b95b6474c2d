#!/usr/bin/env bash
# One device call: build the extension, run the GPU tests, search tiles, benchmark ATMM and the
# switcher. Logs and JSON land under $OUT (bench/results/ copies are written there too).
#   bash bench/run_on_h200.sh quick   # build + tests + small runs (validation)
#   bash bench/run_on_h200.sh full    # build + tests + tile search + full suites
#   SUF=<commit> bash bench/run_on_h200.sh backends  # build + tests + tile search over every backend
#                                     # (CUDA, CUTLASS grouped, Triton; ranks 16/64/128) + headline_ranks bench
# Needs the nvidia-cutlass wheel under .whl/ (carried).
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/valora_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VALORA_KERNELS_CACHE=/tmp/valora_kernels MAX_JOBS=16
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m kernels.build > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"; tail -1 "$OUT/build.log"
if [ "$MODE" = profile ]; then
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
  echo "total: $(( $(date +%s) - t0 )) s"; exit 0
fi
if [ "$MODE" = backends ]; then
  SUF=${SUF:-run}
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_kernels_atmm.py > "$OUT/tests.log" 2>&1
  tail -6 "$OUT/tests.log"; echo "tests: $(( $(date +%s) - t0 )) s"
  timeout 170 python3 -X faulthandler -m kernels.tile_search --ranks 16,64,128 --merge --budget-s 120 --validate 2 \
    --name "tile_search_$SUF" > "$OUT/search.log" 2>&1
  grep -v "━" "$OUT/search.log" | tail -8; echo "search: $(( $(date +%s) - t0 )) s"
  cp kernels/tile_tables/*.json "$OUT/" 2>/dev/null
  timeout 120 python3 -m bench.atmm_bench --suite headline_ranks --name "atmm_headline_$SUF" \
    --methods atmm,triton_sgmv,gather_bmm,padded_bmm,grouped_mm,loop 2>&1 | tee "$OUT/bench.log" | tail -18
  echo "total: $(( $(date +%s) - t0 )) s"; exit 0
fi
python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_kernels_atmm.py > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log"
if [ "$MODE" = quick ]; then
  timeout 120 python3 -m kernels.tile_search --shapes 4096x4096 --ranks 16 --tokens 16,1024 --segments 16 \
    --budget-s 30 --validate 2 --out "$OUT/tile_table_quick.json" 2>&1 | grep -v "━" | tail -8
  timeout 150 python3 -m bench.atmm_bench --suite quick 2>&1 | tail -12
  timeout 120 python3 -m bench.switch_bench --layers 4 --cycles 20 --reps 3 2>&1 | tail -12
elif [ "$MODE" = medium ]; then
  timeout 150 python3 -m kernels.tile_search --shapes 4096x4096 --ranks 16 --tokens 16,64,256,1024,4096 \
    --segments 16,64 --budget-s 90 --validate 3 2>&1 | grep -v "━" | tail -8
  cp kernels/tile_tables/*.json "$OUT/" 2>/dev/null
  timeout 200 python3 -m bench.atmm_bench --suite headline 2>&1 | tail -14
  timeout 150 python3 -m bench.switch_bench 2>&1 | tail -14
else
  timeout 230 python3 -X faulthandler -m kernels.tile_search --budget-s 140 --validate 8 2>&1 | grep -v "━" | tail -14
  cp kernels/tile_tables/*.json "$OUT/" 2>/dev/null
  timeout 200 python3 -m bench.atmm_bench --suite full 2>&1 | tail -30
  timeout 100 python3 -m bench.switch_bench 2>&1 | tail -14
fi
echo "total: $(( $(date +%s) - t0 )) s"
