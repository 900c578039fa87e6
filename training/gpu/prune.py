"""Prune a trained generalized-quadratic model for the pruned fine-tune (Cordonnier et al. 2020, §4.1, Table 1).

    python3 training/gpu/prune.py SOURCE OUT_DIR [--num-heads N,N,... | --num-heads criterion] [--half]

SOURCE is a run's checkpoint (``RUN/last.pth.tar``: its EMA weights) or a staged model (``sa_quadratic_gen_cifar.c10``,
here, where ``weights/`` is). By default each layer keeps as many heads as ``sa_quadratic_gen_pruned_cifar`` has (the
paper's pruned model), the most degenerate pruned first; ``--num-heads criterion`` prunes the heads the criterion
names, as the original code did. Writes ``OUT_DIR/pruned.safetensors`` (``--half``: float16, lossless for staged
float16 weights and half the size to carry), ``OUT_DIR/heads.json`` (the counts kept, for ``--model-kwargs``) and
``OUT_DIR/pruning.json`` (``prune_report``: the heads pruned and those the criterion names, per layer, heads and
params before and after), and prints the last. Unlike ``python -m timm_attnconv.prune`` it counts no MACs, so it
needs no fvcore, which the GPU machine lacks.
"""
import argparse
import json
import os

import timm
from safetensors.torch import save_file

from timm_attnconv.analysis import prune_report
from timm_attnconv.runs import load_training_checkpoint

PRUNED_ARCH = 'sa_quadratic_gen_pruned_cifar'

parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
parser.add_argument('source', help='RUN/last.pth.tar (its EMA) or a staged model such as sa_quadratic_gen_cifar.c10')
parser.add_argument('out_dir')
parser.add_argument('--num-heads', default=None,
                    help=f"heads kept per layer, comma-separated (default: {PRUNED_ARCH}'s), or 'criterion'")
parser.add_argument('--half', action='store_true', help='store the pruned weights in float16')
args = parser.parse_args()
if os.path.isfile(args.source):
    model = load_training_checkpoint(args.source, use_ema=True)
else:
    model = timm.create_model(args.source, pretrained=True)
if args.num_heads is None:
    num_heads = timm.create_model(PRUNED_ARCH).num_heads
elif args.num_heads == 'criterion':
    num_heads = None
else:
    num_heads = tuple(int(n) for n in args.num_heads.split(','))
report = dict(source=args.source, **prune_report(model, num_heads=num_heads, macs=False))
os.makedirs(args.out_dir, exist_ok=True)
save_file({k: (v.half() if args.half else v).contiguous() for k, v in model.state_dict().items()},
          os.path.join(args.out_dir, 'pruned.safetensors'), metadata={'num_heads': json.dumps(report['num_heads'])})
with open(os.path.join(args.out_dir, 'heads.json'), 'w') as f:
    json.dump(report['num_heads'], f)
with open(os.path.join(args.out_dir, 'pruning.json'), 'w') as f:
    json.dump(report, f, indent=1)
print(json.dumps(report))
