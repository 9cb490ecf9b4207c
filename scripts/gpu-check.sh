#!/usr/bin/env bash
# The CUDA checks of issue 9, as one command for the GPU machine (../shared/gpu.md). Run from the repository root
# there, with the wheels of the packages its image lacks in .whl/ (torchdata, chanfig, lazy-imports, gitpython, gitdb,
# smmap: see gpu.md for the download line). Writes its logs and the benchmark's results under $OUT (default ./gpu-out).
#
#   bash scripts/gpu-check.sh [tests|bench|stall|profile|suite|checks]...     # default: stall checks
#
#   tests   tests/cuda (kill -9 + rerun bit-exact on the GPU, pinned staging, staging on the device first)
#   bench   benchmarks/gpu.py (runner vs hand loop, async vs sync stall of a 435M GPT)
#   stall   the stall part alone: 5 saves 90 steps apart, what each save call spent its time on
#   between 2 saves 150 steps apart, 301 steps: the steps while the writer writes against the same steps without saves
#   profile the same, with torch.profiler traces (chrome format) of the steps around the second save in $OUT/traces
#   suite   the single-process tests that resume, with CUDA visible (DDP tests run on gloo with CUDA hidden elsewhere;
#           the random-kill tests, 60 processes, are left to tests/cuda's kill-and-resume cases)
#   checks  tests and suite at once (16 cores: 4 + 10 pytest workers), after the stall, which wants the machine alone
#
# One `run` may take 600 s and a session has 15 minutes of device time, start included: `stall checks` fits one
# call (each step's timeout: 330 + 240 s); `profile` wants a call of its own.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 WANDB_MODE=offline

if ! python3 -c "import perdure" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(stall checks)
SUITE=(tests/test_resume.py tests/faults/test_kills.py tests/faults/test_signals.py tests/test_pending_losses.py
       tests/test_staging.py tests/test_device_path.py tests/test_determinism.py tests/test_examples.py
       tests/test_evaluation.py tests/test_compile.py tests/test_inspection.py tests/test_requeue.py
       tests/test_corruption.py tests/test_sample_seeds.py tests/test_writer_process_buffers.py)
summary() { grep -E "FAILED|ERROR|passed|failed" "$1" | tail -40; }
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      timeout 150 python3 -m pytest -v -p no:cacheprovider -n 5 tests/cuda > "$OUT/cuda-tests.log" 2>&1
      summary "$OUT/cuda-tests.log"
      ;;
    bench)
      timeout 330 python3 benchmarks/gpu.py 2>&1 | tee "$OUT/gpu-bench.log"
      cp bench-results/gpu.json "$OUT/" 2>/dev/null
      ;;
    stall)  # 5 saves 90 steps apart (a sync save of the 435M GPT: 6.5 s on an H100, 7 s on an H200)
      timeout 330 python3 benchmarks/gpu.py --skip-steps --stall-steps 451 --interval 90 \
        --stall-modes none,disabled,thread,process 2>&1 | tee "$OUT/gpu-stall.log" | grep -v '^stall [a-z-]*: loop'
      cp bench-results/gpu.json "$OUT/gpu-stall.json" 2>/dev/null
      ;;
    between)  # do the steps slow down while the writer writes? 2 saves 150 steps apart, every step's time kept
      timeout 300 python3 benchmarks/gpu.py --skip-steps --stall-steps 301 --interval 150 \
        --stall-modes none,disabled,thread,process 2>&1 | tee "$OUT/gpu-between.log" | grep -v '^stall [a-z-]*: loop'
      cp bench-results/gpu.json "$OUT/gpu-between.json" 2>/dev/null
      python3 - "$OUT/gpu-between.json" <<'PY' | tee -a "$OUT/gpu-between.log"
import json, statistics, sys
ranges = [(1, 50), (50, 100), (100, 148), (152, 200), (200, 240), (245, 298)]
print("median step ms in steps", ", ".join(f"{a}-{b}" for a, b in ranges), "(writer busy from 152 to about 240)")
for mode, run in json.load(open(sys.argv[1]))["results"]["stall"].items():
    steps = run["step_ms"]
    print(f"{mode:10}", "  ".join(f"{statistics.median(steps[a:b]):6.1f}" for a, b in ranges))
PY
      ;;
    profile)  # the stall runs again, with torch.profiler traces of the steps around the second save in $OUT/traces
      timeout 300 python3 benchmarks/gpu.py --skip-steps --stall-steps 271 --interval 90 --profile "$OUT/traces" 2>&1 \
        | tee "$OUT/gpu-profile.log"
      gzip -f "$OUT"/traces/*.json 2>/dev/null
      ;;
    suite)
      timeout 180 python3 -m pytest -v -p no:cacheprovider -n 12 -k "not wandb and not random_kills" "${SUITE[@]}" \
        > "$OUT/suite.log" 2>&1
      summary "$OUT/suite.log"
      ;;
    checks)
      timeout 240 python3 -m pytest -v -p no:cacheprovider -n 4 tests/cuda > "$OUT/cuda-tests.log" 2>&1 &
      timeout 240 python3 -m pytest -v -p no:cacheprovider -n 10 -k "not wandb and not random_kills" "${SUITE[@]}" \
        > "$OUT/suite.log" 2>&1
      wait
      echo "== tests/cuda"; summary "$OUT/cuda-tests.log"
      echo "== suite"; summary "$OUT/suite.log"
      ;;
    *) echo "unknown step: $step" >&2 ;;
  esac
done
