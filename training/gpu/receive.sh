#!/usr/bin/env bash
# On the GPU machine, from the repo root, first in every call that carries a part (prepare.sh made them): keep the
# carried part (the machine deletes an ignored path that a call does not carry, so parts must leave the checkout at
# once), and once all have arrived, cut the stream back into its files and check their sizes and sha256: CIFAR-10's
# DEST/train.npz and DEST/test.npz, then the checkpoint of each run carried with them (prepare.sh --carry-run) as
# $RUNS/NAME/last.pth.tar, where launch.sh NAME resumes it.
# Usage: training/gpu/receive.sh [DEST]; prints what is still missing.
set -euo pipefail
dest=${1:-/tmp/c10}; kept=$dest/parts; runs=${RUNS:-/tmp/runs}
mkdir -p "$kept"
for d in .gpu/p*; do [ -d "$d" ] && cp "$d"/cifar10.* "$d"/sums "$kept"/; done
[ -f "$kept/sums" ] || { echo "no part carried yet: carry .gpu/p00 (training/gpu/prepare.sh made them)" >&2; exit 1; }
total=$(awk '{ s += $2 } END { print s }' "$kept/sums")
have=$(cat "$kept"/cifar10.* | wc -c)
if [ "$have" -lt "$total" ]; then
  part_numbers=$(ls "$kept" | grep -o '[0-9]*$' | tr '\n' ' ')
  echo "$(ls "$kept"/cifar10.* | wc -l) parts here ($part_numbers), $((have / 1048576)) of $((total / 1048576)) MiB:" \
       "carry the next part"
  exit 0
fi
cat "$kept"/cifar10.* > "$dest/joined"
offset=0; checks=; said=
while read -r what size sum; do
  case $what in
    train|test) file=$dest/$what.npz;;
    run/*) name=${what#run/}; file=$runs/$name/last.pth.tar
           if [ -e "$file" ]; then  # received before (this machine's run went on from it since): kept
             said+="$runs/$name keeps the checkpoint it has"$'\n'; offset=$((offset + size)); continue
           fi
           mkdir -p "$runs/$name"; said+="checkpoint of $name ready in $runs/$name: launch.sh $name resumes it"$'\n';;
    *) echo "unknown file '$what' in $kept/sums: prepare.sh and receive.sh of different versions" >&2; exit 1;;
  esac
  dd if="$dest/joined" of="$file" iflag=skip_bytes,count_bytes skip="$offset" count="$size" bs=1M status=none
  offset=$((offset + size)); checks+="$sum  $file"$'\n'
done < "$kept/sums"
rm "$dest/joined"
printf %s "$checks" | sha256sum --quiet -c - ||
  { echo "damaged in transfer: rm -r $kept (and a checkpoint this call wrote in $runs) and carry every part again" >&2
    exit 1; }
echo "CIFAR-10 ready in $dest (train.npz, test.npz; sha256 checked)"
printf %s "$said"
