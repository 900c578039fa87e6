#!/usr/bin/env bash
# On the GPU machine: write the next parts of run NAME's weights (and EMA), its config.json and log.jsonl into
# $OUT/NAME for the device tool to bring back (at most 8 files, 64 MiB a call); it prints the START of the next call.
# `--weights ema` (or model), passed to `transfer export` in every call of the run, brings back only those, in half
# the calls: the last test in the run's log says which scored higher. `--checkpoint` brings back the training
# checkpoint itself, for a run that a later session resumes (prepare.sh --carry-run): the last epoch's, or, after
# `pkill -TERM -f -- "--output /tmp/runs/[N]AME"` and the run's exit, the last step's.
# Here: python -m timm_attnconv.transfer join runs/NAME <the files_at folders of the calls>/NAME ...
# Usage: training/gpu/collect.sh NAME [START] [--weights ema|model | --checkpoint]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
name=${1:?usage: collect.sh NAME [START] [--weights ema|model | --checkpoint]}; shift; runs=${RUNS:-/tmp/runs}
start=0; if [[ ${1:-} =~ ^[0-9]+$ ]]; then start=$1; shift; fi
out=${OUT:?OUT is unset: run this through the device tool}
# what the call already returns (a log, another run's parts) counts against its 8 files and 64 MiB
mkdir -p "$out"
read -r files bytes < <(find "$out" -type f -not -path "$out/$name/*" -printf '%s\n' |
                        awk '{n++; s += $1} END {print 8 - n, 64 * 1048576 - s}')
[ "$files" -gt 0 ] && [ "$bytes" -gt 0 ] ||
  { echo "\$OUT already holds 8 files or 64 MiB: collect $name in a call of its own" >&2; exit 1; }
python3 -m timm_attnconv.transfer export "$runs/$name" "$out/$name" --start "$start" --max-files "$files" \
  --max-bytes "$bytes" "$@"
