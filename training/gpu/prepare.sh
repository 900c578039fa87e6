#!/usr/bin/env bash
# Here, before a GPU session, from the repo root: make the working tree lean and cut CIFAR-10 into as few parts as
# fit beside it, one per device call (64 MiB a call for tree and part together).
# - weights/ (the staged safetensors, tracked: most of the tree) moves to .git/gpu-aside/ so that it does not travel
#   with every call; `training/gpu/prepare.sh --restore` puts it back (do it before staging or testing).
# - train.npz and test.npz are cut as one stream into .gpu/p00, .gpu/p01, ... (ignored by git), each with the sizes
#   and sha256 that receive.sh checks on the other side; .gpu/init (training/gpu/prune.py's output) stays, and the
#   last line says whether it fits beside the last part in one call.
# - --carry-weights ARCH.TAG...: copies those staged folders into .gpu/init/weights/ first, for a run that starts from
#   them (`--init-from ARCH.TAG` with TIMM_ATTNCONV_WEIGHTS_DIR at their copy on the GPU machine).
# - --carry-run FOLDER...: the training checkpoint of each folder (one that `transfer join` wrote from `collect.sh
#   NAME --checkpoint` in an earlier session) joins the stream after the data; receive.sh puts it in /tmp/runs/NAME,
#   where launch.sh NAME resumes it: a run that spans sessions, with a checkpoint of any size.
# Usage: training/gpu/prepare.sh [--restore | [--carry-weights ARCH.TAG...] [--carry-run FOLDER...]]; CIFAR10_DIR
# (default $TIMM_ATTNCONV_CIFAR10, else ../shared/data/cifar10) holds the npz files.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
aside=$(git rev-parse --git-dir)/gpu-aside
if [ "${1:-}" = --restore ]; then
  [ -d "$aside/weights" ] || { echo "nothing set aside in $aside" >&2; exit 1; }
  [ ! -e weights ] || { echo "weights/ exists: move it away or compare it with $aside/weights first" >&2; exit 1; }
  mv "$aside/weights" weights && echo "weights/ restored"; exit 0
fi
src=${CIFAR10_DIR:-${TIMM_ATTNCONV_CIFAR10:-../shared/data/cifar10}}
[ -f "$src/train.npz" ] && [ -f "$src/test.npz" ] ||
  { echo "no train.npz/test.npz in $src: set CIFAR10_DIR" >&2; exit 1; }
staged=(); runs=(); option=
for arg in "$@"; do
  case $arg in
    --carry-weights|--carry-run) option=$arg;;
    -*) option=;&
    *) case $option in
         --carry-weights) staged+=("$arg");;
         --carry-run) runs+=("$arg");;
         *) echo "unknown argument $arg; usage: prepare.sh [--restore |" \
                 "[--carry-weights ARCH.TAG...] [--carry-run FOLDER...]]" >&2; exit 2;;
       esac;;
  esac
done
[ -z "$option" ] || [ ${#staged[@]} -gt 0 ] || [ ${#runs[@]} -gt 0 ] ||
  { echo "$option needs what to carry: staged folders (sa_learned_cifar.c10) or run folders (runs/NAME-h100)" >&2
    exit 1; }
for name in "${staged[@]}"; do
  [ -f "weights/$name/model.safetensors" ] ||
    { echo "no weights/$name/model.safetensors: name a staged folder (ls weights/), with weights/ in place" >&2
      exit 1; }
  rm -rf ".gpu/init/weights/$name" && mkdir -p .gpu/init/weights && cp -r "weights/$name" .gpu/init/weights/
  echo "carrying the staged $name in .gpu/init/weights"
done
# what the parts carry, in stream order: a line per file (what, size, sha256) for receive.sh
stream=("$src/train.npz" "$src/test.npz")
sums="train $(stat -c %s "$src/train.npz") $(sha256sum < "$src/train.npz" | cut -d' ' -f1)
test $(stat -c %s "$src/test.npz") $(sha256sum < "$src/test.npz" | cut -d' ' -f1)"
for run in "${runs[@]}"; do
  [ -f "$run/last.pth.tar" ] && [ -f "$run/config.json" ] ||
    { echo "no last.pth.tar beside a run's config.json in $run: name a folder that \`python -m" \
           "timm_attnconv.transfer join\` wrote from the calls of \`collect.sh NAME --checkpoint\`" >&2; exit 1; }
  name=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"])' "$run/config.json")
  stream+=("$run/last.pth.tar")
  sums+="
run/$name $(stat -c %s "$run/last.pth.tar") $(sha256sum < "$run/last.pth.tar" | cut -d' ' -f1)"
  echo "carrying the checkpoint of $run after the data: receive.sh puts it in /tmp/runs/$name," \
       "launch.sh $name resumes it"
done
if [ -d weights ]; then
  [ ! -e "$aside/weights" ] || { echo "$aside/weights exists: run prepare.sh --restore first" >&2; exit 1; }
  mkdir -p "$aside" && mv weights "$aside/weights"
fi
exclude=$(git rev-parse --git-dir)/info/exclude; mkdir -p "$(dirname "$exclude")"
grep -qxF /.gpu/ "$exclude" 2>/dev/null || echo /.gpu/ >> "$exclude"
# what travels: tracked files still present and untracked ones git does not ignore
tree=$({ git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null |
       awk '{ s += $1 } END { print s + 0 }') || true
# a part and the tree fill a call but for 1 MiB of margin, so that the last part leaves the most room for .gpu/init
part_bytes=$(( 63 * 1048576 - ${tree:-0} ))
[ $part_bytes -ge $((8 * 1048576)) ] ||
  { echo "the working tree weighs $((tree / 1048576)) MiB: too much to carry parts beside it" >&2; exit 1; }
[ -z "${PART_MIB:-}" ] || part_bytes=$((PART_MIB * 1048576))  # smaller parts, for tests
rm -rf .gpu/p[0-9]* .gpu/tmp && mkdir -p .gpu/tmp  # .gpu/init (training/gpu/prune.py's output) stays
cat "${stream[@]}" | (cd .gpu/tmp && split -b "$part_bytes" -d -a 2 - cifar10.)
echo "$sums" > .gpu/tmp/sums
n=0
for part in .gpu/tmp/cifar10.*; do
  d=.gpu/p${part##*.}; mkdir -p "$d"; mv "$part" "$d/"; cp .gpu/tmp/sums "$d/sums"; n=$((n + 1))
done
rm -r .gpu/tmp
echo "working tree $((tree / 1048576)) MiB (weights/ set aside);" \
     "$n parts of at most $((part_bytes / 1048576)) MiB: .gpu/p00 .. .gpu/p$(printf %02d $((n - 1)))"
if [ -d .gpu/init ]; then  # prune.py's output, staged weights: with the last, smallest part if both fit in one call
  last=.gpu/p$(printf %02d $((n - 1)))
  init=$(du -sb .gpu/init | cut -f1); together=$(( ${tree:-0} + init + $(du -sb "$last" | cut -f1) ))
  if [ $together -le $((64 * 1048576)) ]; then
    echo "carry .gpu/init with $last: $((together / 1048576)) MiB with the tree"
  elif [ $(( ${tree:-0} + init )) -le $((64 * 1048576)) ]; then
    echo "carry .gpu/init in a call of its own ($((init / 1048576)) MiB): it does not fit beside $last"
  else
    echo ".gpu/init holds $((init / 1048576)) MiB: with the tree, more than one call carries (64 MiB); carry less" >&2
    exit 1
  fi
fi
