#!/usr/bin/env bash
# On the GPU machine: write the next parts of run NAME's weights (and EMA), its config.json and log.jsonl into
# $OUT/NAME for the device tool to bring back (at most 8 files, 64 MiB a call); it prints the START of the next call.
# Here: python -m timm_attnconv.transfer join runs/NAME <the files_at folders of the calls>/NAME ...
# Usage: training/gpu/collect.sh NAME [START]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
name=${1:?usage: collect.sh NAME [START]}; runs=${RUNS:-/tmp/runs}
python3 -m timm_attnconv.transfer export "$runs/$name" "${OUT:?OUT is unset: run this through the device tool}/$name" \
  --start "${2:-0}"
