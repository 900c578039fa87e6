#!/usr/bin/env bash
# On the GPU machine, before any training starts (a busy GPU makes every ratio meaningless): every comparison of
# issue 18 in one go, bf16 autocast, interleaved sides, eager and compiled. Prints to stdout and to $OUT/benchmark.txt
# (or ./benchmark.txt), each step followed by the seconds it took. The steps of the targets come first (every
# family eager, then compiled), then the ones that explain them. Each step is cut at 90 s (one that compiles at 150
# s), so the whole outlasts one 10-minute call: start it in the background and collect the file.
#   --profile         op profiles into profile.txt: after the eager targets, the models that miss the targets and
#                     their bases, eager (the SA fast path beside dense at 96 px among them); last (compiled)
#                     AA-ResNet-50 and ResNet-50
#   --budget SECONDS  start no step after SECONDS, and cut a step at what is left: the GPU is needed for training next
#                     (a compiled step with less than a minute left is skipped, so eager steps get that minute)
#   --steps LIST      only these steps (counted from 1 as the steps below run; LIST as 4-6,19,21-: numbers and
#                     ranges, open at the end), each other one listed as skipped: a later session's spare minutes
#                     measure what changed since, or what an earlier session's budget left out
#   --from K          the same as --steps K-
#   --quick           2 repetitions instead of 10
# Usage: PYTHONPATH=. setsid nohup training/gpu/benchmark.sh [--profile] [--budget S] [--steps LIST] [--quick] \
#          > /tmp/b.out 2>&1 &
set -uo pipefail
iters=10; profile=0; budget=0; chosen=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) iters=2;;
    --profile) profile=1;;
    --budget) budget=${2:?--budget needs a number of seconds}; shift
              [[ $budget =~ ^[0-9]+$ ]] || { echo "--budget takes whole seconds, not $budget" >&2; exit 2; };;
    --steps) chosen=${2:?--steps needs a list of steps}; shift;;
    --from) chosen=${2:?--from needs a step number}-; shift;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
  shift
done
number='[1-9][0-9]*'
[ -z "$chosen" ] || [[ $chosen =~ ^$number(-($number)?)?(,$number(-($number)?)?)*$ ]] ||
  { echo "--steps takes step numbers from 1 on and ranges (4-6,19,21-), not $chosen" >&2; exit 2; }
mkdir -p "${OUT:-.}"; out=${OUT:-.}/benchmark.txt; profile_out=${OUT:-.}/profile.txt
printf '%s\n%s\n' $$ "$out" > "${BENCH_PID:-/tmp/benchmark.pid}"  # status.sh waits while this pid runs
B="python3 -m timm_attnconv.benchmark --device ${DEVICE:-cuda} --amp bf16 --iters $iters"
P="python3 training/gpu/op_profile.py --device ${DEVICE:-cuda} --shapes"
compiled_min=60  # the least budget a compiling step starts with: compiling both sides alone can take most of it
# Triton's autotuner prints the configuration it picks for EA's kernel, and how long it took (which block of query
# rows wins where is not measured yet, layers/_evolution_triton.py)
export TRITON_PRINT_AUTOTUNING=1
run_to() {  # FILE COMMAND...: the command, cut at its limit (90 s; 150 s where it compiles: torch.compile, or the
  # autotuning of EA's Triton kernel, 3 to 6 configurations per map shape) or at what is left of the budget
  local file=$1 limit=90 started=$SECONDS; shift
  case " $* " in *" --compile "* | *" triton"*) limit=150;; esac
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS))
    if [ $left -le 0 ]; then echo "skipped (the budget of $budget s is spent): $*" | tee -a "$file"; return; fi
    if [ $limit -gt 90 ] && [ $left -lt $compiled_min ]; then  # it would be cut while compiling: leave it to eager ones
      echo "skipped ($left s of the budget left, under the $compiled_min s a compiling step gets): $*" | tee -a "$file"
      return
    fi
    [ $left -ge $limit ] || limit=$left
  fi
  echo "\$ $*" | tee -a "$file"
  timeout "$limit" "$@" 2>&1 | tee -a "$file"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then echo "(cut at $limit s)"; else echo "($((SECONDS - started)) s)"; fi | tee -a "$file"
}
steps=0
chosen_step() {  # whether step N is among --steps (all are when it is not given)
  local n=$1 part low high
  [ -n "$chosen" ] || return 0
  for part in ${chosen//,/ }; do
    low=${part%-*}; high=${part#*-}
    [ -n "$high" ] || high=$n
    [ "$n" -ge "$low" ] && [ "$n" -le "$high" ] && return 0
  done
  return 1
}
step() {  # a numbered benchmark step (--steps counts these; the op profiles are not steps)
  steps=$((steps + 1))
  if ! chosen_step $steps; then echo "skipped (step $steps, not among --steps $chosen): $*" | tee -a "$out"; return; fi
  run_to "$out" "$@"
}
: > "$out"
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$out"
DENSE='{"attn_path": "dense"}'
# the targets, eager first for every family, then compiled (one size per compiled SA step: each side compiles), so
# that a short budget measures every family: SA's default path against dense at 32, 64, 96 px and against the
# original algorithm (dense, unfolded) at 96 px; AA-ResNet-50 against ResNet-50, also both in channels_last (the
# memory format timm's scripts run ResNets in on GPUs); the EA models against their bases; the content model's
# inference form (keys folded into the queries) against the original at batch 256, its memory target
targets() {  # "" (eager) or --compile
  local c=$1
  step $B $c --versus sa_quadratic_cifar:sa_quadratic_cifar --baseline-kwargs "$DENSE" --sizes 32 --batch-size 256
  if [ -z "$c" ]; then
    step $B --versus sa_quadratic_cifar:sa_quadratic_cifar --baseline-kwargs "$DENSE" --sizes 64 96 --batch-size 64
    step $B --models sa_quadratic_cifar sa_learned_cifar --sizes 96 --batch-size 64 --bf16-model ''
  else
    for px in 64 96; do
      step $B $c --versus sa_quadratic_cifar:sa_quadratic_cifar --baseline-kwargs "$DENSE" --sizes $px --batch-size 64
    done
    # the fast path against the original algorithm at 96 px compiled, both sides compiled (its target is ≥ 1.5×)
    step $B $c --models sa_quadratic_cifar sa_learned_cifar --sizes 96 --batch-size 64 --bf16-model ''
  fi
  step $B $c --versus aa_resnet50:resnet50 --sizes 224 --batch-size 128
  step $B $c --channels-last --versus aa_resnet50:resnet50 --sizes 224 --batch-size 128
  step $B $c --versus ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}' --sizes 224 --batch-size 128
  step $B $c --versus deit_ea_small_patch16_224:deit_small_patch16_224 --sizes 224 --batch-size 128
  [ -n "$c" ] || step $B --models sa_learned_content_cifar --sizes 32 --batch-size 256 --bf16-model ''
}
targets ""
if [ $profile = 1 ]; then  # where the time of the models that miss the targets goes, op by op, beside their bases
  : > "$profile_out"
  run_to "$profile_out" $P aa_resnet50 resnet50 'ea_aa_resnet50:{"evolve": false}' ea_aa_resnet50 \
    deit_ea_small_patch16_224 deit_small_patch16_224
  # at 96 px the fast path does 4.7x fewer MACs than the original algorithm (dense maps, projections unfolded), yet
  # ran only 1.36x faster than it on an H100 (BENCHMARK.md); dense is the original's attention without the unfolding
  run_to "$profile_out" $P --img-size 96 --batch-size 64 sa_quadratic_cifar "sa_quadratic_cifar:$DENSE"
  # the content model at its throughput target's batch (issue 18: at least 1.5x the 4,689 img/s of an H100), whose
  # time no profile has split yet
  run_to "$profile_out" $P --batch-size 256 sa_learned_content_cifar
fi
targets --compile
# what explains them: the paths 'auto' chooses between, the attention kernels, how EA's map convolution runs,
# training steps at batch 256, 32 px
step $B --paths --models sa_quadratic_cifar sa_learned_cifar --sizes 32 64 96 --batch-size 64
step $B --kernels --models aa_resnet50 --batch-size 128
# the content model's kernels in its targets' form and batch (issue 18: the inference form, peak memory at most 3 GB
# at batch 256): 'auto' takes FlexAttention on CUDA for its memory, the slowest of the four as built, at batch 128
# (0.67x the explicit maps', session 37)
step $B --kernels --reparameterize --models sa_learned_content_cifar --batch-size 256
# EA's update as one Triton kernel (inference on CUDA; 'triton', the default since session 40) against cuDNN's
# convolution and the passes around it: most of what EA adds to its bases in the op profiles. The kernel's first call
# per map shape autotunes it (one step per model, each given the 150 s of a compiling step)
step $B --evolution-layouts channels_last triton --models deit_ea_small_patch16_224 --batch-size 128
step $B --evolution-layouts channels_last triton --models ea_aa_resnet50 --batch-size 128
# the compiled AA target: SDPA with the bias as its mask (what 'auto' takes in a compiled model on CUDA) against SDPA
# without a mask and FlexAttention inside the model's graph (before session 37's fix, torch 2.11 refused the latter)
step $B --compile --kernels sdpa sdpa_onehot flex --models aa_resnet50 --batch-size 128
step $B --train --models sa_quadratic_cifar sa_learned_content_cifar --batch-size 256
step $B --train --models aa_resnet20_cifar --batch-size 256
step $B --train --kernels sdpa sdpa_onehot flex --models aa_resnet20_cifar --batch-size 256
[ $profile = 0 ] || run_to "$profile_out" $P --compile aa_resnet50 resnet50
