"""Prune the degenerate quadratic heads of a trained SA model (Cordonnier et al. 2020, §4.1) and report the heads,
params and MACs before and after.

    python -m timm_attnconv.prune --model sa_quadratic_tiny_cifar --pretrained --out pruned.safetensors
    python -m timm_attnconv.prune --model sa_quadratic_gen_cifar --checkpoint RUN/last.pth.tar --max-cond 1e4
    python -m timm_attnconv.prune --model sa_quadratic_gen_cifar.c10 --pretrained --num-heads 7,5,8,7,3,9 \
        --out pruned.safetensors

By default the heads the criterion names go, as in the original code; ``--num-heads`` instead keeps that many per
layer, the most degenerate pruned first (the paper's counts give ``sa_quadratic_gen_pruned_cifar``'s layout). The
report lists the heads pruned and those the criterion names, per layer. The pruned weights load into
``timm.create_model(NAME, num_heads=<the printed num_heads>)``, and the tools take them with ``--model-kwargs``.
"""
import json
from typing import Any, Dict, Optional, Sequence

from . import cli
from .analysis import prune_report

__all__ = ['main']


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    from safetensors.torch import save_file
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    cli.add_model_args(parser)
    parser.add_argument('--min-eig', type=cli.non_negative_float, default=1e-5,
                        help="prune a head whose inverse covariance's largest eigenvalue is below this")
    parser.add_argument('--max-cond', type=cli.positive_float, default=1e3,
                        help='prune a generalized head whose covariance condition number is above this')
    parser.add_argument('--num-heads', type=cli.positive_ints, default=None,
                        help='keep this many heads per layer (comma-separated, one count per layer), pruning the most '
                             'degenerate first, instead of the heads the criterion names')
    parser.add_argument('--out', type=cli.weights_path, default=None,
                        help='write the pruned weights here (a .safetensors file)')
    parser.add_argument('--json', default=None, help='also write the report to this file')
    args = parser.parse_args(argv)
    model = cli.load_model(args)
    report = dict(model=args.model, **prune_report(model, args.min_eig, args.max_cond, args.num_heads))
    if args.out:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out,
                  metadata={'num_heads': json.dumps(report['num_heads'])})
    cli.print_result(report, args.json, indent=2)
    return report


if __name__ == '__main__':
    cli.run(main)
