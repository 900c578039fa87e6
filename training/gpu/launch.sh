#!/usr/bin/env bash
# On the GPU machine, from the repo root: start the training run NAME (a recipe below) in the background, detached
# with setsid nohup so that it outlives the device tool's 10-minute command (it runs until it finishes or the machine
# goes back). Output: $RUNS/NAME (checkpoint, log.jsonl, train.out). Extra arguments are appended to the recipe's
# (a later option wins), e.g. `launch.sh sa_learned_cifar --epochs 1 --train-limit 5120` for a smoke run.
# Running it again resumes the run from its checkpoint, and so does a checkpoint an earlier session brought back and
# carried (prepare.sh --carry-run, receive.sh). COMPILE=0 trains without torch.compile; a run whose compile
# fails goes on without it by itself.
# Usage: training/gpu/launch.sh NAME [TRAIN ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root, whose timm_attnconv the runs import
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
name=${1:?usage: launch.sh NAME [TRAIN ARGS...]; NAME: sa_learned_cifar, sa_quadratic_gen_cifar, ...}; shift
runs=${RUNS:-/tmp/runs}; data=${DATA:-/tmp/c10}
[ -f "$data/train.npz" ] ||
  { echo "no CIFAR-10 in $data: carry the parts with training/gpu/receive.sh first" >&2; exit 1; }
# the recipe of sa_quadratic_cifar.c10 (91.54% as staged, after 90 of 100 epochs on one H100)
sa=(--epochs 100 --batch-size 256 --opt adamw --lr 1e-3 --weight-decay 0.05 --warmup-epochs 5 --smoothing 0.1
    --model-ema --model-ema-decay 0.9995 --clip-grad 1.0)
# one recipe for the ResNet-20 baseline and its attention-augmented twin
resnet=(--epochs 100 --batch-size 128 --opt sgd --lr 0.1 --weight-decay 5e-4 --warmup-epochs 1 --smoothing 0.1
        --model-ema --model-ema-decay 0.999 --channels-last)
# the compact SA recipe of sa_quadratic_tiny_cifar.c10_40ep (training/README.md), for the compact models and an EA twin
compact=(--epochs 40 --batch-size 256 --opt adamw --lr 2e-3 --weight-decay 0.05 --warmup-epochs 2 --smoothing 0.1
         --model-ema --model-ema-decay 0.999)
case $name in
  sa_learned_cifar|sa_quadratic_gen_cifar|sa_quadratic_16h_cifar|sa_learned_content_cifar|ea_sa_learned_content_cifar)
    recipe=(--model "$name" "${sa[@]}");;
  sa_quadratic_gen_pruned_cifar)
    # Cordonnier et al. 2020, Table 1: prune the trained generalized-quadratic model down to the pruned model's heads,
    # the most degenerate first, then fine-tune at a tenth of its learning rate. The pruned weights are either
    # carried (training/gpu/prune.py here, from the staged sa_quadratic_gen_cifar.c10, into $runs/$name) or pruned
    # from the EMA of this machine's finished sa_quadratic_gen_cifar run. An --init-from among the extra arguments
    # (a staged fine-tune of the pruned model, carried with prepare.sh --carry-weights) goes on from there instead
    fine_tune=("${sa[@]}" --epochs 30 --lr 1e-4 --warmup-epochs 1 --model-ema-decay 0.999)
    if [[ " $* " == *" --init-from "* ]]; then
      recipe=(--model "$name" "${fine_tune[@]}")  # the staged weights have the registered model's heads
    else
      if [ ! -f "$runs/$name/heads.json" ]; then
        source=$runs/sa_quadratic_gen_cifar/last.pth.tar
        [ -f "$source" ] || { echo "no $runs/$name/heads.json (carry the pruned weights, training/gpu/README.md) and" \
                                   "no $source (train sa_quadratic_gen_cifar first)" >&2; exit 1; }
        python3 training/gpu/prune.py "$source" "$runs/$name"
      fi
      heads=$(cat "$runs/$name/heads.json")
      recipe=(--model "$name" --model-kwargs "{\"num_heads\": $heads}" --init-from "$runs/$name/pruned.safetensors"
              "${fine_tune[@]}")
    fi;;
  attnconv_resnet20_cifar|aa_resnet20_cifar|ea_aa_resnet20_cifar)
    recipe=(--model "$name" "${resnet[@]}");;
  sa_learned_tiny_cifar|sa_learned_content_tiny_cifar|ea_sa_learned_content_tiny_cifar)
    recipe=(--model "$name" "${compact[@]}");;
  aa_wide_resnet28_10_cifar)
    # AA-WRN-28-10 (Bello et al. 2019, §4.1) on CIFAR-10, not the paper's CIFAR-100: the ResNet-20 recipe cut to the 30
    # epochs that fit one session (training/gpu/README.md, plan F)
    recipe=(--model "$name" "${resnet[@]}" --epochs 30);;
  *)
    echo "no recipe for $name; see training/gpu/README.md" >&2; exit 2;;
esac
# a checkpoint there: this session's own, or one an earlier session brought back (collect.sh --checkpoint) and
# carried (prepare.sh --carry-run, receive.sh)
[ ! -f "$runs/$name/last.pth.tar" ] || echo "launch.sh: the run resumes $runs/$name/last.pth.tar"
mkdir -p "$runs/$name"
cmd=(python3 -m timm_attnconv.train "${recipe[@]}" --data-dir "$data" --output "$runs/$name" --device cuda --amp bf16
     --eval-every 10 "$@")
[ "${COMPILE:-1}" = 0 ] || cmd+=(--compile)
echo "${cmd[*]}" >> "$runs/$name/command.txt"
log=$runs/$name/train.out
# Detached. A run whose torch.compile fails (dynamo's or inductor's error in what it wrote) starts again without it,
# resuming its checkpoint if it has one (compile is a runtime setting), so that no device call goes to relaunching it.
PYTHONUNBUFFERED=1 setsid nohup bash -c '
  log=$1; shift; start=$(stat -c %s "$log")
  "$@" && exit
  [ "${!#}" = --compile ] && tail -c +$((start + 1)) "$log" |
    grep -qE "InductorError|BackendCompilerFailed|InternalTorchDynamoError|torch\._(dynamo|inductor)" || exit 1
  echo "launch.sh: torch.compile failed; training on without it"
  exec "${@:1:$#-1}"' launch.sh "$log" "${cmd[@]}" >> "$log" 2>&1 < /dev/null &
echo "started $name (pid $!): ${cmd[*]}"
