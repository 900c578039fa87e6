"""Parameter and FLOP counting with fvcore, with exact handles for the ops fvcore gets wrong or misses.

fvcore counts one multiply-add as one "flop" (MACs). Out of the box it reports 0 for
``F.scaled_dot_product_attention``, approximates most einsum equations through ``np.einsum_path`` and undercounts
broadcast ``matmul`` (it ignores the batch dimensions of the second operand). The handles below count all three
exactly; softmax, GELU and element-wise ops are not counted (fvcore's convention, and the papers').

Usage::

    python -m timm_attnconv.flops sa_quadratic_cifar sa_learned_cifar --img-size 32
"""
import logging
import math
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from . import cli
from .layers import PositionalSelfAttention, set_attn_path

__all__ = ['count_macs', 'model_report', 'EXACT_HANDLES']


def _shape(value) -> Optional[List[int]]:
    from fvcore.nn.jit_handles import get_shape
    return get_shape(value)


def _broadcast_batch(a: Sequence[int], b: Sequence[int]) -> int:
    return math.prod(torch.broadcast_shapes(tuple(a), tuple(b)))


def einsum_macs(inputs: List[Any], outputs: List[Any]) -> int:
    """Exact MACs of a two-operand ``einsum``: the product of the sizes of all its index letters."""
    equation = inputs[0].toIValue().replace(' ', '')
    operand_shapes = [_shape(v) for v in inputs[1].node().inputs()]
    lhs = equation.split('->')[0].split(',')
    if len(lhs) == 1:
        return 0  # a permutation or reduction of one operand: no multiply-adds
    if len(lhs) != 2 or '.' in equation:
        raise NotImplementedError(f'einsum {equation!r}: only two-operand equations without ellipsis are counted')
    sizes: Dict[str, int] = {}
    for letters, shape in zip(lhs, operand_shapes):
        for letter, size in zip(letters, shape):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return math.prod(sizes.values())


def matmul_macs(inputs: List[Any], outputs: List[Any]) -> int:
    """Exact MACs of ``matmul`` / ``mm`` / ``bmm`` with broadcasting and 1-D operands."""
    a, b = _shape(inputs[0]), _shape(inputs[1])
    a = [1] + a if len(a) == 1 else a
    b = b + [1] if len(b) == 1 else b
    return _broadcast_batch(a[:-2], b[:-2]) * a[-2] * a[-1] * b[-1]


def sdpa_macs(inputs: List[Any], outputs: List[Any]) -> int:
    """MACs of ``scaled_dot_product_attention``: ``q kᵀ`` plus ``probs v``."""
    q, k, v = _shape(inputs[0]), _shape(inputs[1]), _shape(inputs[2])
    batch = _broadcast_batch(q[:-2], k[:-2])
    return batch * q[-2] * k[-2] * (q[-1] + v[-1])


EXACT_HANDLES = {
    'aten::einsum': einsum_macs,
    'aten::matmul': matmul_macs,
    'aten::mm': matmul_macs,
    'aten::bmm': matmul_macs,
    'aten::scaled_dot_product_attention': sdpa_macs,
}
# element-wise and normalisation-internal ops: not multiply-adds of the model's matrices (fvcore's own convention)
IGNORED_OPS = (
    'aten::softmax', 'aten::gelu', 'aten::add', 'aten::add_', 'aten::mul', 'aten::mul_', 'aten::sub', 'aten::rsub',
    'aten::pow', 'aten::mean', 'aten::div', 'aten::neg', 'aten::exp', 'aten::sum', 'aten::linspace',
    'aten::zeros', 'aten::eye', 'aten::upsample_linear1d', 'aten::expand_as', 'aten::index', 'aten::scatter_',
)


def count_macs(model: nn.Module, inputs: torch.Tensor, by_operator: bool = False):
    """MACs of ``model(inputs)`` as fvcore counts them with :data:`EXACT_HANDLES` (total, or a dict by operator)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # fvcore scripts functions at import (deprecated in torch)
        from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(model, inputs)
    analysis.set_op_handle(**EXACT_HANDLES)
    analysis.set_op_handle(**{op: None for op in IGNORED_OPS})
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings('none')
    logger = logging.getLogger('fvcore')
    level = logger.level
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        logger.setLevel(logging.ERROR)  # its per-op notices are about ops handled above; only for this count
        try:
            return dict(analysis.by_operator()) if by_operator else int(analysis.total())
        finally:
            logger.setLevel(level)


def _paper_counted_macs(model: nn.Module, inputs: torch.Tensor) -> int:
    """MACs of the layers the paper's counter (thop 0.0.31) saw: ``nn.Linear`` layers and the 2×2 stem (a Linear in
    the original code). Attention einsums were invisible to it."""
    total = 0

    def hook(module, args, output):
        nonlocal total
        fan_in = module.in_features if isinstance(module, nn.Linear) else module.weight[0].numel()
        total += output.numel() * fan_in

    counted = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    handles = [m.register_forward_hook(hook) for m in counted]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    return total


def model_report(name: str, img_size: Optional[int] = None, reparameterize: bool = False, **kwargs) -> Dict[str, Any]:
    """Params and MACs of a registered model for one ``img_size``×``img_size`` image (default: the cfg's size).

    Returns a dict with ``params``; ``macs``, the fvcore count (exact handles) of the path the model runs by default
    (``reparameterize``: after ``timm.utils.reparameterize_model``, the inference form; ``params`` likewise);
    ``macs_original``, the same for the original algorithm (every attention layer forced to ``attn_path='dense'``);
    ``paper_gflops``, the GFLOPs in the convention of the model's paper: for Cordonnier et al., 2 × the MACs of the
    Linear layers and the stem (their counter did not see the attention einsums); for Bello et al. and Wang et al.,
    2 × all MACs.
    """
    model = cli.create_model(name, '--model-kwargs', kwargs).eval()
    in_chans, height, width = model.pretrained_cfg['input_size']
    if img_size is not None:
        height = width = img_size
    x = torch.randn(1, in_chans, height, width)
    if reparameterize:
        from timm.utils import reparameterize_model  # timm.models exports it only from timm 1.0.31
        runs = reparameterize_model(model)  # a copy: the original algorithm below is counted on the model as built
    else:
        runs = model
    report = dict(name=name, img_size=height, params=sum(p.numel() for p in runs.parameters()),
                  macs=count_macs(runs, x))
    set_attn_path(model, 'dense')
    report['macs_original'] = count_macs(model, x)
    if any(isinstance(m, PositionalSelfAttention) for m in model.modules()):
        report['paper_gflops'] = 2 * _paper_counted_macs(model, x) / 1e9
    else:
        report['paper_gflops'] = 2 * report['macs_original'] / 1e9
    return report


def _format_table(rows: List[Dict[str, Any]]) -> str:
    header = (f"{'model':32s} {'img':>4s} {'params':>12s} {'GMACs':>7s} {'GMACs original':>15s} "
              f"{'GFLOPs (2×MAC)':>15s} {'paper-style GFLOPs':>19s}")
    lines = [header, '-' * len(header)]
    for r in rows:
        lines.append(
            f"{r['name']:32s} {r['img_size']:4d} {r['params']:12,d} {r['macs'] / 1e9:7.3f} "
            f"{r['macs_original'] / 1e9:15.3f} {2 * r['macs'] / 1e9:15.3f} {r['paper_gflops']:19.3f}")
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from .models import list_models  # registers the models
    parser = cli.parser(
        __spec__.name,
        'Params and MACs (fvcore with exact attention handles) of timm_attnconv models. "GMACs" is the path the model '
        'runs, "original" the dense algorithm of the paper code, "paper-style" the convention of the model\'s paper: '
        '2 × MACs of Linear layers and stem only for Cordonnier et al., 2 × all MACs for Bello et al.')
    parser.add_argument('models', nargs='*', type=cli.model_name, help='model names (default: all registered)')
    parser.add_argument('--img-size', type=cli.positive_int, default=None,
                        help='square input size (default: each cfg\'s)')
    parser.add_argument('--model-kwargs', type=cli.json_object, default={},
                        help='JSON dict for timm.create_model of every model, e.g. \'{"dynamic_img_size": true}\' '
                             'for an EA DeiT at another --img-size')
    parser.add_argument('--reparameterize', action='store_true',
                        help='params and GMACs of the inference form (timm.utils.reparameterize_model: folded '
                             'projections, content keys folded into the queries)')
    args = parser.parse_args(argv)
    names = args.models or list_models()
    print(_format_table([model_report(n, args.img_size, args.reparameterize, **args.model_kwargs) for n in names]))


if __name__ == '__main__':
    cli.run(main)
