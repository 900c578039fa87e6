#!/usr/bin/env bash
# Commit the checkpoint of a CPU run that is training, so that a session which stops without warning loses at most the
# epochs since (the next checkout has what is on the branch, not the ignored files beside it):
#   training/commit_checkpoint.sh RUN_DIR [--final] [--at HH:MM]
# Two commits on the current branch: one holds RUN_DIR/last.pth.tar (history keeps it), the next takes it out of the
# tree again. --final also commits RUN_DIR/log.jsonl as the checkpoint records it and points the run's restore line in
# training/README.md (the `git show ...:RUN_DIR/last.pth.tar` line) at the new commit, in the work tree too. --at
# waits until that time first (e.g. hourly: `for t in 01:20 02:20; do training/commit_checkpoint.sh ... --at $t;
# done &`). The commits go through a private index: the session's own index and work tree are left as they are.
set -euo pipefail
usage() { echo "usage: training/commit_checkpoint.sh RUN_DIR [--final] [--at HH:MM]" >&2; exit 2; }
[ $# -ge 1 ] || usage
run=${1%/}; shift
final=0; at=
while [ $# -gt 0 ]; do
  case $1 in
    --final) final=1; shift ;;
    --at) [ $# -ge 2 ] || usage; at=$2; shift 2 ;;
    *) usage ;;
  esac
done
if [ -n "$at" ]; then
  target=$(date -d "$at" +%s) || usage
  sleep $(( target > $(date +%s) ? target - $(date +%s) : 0 ))
fi
[ -f "$run/last.pth.tar" ] || { echo "no checkpoint at $run/last.pth.tar: nothing to commit" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$run/last.pth.tar" "$tmp/ckpt"  # the trainer replaces the file by a rename: the copy is one whole checkpoint
# read back (digest checked), its log written as the trainer writes it, and "N epochs + K steps of E"
progress=$(python - "$tmp/ckpt" "$tmp/log.jsonl" <<'PY'
import sys
from timm_attnconv.runs import read_checkpoint, write_log
state = read_checkpoint(sys.argv[1])
write_log(state['log'], sys.argv[2])
steps = state['step_in_epoch']
print(f"{state['epoch']} epochs + {steps} step{'s' * (steps != 1)} of {state['config']['epochs']}")
PY
)
export GIT_INDEX_FILE=$tmp/index
git read-tree HEAD
git update-index --add --cacheinfo "100644,$(git hash-object -w "$tmp/ckpt"),$run/last.pth.tar"
if [ $final = 1 ]; then
  git update-index --add --cacheinfo "100644,$(git hash-object -w "$tmp/log.jsonl"),$run/log.jsonl"
fi
kept=$(git commit-tree "$(git write-tree)" -p HEAD -m "$run: $progress (checkpoint kept in history)")
restore="git show ${kept:0:7}:$run/last.pth.tar > $run/last.pth.tar  # $progress"
point_restore_line() {  # stdin → stdout, the run's restore line replaced
  python -c '
import sys
path, line = sys.argv[1:]
sys.stdout.write("".join(line + "\n" if old.startswith("git show ") and f":{path} " in old else old for old in sys.stdin))
' "$run/last.pth.tar" "$restore"
}
git update-index --force-remove "$run/last.pth.tar"
if [ $final = 1 ]; then
  git show HEAD:training/README.md | point_restore_line > "$tmp/README.md"
  git update-index --cacheinfo "100644,$(git hash-object -w "$tmp/README.md"),training/README.md"
fi
out=$(git commit-tree "$(git write-tree)" -p "$kept" -m "$run: $progress; checkpoint out of the tree (restore from ${kept:0:7})")
git update-ref -m "commit_checkpoint.sh $run" HEAD "$out"
unset GIT_INDEX_FILE
if [ $final = 1 ]; then  # the session's index and work tree follow the two files the branch now has
  git reset -q -- training/README.md "$run/log.jsonl"
  point_restore_line < training/README.md > "$tmp/README.work" && cat "$tmp/README.work" > training/README.md
  cp "$tmp/log.jsonl" "$run/log.jsonl"
fi
echo "committed ${kept:0:7} (the checkpoint) and ${out:0:7} (out of the tree): $run, $progress"
