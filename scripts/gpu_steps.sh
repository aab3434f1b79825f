#!/usr/bin/env bash
# The GPU suite and the CUDA benches in named groups, under one time budget: for a GPU
# machine lent by the minute, where one call cannot run `scripts/test.sh -m gpu` whole.
#
#   scripts/gpu_steps.sh BUDGET_S LOG_DIR STEP...      e.g. 550 "$OUT" tf harden lease rtt
#
# Uses the python3 on PATH, with gpumemd (and the engines' packages) importable. Each step
# runs with what is left of the budget (stopped by SIGINT, so pytest still prints its
# summary); a step with under 30 s left is not started. LOG_DIR gets two files: steps.log
# (every step's output, each under a header) and summary.txt (a line per step: its exit
# status, seconds, pytest's summary or the bench's JSON line).
set -uo pipefail
if [ $# -lt 3 ]; then sed -n 2,11p "$0"; echo "steps: $(sed -n 's/^  \([a-z0-9-]*\)) .*/\1/p' "$0" | tr '\n' ' ')"; exit 2; fi
budget=$1 logs=$2; shift 2
cd "$(dirname "$0")/.." && mkdir -p "$logs" || exit 1
export PYTHONUNBUFFERED=1
start=$SECONDS
PT=(python3 -m pytest -p no:cacheprovider -q -rfEsP --timeout 900 -m gpu)
G=tests/integration
# The GPU tests that the groups below name; `rest` runs every other one.
TF=($G/test_transformers_gpu.py $G/test_transformers_serve_gpu.py)
ENGINES=($G/test_engine_gpu.py $G/test_engine_sleep.py $G/test_nanovllm_follow.py $G/test_sleep.py $G/test_sleep_gpu.py
         $G/test_standby.py $G/test_standby_gpu.py $G/test_failover.py $G/test_kv_moves.py $G/test_burst.py)
HARDEN=($G/test_retain.py $G/test_pid_namespaces.py $G/test_tenant_caps.py $G/test_slow_readers.py $G/test_control_errors.py
        $G/test_borrow.py $G/test_lease_segments.py $G/test_lease_memops.py $G/test_cross_process.py)

step() {  # NAME COMMAND...
    local name=$1; shift
    local left=$((budget - (SECONDS - start))) t0=$SECONDS rc
    if [ $left -lt 30 ]; then echo "$name: not run (budget spent)" | tee -a "$logs/summary.txt"; return; fi
    echo "===== $name: $*" >>"$logs/steps.log"
    timeout -s INT -k 20 $left "$@" >"$logs/.step" 2>&1; rc=$?
    cat "$logs/.step" >>"$logs/steps.log"
    echo "$name rc=$rc $((SECONDS - t0))s :: $(grep -E '(passed|failed|error)' "$logs/.step" | tail -1) $(tail -1 "$logs/.step" | cut -c1-1500)" | tee -a "$logs/summary.txt"
    rm -f "$logs/.step"
}

for s in "$@"; do case $s in
  tf) step tf "${PT[@]}" "${TF[0]}" ;;
  serve) step serve "${PT[@]}" "${TF[1]}" ;;
  engines) step engines "${PT[@]}" "${ENGINES[@]}" ;;
  harden) step harden "${PT[@]}" "${HARDEN[@]}" ;;
  rest) step rest "${PT[@]}" tests $(printf -- '--ignore=%s ' "${TF[@]}" "${ENGINES[@]}" "${HARDEN[@]}") ;;
  rtt) step rtt python3 bench/control_rtt.py --backend cuda ;;
  rtt-pinned) step rtt-pinned python3 bench/control_rtt.py --backend cuda --cpus 2:4 ;;
  lease) step lease python3 bench/lease.py --backend cuda ;;
  orderings) step orderings python3 bench/lease_orderings.py --backend cuda ;;
  fairness) step fairness python3 bench/fairness.py --backend cuda ;;
  fair200) step fair200 python3 bench/fairness.py --backend cuda --flooders 1 --sessions 200 ;;
  fuzz) step fuzz python3 bench/fuzz.py --backend cuda --cases 20000 ;;
  restart) step restart python3 bench/restart.py --backend cuda ;;
  engine-nv) step engine-nv python3 bench/engine.py --backend cuda --engine nanovllm ;;
  engine-tf) step engine-tf python3 bench/engine.py --backend cuda --engine transformers ;;
  burst) step burst python3 bench/burst.py --backend cuda ;;
  burst-tf) step burst-tf python3 bench/burst.py --backend cuda --engine transformers ;;
  sleep-tf) step sleep-tf python3 bench/sleep.py --backend cuda --engine transformers ;;
  failover) step failover python3 bench/failover.py --backend cuda ;;
  failover-tf) step failover-tf python3 bench/failover.py --backend cuda --engine transformers ;;
  *) echo "$s: no such step" | tee -a "$logs/summary.txt" ;;
esac; done
