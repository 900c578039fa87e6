#!/usr/bin/env bash
# On the GPU machine: wait up to SECONDS (default 0) while any run is still training, cuda-checks.sh still checks or
# benchmark.sh still measures, then print the checks' outcome, the benchmark's last lines and each run's state and
# last log lines. A wait keeps the machine busy, so it is not given back while runs train between calls.
# Usage: training/gpu/status.sh [SECONDS] [NAME...]
set -uo pipefail
wait=0; if [[ ${1:-} =~ ^[0-9]+$ ]]; then wait=$1; shift; fi  # a NAME alone waits for nothing
runs=${RUNS:-/tmp/runs}
names=("$@"); [ ${#names[@]} -gt 0 ] || names=($(ls "$runs" 2>/dev/null))
checks=${CHECKS:-/tmp/cuda-checks.txt}
training() { pgrep -f -- "--output $runs/$1( |$)" > /dev/null; }
checking() { pgrep -f -- "pytest -m cuda" > /dev/null; }
bench=${BENCH_PID:-/tmp/benchmark.pid}  # benchmark.sh's pid and output file
# alive and not a zombie (one its parent has not yet waited for has ended)
benchmarking() { [ -f "$bench" ] && ps -o stat= -p "$(head -n 1 "$bench")" | grep -qv Z; }
end=$((SECONDS + wait))
while [ $SECONDS -lt $end ]; do
  busy=0; for n in "${names[@]}"; do training "$n" && busy=1; done; checking && busy=1; benchmarking && busy=1
  [ $busy = 1 ] || break
  sleep 5
done
nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total --format=csv,noheader 2>/dev/null
if [ -f "$checks" ]; then
  echo "== cuda checks: $(checking && echo running || echo done)"
  grep -E '^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|error)' "$checks" | tail -n 12
fi
if [ -f "$bench" ]; then
  echo "== benchmark: $(benchmarking && echo running || echo done)"
  tail -n 3 "$(sed -n 2p "$bench")"
fi
for n in "${names[@]}"; do
  d=$runs/$n
  echo "== $n: $(training "$n" && echo training || echo 'not running')"
  [ -f "$d/log.jsonl" ] && tail -n 3 "$d/log.jsonl" | python3 -c "
import json, sys
for line in sys.stdin:
    e = json.loads(line)
    shown = ('epoch', 'train_loss', 'lr', 'train_img_s', 'epoch_seconds', 'test_top1', 'ema_test_top1')
    print(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in e.items() if k in shown))"
  # the progress bar's last state and any error
  [ -f "$d/train.out" ] && tr '\r' '\n' < "$d/train.out" | grep -v '^\s*$' | tail -n 2
done
