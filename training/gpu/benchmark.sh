#!/usr/bin/env bash
# On the GPU machine, before any training starts (a busy GPU makes every ratio meaningless): every comparison of
# issue 18 in one go, bf16 autocast, interleaved sides, eager and compiled. Prints to stdout and to $OUT/benchmark.txt
# (or ./benchmark.txt). Each step is cut at 90 s (a compiled one at 150 s), so it outlasts one 10-minute call: start it
# in the background and collect the file. The steps of session 25 took 6 minutes on an H100 (2026-11-25;
# training/gpu/results/); --rest runs only the steps that session could not measure (marked "rest").
# Usage: PYTHONPATH=. setsid nohup training/gpu/benchmark.sh [--rest] [--quick] > /tmp/benchmark.out 2>&1 &
#        (--quick: 2 repetitions)
set -uo pipefail
iters=10; rest_only=0
for arg in "$@"; do
  case $arg in --quick) iters=2;; --rest) rest_only=1;; *) echo "unknown option $arg" >&2; exit 2;; esac
done
mkdir -p "${OUT:-.}"; out=${OUT:-.}/benchmark.txt
B="python3 -m timm_attnconv.benchmark --device ${DEVICE:-cuda} --amp bf16 --iters $iters"
run_step() { local limit=$1; shift; echo "\$ $*" | tee -a "$out"; timeout "$limit" "$@" 2>&1 | tee -a "$out"; }
step() { [ $rest_only = 1 ] || run_step 90 "$@"; }                  # measured in session 25
rest() { case " $* " in *" --compile "*) run_step 150 "$@";; *) run_step 90 "$@";; esac; }   # not yet
: > "$out"
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee -a "$out"
DENSE='{"attn_path": "dense"}'
# SA: the paths 'auto' chooses between, at the three grid sizes (item 1), then the default against dense
step $B --paths --models sa_quadratic_cifar sa_learned_cifar --sizes 32 64 96 --batch-size 64
for c in "" --compile; do
  step $B $c --versus sa_quadratic_cifar:sa_quadratic_cifar --baseline-kwargs "$DENSE" --sizes 32 --batch-size 256
done
# the fast path (auto, projections folded) against the original algorithm (dense, unfolded) at 96 px: ≥ 1.5× asked
rest $B --models sa_quadratic_cifar sa_learned_cifar --sizes 96 --batch-size 64 --bf16-model ''
for px in 64 96; do  # compiled at the larger grids too, one size per step (each side compiles)
  rest $B --compile --versus sa_quadratic_cifar:sa_quadratic_cifar --baseline-kwargs "$DENSE" --sizes $px \
    --batch-size 64
done
# fused relative-position kernels (item 2) and the AA / EA pairs against their peers (item 3)
step $B --kernels --models aa_resnet50 --batch-size 128
rest $B --kernels --models sa_learned_content_cifar --batch-size 128
# the content model's inference form (keys folded into the queries) against the original, batch 256: its memory target
rest $B --models sa_learned_content_cifar --sizes 32 --batch-size 256 --bf16-model ''
for c in "" --compile; do
  step $B $c --versus aa_resnet50:resnet50 --sizes 224 --batch-size 128
done
for c in "" --compile; do  # the memory format timm's scripts run convolutional nets in on GPUs (--channels-last)
  rest $B $c --channels-last --versus aa_resnet50:resnet50 --sizes 224 --batch-size 128
done
step $B --versus ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}' --sizes 224 --batch-size 128
rest $B --compile --versus ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}' --sizes 224 \
  --batch-size 128
step $B --versus deit_ea_small_patch16_224:deit_small_patch16_224 --sizes 224 --batch-size 128
# the convolution over EA's maps on this GPU: channels_last (faster on CPU), NCHW, or the heads padded to 8 channels
rest $B --evolution-layouts --models deit_ea_small_patch16_224 ea_aa_resnet50 --batch-size 128
rest $B --compile --versus deit_ea_small_patch16_224:deit_small_patch16_224 --sizes 224 --batch-size 128
# training steps of the CIFAR models the trainer runs (batch 256, 32 px)
step $B --train --models sa_quadratic_cifar sa_learned_content_cifar --batch-size 256
rest $B --train --models aa_resnet20_cifar --batch-size 256
