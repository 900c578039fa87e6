#!/usr/bin/env bash
# On the GPU machine, in the first call (it needs no data): starts, detached, the checks only a GPU can run
# (tests/test_cuda.py and FlexAttention's gradients: every model, SA path and attention kernel on CUDA against the
# CPU, a bf16 training step each, torch.compile) into $CHECKS (/tmp/cuda-checks.txt); status.sh waits for them and
# prints their outcome. Extra ARGS go to pytest (e.g. -k aa_resnet20).
# Usage: training/gpu/cuda-checks.sh [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
checks=${CHECKS:-/tmp/cuda-checks.txt}
# in one process they took 594 s beside training in session 25: where pytest-xdist is there (the GPU machine has it),
# WORKERS processes (4; 1: one process) of 4 CPU threads each share the machine's 16 cores
workers=()
if [ "${WORKERS:-4}" -gt 1 ] && python3 -c 'import xdist' 2> /dev/null; then
  workers=(-n "${WORKERS:-4}"); export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi
# --durations: the slowest checks, to plan what a cold machine spends its first minutes on
PYTHONPATH=$PWD setsid nohup python3 -m pytest -m cuda -q -rs --durations=15 "${workers[@]}" \
  tests/test_cuda.py tests/test_layers_attention_kernels.py "$@" > "$checks" 2>&1 < /dev/null &
echo "cuda checks started (pid $!${workers:+, ${workers[1]} workers}): $checks"
