"""Evolving attention (Wang et al., "Evolving Attention with Residual Convolutions", ICML 2021, §3).

Each attention layer inherits the previous layer's pre-softmax logits through a residual connection and a 3×3
convolution over the stacked head maps (heads as channels, the ``N × N`` query-key map as the image)::

    M = (1 − r)·S + r·L_prev          S: this layer's logits (B, H, N, N), L_prev: the previous layer's evolved logits
    L = c·ReLU(Conv3×3_{H→H}(M)) + (1 − c)·M
    A = softmax_keys(L);  L is handed to the next layer

``r`` is ``evolve_residual`` and ``c`` ``evolve_conv_weight`` (``beta`` and ``alpha`` in the released code; the
paper's α/β naming is not used because its mapping to the code is unverified, spec ea-wang.md §1.3). Released
ImageNet values: r = 0.5, c = 1.0. A layer without a predecessor of the same map shape starts a new chain (L = S) and
owns no convolution; :func:`link_chain` decides that at construction.
"""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['AttentionEvolution', 'link_chain']


class AttentionEvolution(nn.Module):
    """The EA update of one layer: ``(S, L_prev) → L`` (both ``(B, H, N, N)`` pre-softmax logits)."""

    def __init__(self, num_heads: int, evolve_residual: float = 0.5, evolve_conv_weight: float = 1.0,
                 kernel_size: int = 3, device=None, dtype=None):
        super().__init__()
        for name, value in (('evolve_residual', evolve_residual), ('evolve_conv_weight', evolve_conv_weight)):
            if not 0. <= value <= 1.:
                raise ValueError(f'{name} must be in [0, 1], got {value}')
        self.num_heads = num_heads
        self.evolve_residual = evolve_residual
        self.evolve_conv_weight = evolve_conv_weight
        self.conv = nn.Conv2d(num_heads, num_heads, kernel_size, padding=kernel_size // 2, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.conv.weight, std=(num_heads * kernel_size ** 2) ** -0.5)  # fan-in, as released
        nn.init.zeros_(self.conv.bias)

    def forward(self, logits: torch.Tensor, prev: Optional[torch.Tensor]) -> torch.Tensor:
        if prev is None or prev.shape != logits.shape:
            got = 'nothing' if prev is None else f'logits of shape {list(prev.shape)}'
            raise ValueError(f'this evolving-attention layer expects the previous layer\'s logits of shape '
                             f'{list(logits.shape)} but got {got}: thread the chain state through the model\'s '
                             f'forward (layers are linked for the default input size)')
        mixed = (1. - self.evolve_residual) * logits + self.evolve_residual * prev
        # few channels on a large N×N image: channels_last convolution measured 2.6× faster on CPU (BENCHMARK.md);
        # the result goes back to the contiguous layout the softmax over keys wants
        evolved = F.relu(self.conv(mixed.contiguous(memory_format=torch.channels_last))).contiguous()
        if self.evolve_conv_weight == 1.:
            return evolved
        return self.evolve_conv_weight * evolved + (1. - self.evolve_conv_weight) * mixed


def link_chain(layers: Sequence[nn.Module], grids: Sequence[Tuple[int, int]], evolve_residual: float = 0.5,
               evolve_conv_weight: float = 1.0) -> int:
    """Give each attention layer whose predecessor has the same map shape an :class:`AttentionEvolution`.

    ``layers`` are in forward order, expose ``num_heads`` and an ``evolve`` attribute; ``grids`` are their attention
    grids at the model's default input size. Returns the number of evolved layers. Consecutive layers with the same
    map but different head counts cannot be chained (the convolution maps H heads to H heads): ``ValueError``.
    """
    if len(grids) != len(layers):
        raise ValueError(f'{len(layers)} layers but {len(grids)} grids')
    evolved = 0
    for index in range(1, len(layers)):
        prev, layer = layers[index - 1], layers[index]
        if tuple(grids[index - 1]) != tuple(grids[index]):
            continue  # another map shape: this layer starts a new chain
        if prev.num_heads != layer.num_heads:
            raise ValueError(f'attention layers {index - 1} and {index} share a {tuple(grids[index])} map but have '
                             f'{prev.num_heads} and {layer.num_heads} heads: evolving attention needs equal heads '
                             f'along a chain')
        ref = next(layer.parameters())
        layer.evolve = AttentionEvolution(layer.num_heads, evolve_residual, evolve_conv_weight,
                                          device=ref.device, dtype=ref.dtype)
        evolved += 1
    return evolved
