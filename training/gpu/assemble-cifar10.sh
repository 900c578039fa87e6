#!/usr/bin/env bash
# On the GPU machine, from the repo root, after the last part arrived: join the parts that
# ../shared/gpu/split-cifar10.sh cut (carried one per call into .gpu/p00, .gpu/p01, ...) into DEST/train.npz and
# DEST/test.npz, and check their sha256. Usage: training/gpu/assemble-cifar10.sh [PARTS] [DEST]
set -euo pipefail
parts=${1:-.gpu}; dest=${2:-/tmp/c10}
mkdir -p "$dest"
damaged="CIFAR-10 is incomplete or damaged: carry the missing parts again (the split printed how many; ls $parts)"
for split in train test; do
  # the parts' names sort in order (p00, p01, ...; train.npz.00, .01, ...)
  cat "$parts"/p*/"$split".npz.* > "$dest/$split.npz" 2> /dev/null || { echo "$damaged" >&2; exit 1; }
done
cd "$dest"
sha256sum -c - <<'SUMS' || { echo "$damaged" >&2; exit 1; }
23d61323f4f14668f90bf90a3900441f28c71ed45317335170d68792cb391e2c  train.npz
42eab41b33193fcbe9ec144ac4faf6963080608c16802be82712b84237de8713  test.npz
SUMS
