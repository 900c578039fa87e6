#!/usr/bin/env bash
# On the GPU machine, from the repo root, first in every call that carries a part: keep the carried part of CIFAR-10
# (the machine deletes an ignored path that a call does not carry, so parts must leave the checkout at once), and
# once all have arrived, join them into DEST/train.npz and DEST/test.npz and check their sizes and sha256.
# Usage: training/gpu/receive-cifar10.sh [DEST]; prints what is still missing.
set -euo pipefail
dest=${1:-/tmp/c10}; kept=$dest/parts
mkdir -p "$kept"
for d in .gpu/p*; do [ -d "$d" ] && cp "$d"/cifar10.* "$d"/sums "$kept"/; done
[ -f "$kept/sums" ] || { echo "no part carried yet: carry .gpu/p00 (training/gpu/prepare.sh made them)" >&2; exit 1; }
read -r _ train_size train_sum < <(grep '^train ' "$kept/sums")
read -r _ test_size test_sum < <(grep '^test ' "$kept/sums")
have=$(cat "$kept"/cifar10.* | wc -c)
if [ "$have" -lt $((train_size + test_size)) ]; then
  echo "CIFAR-10: $(ls "$kept"/cifar10.* | wc -l) parts here ($(ls "$kept" | grep -o '[0-9]*$' | tr '\n' ' ')), $((have / 1048576)) of $(((train_size + test_size) / 1048576)) MiB: carry the next part"
  exit 0
fi
cat "$kept"/cifar10.* > "$dest/joined"
head -c "$train_size" "$dest/joined" > "$dest/train.npz"
tail -c +$((train_size + 1)) "$dest/joined" > "$dest/test.npz"
rm "$dest/joined"
echo "$train_sum  $dest/train.npz
$test_sum  $dest/test.npz" | sha256sum --quiet -c - ||
  { echo "CIFAR-10 damaged in transfer: rm -r $kept and carry every part again" >&2; exit 1; }
echo "CIFAR-10 ready in $dest (train.npz, test.npz; sha256 checked)"
