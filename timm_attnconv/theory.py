"""Cordonnier et al. (ICLR 2020), Theorem 1, made executable: any convolution as multi-head self-attention.

A multi-head self-attention layer with ``K = k_h·k_w`` heads and quadratic relative encoding can express any
``k_h × k_w`` convolution (Theorem 1, constructive proof via Lemma 1): head ``h`` puts its Gaussian centre ``μ_h`` on
the kernel offset ``Δ_h`` and, as the sharpness ``α`` grows, attends to exactly one pixel, ``q + Δ_h``; the per-head
value/output map ``W_h`` is the kernel tap ``W[:, :, Δ_h]``, so ``Σ_h A_h X W_hᵀ = conv(X)``.

:func:`conv_to_attention` builds that layer from an ``nn.Conv2d``. Zero padding is reproduced by attending over the
zero-padded image; stride is the paper's "convolution followed by fixed pooling" (subsampling the stride-1 output);
dilation spreads the centres. ``α`` is chosen so that the off-target attention mass underflows in the working dtype,
so the conversion is exact up to rounding. :func:`convert_convs` converts every eligible convolution of a network.

    python -m timm_attnconv.theory --model attnconv_resnet20_cifar --checkpoint RUN/last.pth.tar

converts a trained CNN and evaluates both forms on the CIFAR-10 test images (accuracy, changed predictions, largest
logit difference).
"""
import math
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cli
from .layers import PositionalSelfAttention

__all__ = ['ConvAsAttention', 'conv_to_attention', 'convert_convs', 'hard_attention_alpha', 'main']


def hard_attention_alpha(dtype: torch.dtype) -> float:
    """``α`` (logit gap per unit squared distance) at which a softmax is one-hot in ``dtype``: the nearest other key
    gets ``exp(-α)``, which must fall below the dtype's resolution even when summed over a large grid."""
    eps = torch.finfo(dtype).eps
    return math.log(1e6 / eps) + 10.  # ≈ 40 for fp32, ≈ 30 for fp16 / bf16


class ConvAsAttention(nn.Module):
    """Self-attention with quadratic encoding that computes a given convolution (NCHW in, NCHW out).

    Holds a :class:`PositionalSelfAttention` with one isotropic head per kernel offset; pads the input with zeros,
    attends over the padded grid, keeps the queries whose receptive field is complete and subsamples by the stride.
    """

    def __init__(self, attn: PositionalSelfAttention, kernel_size: Tuple[int, int], stride: Tuple[int, int],
                 padding: Tuple[int, int], dilation: Tuple[int, int]):
        super().__init__()
        self.attn = attn
        self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad_h, pad_w = self.padding
        x = F.pad(x, (pad_w, pad_w, pad_h, pad_h))
        height, width = x.shape[-2:]
        out = self.attn(x.permute(0, 2, 3, 1))  # (B, H_pad, W_pad, C_out); query (i, j) sees (i, j) + Δ_h
        valid_h = height - self.dilation[0] * (self.kernel_size[0] - 1)
        valid_w = width - self.dilation[1] * (self.kernel_size[1] - 1)
        if valid_h < 1 or valid_w < 1:
            raise ValueError(f'input {tuple(x.shape[-2:])} (padded) is smaller than the kernel\'s receptive field')
        return out[:, :valid_h:self.stride[0], :valid_w:self.stride[1]].permute(0, 3, 1, 2)


def conv_to_attention(conv: nn.Conv2d, alpha: Optional[float] = None) -> ConvAsAttention:
    """The Theorem-1 self-attention layer computing ``conv`` (same weights, bias, padding, stride, dilation).

    Args:
        conv: an ``nn.Conv2d`` with ``groups=1`` and zero padding (``padding_mode='zeros'``, numeric or ``'valid'``
            padding, or ``'same'`` where it is symmetric).
        alpha: attention sharpness ``α = σ²/2`` of every head; default :func:`hard_attention_alpha` of the weights'
            dtype.
    """
    if not isinstance(conv, nn.Conv2d) or isinstance(conv, nn.ConvTranspose2d):
        raise TypeError(f'Theorem 1 covers nn.Conv2d; got {type(conv).__name__} (transposed convolutions scatter '
                        f'rather than gather and have no attention form of this kind)')
    if conv.groups != 1:
        raise ValueError(f'groups={conv.groups}: Theorem 1 builds heads that see all input channels; a grouped or '
                         f'depthwise convolution would need one attention layer per group')
    if conv.padding_mode != 'zeros':
        raise ValueError(f"padding_mode={conv.padding_mode!r}: attention over a zero-padded grid reproduces only "
                         f"zero padding")
    kernel, stride, dilation = conv.kernel_size, conv.stride, conv.dilation
    padding = _numeric_padding(conv)
    out_chs, in_chs = conv.out_channels, conv.in_channels
    heads = kernel[0] * kernel[1]
    weight = conv.weight.detach()
    dd = dict(device=weight.device, dtype=weight.dtype)
    attn = PositionalSelfAttention(in_chs, heads, position='quadratic', attn_drop=0., proj_drop=0.,
                                   out_dim=out_chs, **dd)
    alpha = hard_attention_alpha(weight.dtype) if alpha is None else alpha
    with torch.no_grad():
        offsets = torch.tensor([(dilation[0] * u, dilation[1] * v) for u in range(kernel[0])
                                for v in range(kernel[1])], **dd)
        attn.pos.centers.copy_(offsets)  # head (u, v) attends to key = query + (d_h·u, d_w·v)
        attn.pos.spreads.fill_(math.sqrt(2. * alpha))  # logits -½σ²‖δ-μ‖² = -α‖δ-μ‖²
        # proj_heads block h (input channels of head h) is the kernel tap of offset h
        attn.proj_heads.weight.copy_(weight.permute(0, 2, 3, 1).reshape(out_chs, heads * in_chs))
        attn.proj_heads.bias.copy_(conv.bias.detach() if conv.bias is not None else torch.zeros(out_chs, **dd))
        attn.proj.weight.copy_(torch.eye(out_chs, **dd))
        attn.proj.bias.zero_()
    return ConvAsAttention(attn, kernel, stride, padding, dilation)


def _numeric_padding(conv: nn.Conv2d) -> Tuple[int, int]:
    if conv.padding == 'valid':
        return 0, 0
    if conv.padding == 'same':
        totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in totals):
            raise ValueError(f"padding='same' with kernel {conv.kernel_size} and dilation {conv.dilation} pads "
                             f"asymmetrically; Theorem 1 as built here needs symmetric zero padding")
        return totals[0] // 2, totals[1] // 2
    return tuple(conv.padding)


def convert_convs(model: nn.Module, predicate: Optional[Callable[[str, nn.Conv2d], bool]] = None,
                  alpha: Optional[float] = None) -> int:
    """Replace every convolution of ``model`` for which ``predicate(name, conv)`` holds (default: every ``k×k`` conv
    with k > 1 that Theorem 1 covers) by its :class:`ConvAsAttention`, in place. Returns how many were converted."""
    if predicate is None:
        def predicate(name: str, conv: nn.Conv2d) -> bool:
            symmetric = conv.padding != 'same' or all(d * (k - 1) % 2 == 0
                                                      for d, k in zip(conv.dilation, conv.kernel_size))
            return conv.groups == 1 and conv.padding_mode == 'zeros' and max(conv.kernel_size) > 1 and symmetric
    # every conversion first, then the swaps: a convolution that cannot be converted leaves the model as it was
    converted = [(name, conv_to_attention(m, alpha)) for name, m in model.named_modules()
                 if type(m) is nn.Conv2d and predicate(name, m)]
    for name, attention in converted:
        parent_name, _, child = name.rpartition('.')
        setattr(model.get_submodule(parent_name) if parent_name else model, child, attention)
    return len(converted)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    """Theorem 1 on a trained network: its CIFAR-10 test results before and after :func:`convert_convs`."""
    from .evaluate import predict_logits, scores
    parser = cli.parser(__spec__.name, main.__doc__)
    cli.add_test_set_args(parser)
    args = parser.parse_args(argv)

    model = cli.load_model(args).to(args.device)
    images, labels = cli.load_test_split(args)
    conv_logits = predict_logits(model, images, args.batch_size)
    converted = convert_convs(model)
    if not converted:
        raise cli.UsageError(f'{args.model} has no convolution that Theorem 1 covers (k×k with k > 1, groups=1, '
                             f'zero padding); nothing to convert: pass a convolutional network')
    attention_logits = predict_logits(model, images, args.batch_size)
    result = dict(
        model=args.model, converted_convs=converted, images=labels.shape[0],
        convolution=scores(conv_logits, labels), attention=scores(attention_logits, labels),
        changed_predictions=int((conv_logits.argmax(1) != attention_logits.argmax(1)).sum()),
        max_abs_logit_diff=float((conv_logits - attention_logits).abs().max()))
    cli.print_result(result, args.json, indent=2)
    return result


if __name__ == '__main__':
    cli.run(main)
