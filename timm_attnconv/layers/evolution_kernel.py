"""EA's update ``(S, L_prev) → L`` as one Triton kernel, for inference on CUDA (Wang et al. 2021, §3, eq. 4–5).

The reference update (:func:`~timm_attnconv.layers.evolving.AttentionEvolution`, layout ``'channels_last'``) makes
separate passes over the ``(B, H, N, N)`` maps: the residual mix, a copy into channels_last, cuDNN's 3×3 convolution
over few channels (which cuDNN pads to 8), its bias, the ReLU, a copy back. On a GPU those passes were most of what EA
adds to its base model (BENCHMARK.md's op profiles: 12.6 of EA-DeiT-S's 22.3 ms per batch, where DeiT-S takes 6.5).
This kernel reads ``S`` and ``L_prev`` once and writes ``L`` once. Each program takes ``BLOCK_Q`` query rows of one
image with every key and every head: it forms the mixed maps ``M`` as it loads them (the rows next to its own too, the
convolution's zero-padded halo), accumulates all output heads in fp32, adds the bias, applies the ReLU (and the
``c``-weighted mix back to ``M``) and rounds once. ``M`` and the convolution's output are rounded to the maps' dtype
where the reference rounds them, and the weights are cast to it as the reference casts them.

Forward only: there is no autograd formula, so :func:`fused_evolution_unsupported_reason` sends every call that needs
a gradient (training), and calls inside a compiled graph (inductor lowers the reference there), to the reference.
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors through Triton's interpreter: that is how the tests check it
without a GPU.
"""
import importlib.util
import os
from typing import Optional

import torch

__all__ = ['fused_evolution_unsupported_reason', 'fused_evolve']

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32 accumulators one program holds: output heads (padded to a power of two) × query rows × keys (padded likewise).
# 8,192 are 64 registers a thread in 4 warps; the largest maps (KEYS · heads up to 16,384) take 8 warps
_ACCUMULATORS = 8192
_MAX_ACCUMULATORS = 16384
_MAX_HEADS = 16


def _interpreting() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def fused_evolution_unsupported_reason(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor
                                       ) -> Optional[str]:
    """Why :func:`fused_evolve` cannot run on these inputs (``None`` when it can)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return 'inside a compiled or traced graph the reference update runs (inductor lowers it there)'
    if torch.is_grad_enabled() and (logits.requires_grad or prev.requires_grad or weight.requires_grad):
        return 'a gradient is needed and the Triton kernel has no backward (run inference under torch.no_grad())'
    if logits.dtype not in _DTYPES:
        return f'maps in {logits.dtype}: the kernel takes {", ".join(str(d) for d in _DTYPES)}'
    size = weight.shape[-1]
    if weight.shape[-2] != size or size % 2 == 0:
        return f'a {weight.shape[-2]}×{size} kernel: the fused update takes odd square kernels'
    heads, keys = logits.shape[1], _next_power_of_2(logits.shape[-1])
    if heads > _MAX_HEADS or _next_power_of_2(heads) * keys > _MAX_ACCUMULATORS:
        return f'{heads} heads of {logits.shape[-1]} keys do not fit one program\'s registers'
    if importlib.util.find_spec('triton') is None:
        return 'Triton is not installed'
    if logits.device.type != 'cuda' and not _interpreting():
        return f'the maps are on {logits.device.type}: the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1)'
    return None


def fused_evolve(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: float, conv_weight: float) -> torch.Tensor:
    """``L = c·ReLU(conv(M)) + (1 − c)·M`` with ``M = (1 − r)·S + r·L_prev``: the reference update with the
    convolution ``(weight, bias)`` (zero padding, the same size out), in one kernel. ``logits`` (``S``) and
    ``prev``: ``(B, H, N, N)``; returns ``L`` contiguous in the dtype of ``logits``. Check
    :func:`fused_evolution_unsupported_reason` first."""
    batch, heads, num_tokens, _ = logits.shape
    dtype = logits.dtype
    logits, prev = logits.contiguous(), prev.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()  # the reference convolves in the maps' dtype
    has_bias = bias is not None
    bias = bias.to(dtype).contiguous() if bias is not None else weight  # without one, a pointer the kernel ignores
    out = torch.empty_like(logits)
    heads_p2, keys = _next_power_of_2(heads), _next_power_of_2(num_tokens)
    block_q = max(1, _ACCUMULATORS // (heads_p2 * keys))
    grid = (batch, -(-num_tokens // block_q))
    from . import _evolution_triton  # on first use: the package imports without Triton
    _evolution_triton.evolve[grid](logits, prev, weight, bias, out, num_tokens, float(residual), float(conv_weight),
                    HEADS=heads, HEADS_P2=heads_p2, KSIZE=weight.shape[-1], BLOCK_Q=block_q, KEYS=keys,
                    HAS_BIAS=has_bias, MIX_BACK=conv_weight != 1.,
                    num_warps=4 if heads_p2 * block_q * keys <= _ACCUMULATORS else 8)
    return out
