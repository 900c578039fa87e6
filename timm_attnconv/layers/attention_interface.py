"""The interface every attention layer of the package implements, and what analysis and evolving attention use of it.

An attention layer forms pre-softmax logits of shape ``(B or 1, num_heads, N, N)`` over ``N`` tokens and declares:

* ``num_heads``: the heads, the channels of its logits;
* ``logits_tap``: an ``nn.Identity`` that the logits pass through whenever the layer forms them, so that a forward
  hook there reads the maps without changing the output (:func:`~timm_attnconv.analysis.attention_maps`);
* ``evolve``: ``None``, or the :class:`~timm_attnconv.layers.AttentionEvolution` that
  :func:`~timm_attnconv.layers.link_chain` gives a layer inside an evolving-attention chain (Wang et al., ICML 2021,
  §3: each layer's logits are mixed with the previous layer's and convolved);
* ``forward_chain(x, prev) -> (out, logits)``: its forward pass inside such a chain, ``prev`` the previous layer's
  logits (None at the start of a chain), ``logits`` those it hands on;
* ``explicit_maps()``: a context manager in which each call forms the maps and passes them through ``logits_tap``,
  instead of a fast path that never materialises them (a factorised softmax, fused SDPA); outputs agree to float
  rounding.

A layer calls :meth:`AttentionLayer.init_attention` in ``__init__`` and checks ``form_maps`` wherever it would take a
fast path. A subclass of a timm module puts the interface before timm's class (``ChainedAttention(ChainSlot,
AttentionLayer, Attention)``), calls ``init_attention`` after timm's ``__init__``, and, if it keeps timm's fused path,
overrides ``explicit_maps`` to clear timm's ``fused_attn`` inside ``super().explicit_maps()``.
"""
from contextlib import ExitStack, contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

__all__ = ['AttentionLayer', 'attention_layers', 'explicit_attention']


class AttentionLayer(nn.Module):
    """Base of the package's attention layers: the attributes and methods of the module docstring."""

    def init_attention(self, num_heads: int) -> None:
        """Set the interface's attributes (after ``nn.Module.__init__``): no evolution, a tap, fast paths allowed."""
        self.num_heads = num_heads
        self.evolve: Optional[nn.Module] = None
        self.logits_tap = nn.Identity()
        self.form_maps = False

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(output, logits to hand on)`` of this layer inside an evolving-attention chain."""
        raise NotImplementedError(f'{type(self).__name__} cannot run inside an evolving-attention chain')

    @contextmanager
    def explicit_maps(self) -> Iterator['AttentionLayer']:
        """Within the block, every call forms the attention maps and passes the logits through ``logits_tap``."""
        previous, self.form_maps = self.form_maps, True
        try:
            yield self
        finally:
            self.form_maps = previous


def attention_layers(model: nn.Module) -> List[Tuple[str, AttentionLayer]]:
    """``(name, layer)`` of the :class:`AttentionLayer` s of ``model`` in registration order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, AttentionLayer)]


@contextmanager
def explicit_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Enter :meth:`AttentionLayer.explicit_maps` of every attention layer of ``model`` for the block."""
    with ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, AttentionLayer):
                stack.enter_context(module.explicit_maps())
        yield model
