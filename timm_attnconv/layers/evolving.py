"""Evolving attention (Wang et al., "Evolving Attention with Residual Convolutions", ICML 2021, §3).

Each attention layer inherits the previous layer's pre-softmax logits through a residual connection and a 3×3
convolution over the stacked head maps (heads as channels, the ``N × N`` query-key map as the image)::

    M = (1 − r)·S + r·L_prev          S: this layer's logits (B, H, N, N), L_prev: the previous layer's evolved logits
    L = c·ReLU(Conv3×3_{H→H}(M)) + (1 − c)·M
    A = softmax_keys(L);  L is handed to the next layer

``r`` is ``evolve_residual`` and ``c`` ``evolve_conv_weight``: ``beta`` and ``alpha`` in the authors' released code,
whose names and ImageNet values (r = 0.5, c = 1.0) are the ones used here. The paper writes the two weights as α and β
(§3); which of its symbols is which weight cannot be settled from the paper text at hand, so its naming is not used. A
layer without a predecessor of the same map shape starts a new chain (L = S) and owns no convolution;
:func:`link_chain` decides that at construction.

A chain runs through :class:`EvolvingChain`, the one loop of every EA model: the chain state (the evolved logits) is an
argument of each block's ``forward_chain(x, prev) → (x, logits)``, never state kept between calls, so gradient
checkpointing, FX, TorchScript, ``forward_intermediates`` and replication stay correct. timm's blocks (``Bottleneck``,
ViT ``Block``) call their attention with ``x`` alone; their EA subclasses keep timm's forward pass and reach the
attention layer through its :class:`ChainSlot` for the duration of one block call.
"""
import inspect
from typing import List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, register_notrace_module
from torch.utils.checkpoint import checkpoint

from .attention_interface import AttentionLayer
from .attention_kernels import attention_probs
from .augmented_conv import AAConv2d
from .evolution_kernel import fused_evolve_or_none
from .forward_errors import raise_value_error

__all__ = ['AttentionEvolution', 'ChainSlot', 'ChainedAAConv2d', 'ChainedAttention', 'EvolvingChain',
           'EVOLUTION_LAYOUTS', 'TIMM_TESTED', 'check_timm_api', 'link_chain', 'set_evolution_layout']

# how the update runs (AttentionEvolution.conv_layout), the default first: 'auto' ('triton' where its kernel runs,
# 'channels_last' elsewhere), 'channels_last' (the reference: F.conv2d over channels_last maps) and 'triton' (the whole
# update in one Triton kernel, evolution_kernel.py: inference on CUDA in an eager model; elsewhere a ValueError)
EVOLUTION_LAYOUTS = ('auto', 'channels_last', 'triton')
# the timm releases the test suite has passed with at both ends (setup.cfg's install_requires, checked by a test)
TIMM_TESTED = ('1.0.28', '1.0.31')


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
        # how the update runs, one of EVOLUTION_LAYOUTS (set_evolution_layout). 'auto': the Triton kernel where it
        # runs, inference on CUDA (an H100, bf16: EA-DeiT-S 1.51× and EA-AA-ResNet-50 1.12× the speed of
        # channels_last), channels_last elsewhere
        self.conv_layout = 'auto'
        self.conv = nn.Conv2d(num_heads, num_heads, kernel_size, padding=kernel_size // 2, device=device, dtype=dtype)
        nn.init.trunc_normal_(self.conv.weight, std=(num_heads * kernel_size ** 2) ** -0.5)  # fan-in, as released
        nn.init.zeros_(self.conv.bias)

    def forward(self, logits: torch.Tensor, prev: Optional[torch.Tensor]) -> torch.Tensor:
        if prev is None or prev.shape != logits.shape:
            got = 'nothing' if prev is None else f'logits of shape {list(prev.shape)}'
            raise_value_error(f'this evolving-attention layer expects the previous layer\'s logits of shape '
                              f'{list(logits.shape)} but got {got}: thread the chain state through the model\'s '
                              f'forward (layers are linked for the default input size)')
        assert prev is not None  # it is, past the check: TorchScript's type refinement reads an assert, not a call
        weight, bias, residual, conv_weight = (self.conv.weight, self.conv.bias, self.evolve_residual,
                                               self.evolve_conv_weight)
        # a Python int, also under torch.jit.trace (fvcore), where torch 2.8 passed one derived from the traced
        # weight's shape to the convolution as an empty padding
        padding = self.conv.kernel_size[0] // 2
        if torch.jit.is_scripting():
            if self.conv_layout == 'triton':
                raise ValueError("evolution layout 'triton' cannot run in a TorchScript model (it cannot launch the "
                                 "Triton kernel): use the layout 'auto' or 'channels_last' (set_evolution_layout)")
        elif self.conv_layout == 'triton' or (self.conv_layout == 'auto' and not torch.compiler.is_compiling()):
            evolved = fused_evolve_or_none(logits, prev, weight, bias, residual, conv_weight,
                                           forced=self.conv_layout == 'triton')
            if evolved is not None:
                return evolved
        # 'channels_last', and 'auto' where the kernel cannot run (gradients, CPU, compiled graphs): the same update
        return _evolve(logits, prev, weight, bias, residual, conv_weight, padding)


def _evolve(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            residual: float, conv_weight: float, padding: int) -> torch.Tensor:
    """The EA update ``(S, L_prev) → L`` of the module docstring with the convolution ``(weight, bias)`` (zero
    ``padding``, the same size out) over channels_last maps, in the dtype of the maps."""
    # M = (1 − r)·S + r·L_prev: one pass with one rounding in the maps' dtype (three with mul, mul, add); lerp
    # does not promote dtypes, and a chain's layers all form their logits alike, so the cast is a no-op. Heads as
    # channels, few of them on a large N×N image: on CPU the convolution alone ran 2.6× faster channels_last than
    # NCHW, whole models up to 1.1× (BENCHMARK.md)
    mixed = torch.lerp(logits, prev.to(logits.dtype), residual).contiguous(memory_format=torch.channels_last)
    evolved = F.relu(_conv_in_maps_dtype(mixed, weight, bias, padding), inplace=True)  # its backward needs no output
    if conv_weight != 1.:
        evolved = torch.lerp(mixed, evolved, conv_weight)  # c·conv + (1 − c)·M
    return evolved.contiguous()  # the layout the softmax over keys wants


def _conv_in_maps_dtype(maps: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], padding: int
                        ) -> torch.Tensor:
    # Autocast would run the convolution in its own dtype: maps in another one (fp32 logits of position-only
    # quadratic scores under bf16 autocast) were cast down here and promoted back by the next mix, a round trip
    # per layer. Run it in the maps' dtype: bf16 maps (every product of q·k under autocast) are unchanged.
    if torch.jit.is_scripting():
        # TorchScript ignores autocast contexts in scripted code: under autocast the conv keeps autocast's dtype
        return F.conv2d(maps, weight, bias, padding=padding).to(maps.dtype)
    bias = bias.to(maps.dtype) if bias is not None else None
    with torch.autocast(maps.device.type, enabled=False):
        return F.conv2d(maps, weight.to(maps.dtype), bias, padding=padding)


def set_evolution_layout(model: nn.Module, layout: str) -> nn.Module:
    """Run the update of every :class:`AttentionEvolution` of ``model`` in ``layout``, one of
    :data:`EVOLUTION_LAYOUTS`: ``'triton'`` runs mix, convolution, bias and ReLU in one Triton kernel that reads each
    map once (:mod:`~timm_attnconv.layers.evolution_kernel`), which runs for inference on CUDA outside a compiled
    graph; elsewhere (a gradient, CPU tensors, a compiled or scripted model, maps whose kernel failed) the forward
    pass raises a ``ValueError`` that says why. ``'channels_last'`` runs the reference (``F.conv2d`` over
    channels_last maps); ``'auto'`` (the default) runs ``'triton'`` where it can and ``'channels_last'`` elsewhere.
    The same update, up to the rounding of sums in another order: on an H200
    (bf16 inference) the kernel ran EA-DeiT-S 1.33× as fast as the reference and EA-AA-ResNet-50 level with it
    (BENCHMARK.md, session 63). Returns ``model``."""
    if layout not in EVOLUTION_LAYOUTS:
        raise ValueError(f'layout must be one of {EVOLUTION_LAYOUTS}, got {layout!r}')
    for module in model.modules():
        if isinstance(module, AttentionEvolution):
            module.conv_layout = layout
    return model


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


@register_notrace_module  # the loop threads a tuple state through blocks: one leaf for FX, which TorchScript compiles
class EvolvingChain(nn.Sequential):
    """``nn.Sequential`` that threads the chain state through its blocks: the one loop of every EA model.

    A block takes part through ``forward_chain(x, prev) → (x, logits)``; a block without it (no attention layer, or a
    model built without evolution) runs as it would anywhere and ends the chain. A chain is such a block itself, so
    stages of blocks nest. Slicing keeps the type (timm's ``prune_intermediate_layers`` slices).
    """

    def forward(
            self,
            x: torch.Tensor,
            prev: Optional[torch.Tensor] = None,
            checkpointing: bool = False,
            take_indices: Optional[List[int]] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], List[torch.Tensor]]:
        """``(x, chain state) → (x, chain state, outputs of the blocks at take_indices)``; ``checkpointing`` puts
        each block under its own gradient checkpoint."""
        intermediates: List[torch.Tensor] = []
        for index, block in enumerate(self):
            if not hasattr(block, 'forward_chain'):  # TorchScript decides this per block when it compiles
                if checkpointing and not torch.jit.is_scripting():
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
                prev = None
            elif checkpointing and not torch.jit.is_scripting():
                x, prev = checkpoint(block.forward_chain, x, prev, use_reentrant=False)
            else:
                x, prev = block.forward_chain(x, prev)
            if take_indices is not None and index in take_indices:
                intermediates.append(x)
        return x, prev, intermediates

    def forward_chain(
            self,
            x: torch.Tensor,
            prev: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        x, prev, _ = self.forward(x, prev)
        return x, prev


class ChainSlot:
    """Mixin for an attention layer that its block calls with ``x`` alone (timm's ``Bottleneck`` and ``Block``).

    The block puts the previous layer's logits in (:meth:`chain_put`), runs its own forward pass, in which the layer's
    ``forward`` runs :meth:`chain_step`, and takes this layer's logits out (:meth:`chain_take`), which empties the
    slot: tensors sit on the layer for that one block call only. The layer implements ``forward_chain(x, prev)``.
    """
    chain_prev: Optional[torch.Tensor]
    chain_logits: Optional[torch.Tensor]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chain_prev = None
        self.chain_logits = None

    def chain_put(self, prev: Optional[torch.Tensor]) -> None:
        self.chain_prev = prev
        self.chain_logits = None

    def chain_step(self, x: torch.Tensor) -> torch.Tensor:
        out, logits = self.forward_chain(x, self.chain_prev)
        self.chain_logits = logits
        return out

    def chain_take(self) -> torch.Tensor:
        logits = self.chain_logits
        self.chain_prev = None
        self.chain_logits = None
        if logits is None:
            raise RuntimeError('the block\'s forward pass did not call its attention layer once: timm\'s block '
                               'forward changed; install a timm release in the range setup.cfg states')
        return logits


class ChainedAAConv2d(ChainSlot, AAConv2d):
    """:class:`AAConv2d` as the 3×3 of timm's ``Bottleneck`` in an EA chain: its forward is the chain step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chain_step(x)


# what ChainedAttention.forward_chain reads of timm's Attention
ATTENTION_PARTS = ('num_heads', 'head_dim', 'attn_dim', 'scale', 'qkv', 'q_norm', 'k_norm', 'attn_drop', 'norm',
                   'gate', 'proj', 'proj_drop')


class ChainedAttention(ChainSlot, AttentionLayer, Attention):
    """timm's ViT ``Attention`` (its parameters, their names and initialisation) as a member of an EA chain.

    The maps are convolved and handed on (Wang et al. 2021, §3), so this layer forms its logits explicitly, class
    token included, never through timm's fused kernel (SDPA): :meth:`forward_chain` is its attention. It equals
    timm's unfused ``Attention`` at a chain start (tested), so a timm release that changes that forward fails the tests
    loudly.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_timm_api(Attention, ('x', 'attn_mask', 'is_causal'), self, ATTENTION_PARTS)
        self.init_attention(self.num_heads)  # it always forms its maps: explicit_maps() changes nothing

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise_value_error('evolving attention convolves full attention maps: attention masks are not supported')
        return self.chain_step(x)

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, previous logits) → (output, logits to hand on)``; without ``self.evolve`` ``prev`` is ignored."""
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q) * self.scale, self.k_norm(k)
        logits = q @ k.transpose(-2, -1)
        del q, k  # the scaled queries, a (B, heads, N, d) tensor, not held at the maps' peak (BENCHMARK.md)
        if self.evolve is not None:
            logits = self.evolve(logits, prev)
        return self._project(x, self.attn_drop(attention_probs(self.logits_tap(logits))) @ v), logits

    def _project(self, x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        # (B, h, N, d) → (B, N, C): timm's Attention after its attention product
        batch, tokens = x.shape[0], x.shape[1]
        y = self.norm(heads.transpose(1, 2).reshape(batch, tokens, self.attn_dim))
        if self.gate is not None:
            y = y * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(y))


def check_timm_api(base: type, forward_args: Tuple[str, ...], module: nn.Module, attributes: Sequence[str]) -> None:
    """Raise unless timm's ``base`` still has the ``forward`` arguments and the attributes an EA subclass relies on.

    The EA subclasses keep timm's forward passes (or, for ``Attention``, its parts): a timm release that changes them
    must stop the model at construction, not give it silently different logits.
    """
    args = tuple(inspect.signature(base.forward).parameters)[1:]
    missing = [name for name in attributes if not hasattr(module, name)]
    if args != forward_args or missing:
        found = f'forward{args}' + (f' without {", ".join(missing)}' if missing else '')
        raise RuntimeError(
            f'timm {timm.__version__} changed {base.__module__}.{base.__qualname__}: timm_attnconv\'s evolving '
            f'attention builds on its forward{forward_args} with {", ".join(attributes)} (timm {TIMM_TESTED[0]} to '
            f'{TIMM_TESTED[1]}, setup.cfg) and found {found}. Install a timm release in that range.')
