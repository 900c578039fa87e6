#!/usr/bin/env bash
# Here, before a GPU session, from the repo root: cut CIFAR-10 into parts under .gpu/p00, .gpu/p01, ... that each
# travel in one device call beside the working tree (64 MiB a call for both), sized by what the tree weighs now.
# Usage: training/gpu/prepare.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
tree=$({ git ls-files -z; git ls-files -z -o --exclude-standard; } | du -cb --files0-from=- | tail -n 1 | cut -f1)
mib=$(( (60 * 1048576 - tree) / 1048576 )); [ $mib -le 40 ] || mib=40
if [ $mib -lt 8 ]; then
  echo "the working tree weighs $((tree / 1048576)) MiB: too much to carry parts beside it" >&2; exit 1
fi
echo "working tree: $((tree / 1048576)) MiB; parts of $mib MiB"
../shared/gpu/split-cifar10.sh .gpu "$mib"
