"""EA's update ``(S, L_prev) → L`` as one Triton kernel, for inference on CUDA (Wang et al. 2021, §3, eq. 4–5).

The reference update (:func:`~timm_attnconv.layers.evolving.AttentionEvolution`, layout ``'channels_last'``) makes
separate passes over the ``(B, H, N, N)`` maps: the residual mix, a copy into channels_last, cuDNN's 3×3 convolution
over few channels (which cuDNN pads to 8), its bias, the ReLU, a copy back. On a GPU those passes were most of what EA
adds to its base model (BENCHMARK.md's op profiles: 12.7 of EA-DeiT-S's 22.3 ms per batch, where DeiT-S takes 6.5).
This kernel reads ``S`` and ``L_prev`` once and writes ``L`` once. Each program takes ``BLOCK_Q`` query rows of one
image with every key and every head: it forms the mixed maps ``M`` as it loads them (the rows next to its own too, the
convolution's zero-padded halo), accumulates all output heads in fp32 as multiply-adds on the GPU's CUDA cores
(``H²·k²`` per query-key pair: 576 in EA-AA-ResNet-50, 324 in EA-DeiT-S), adds the bias, applies the ReLU (and the
``c``-weighted mix back to ``M``) and rounds once. ``M`` and the convolution's output are rounded to the maps' dtype
where the reference rounds them, and the weights are cast to it as the reference casts them.

The default layout of :class:`~timm_attnconv.layers.AttentionEvolution`, ``'auto'``, runs it wherever it can run: on
an H200, bf16 inference, EA-DeiT-S ran 1.33× as fast as with the reference update and EA-AA-ResNet-50 level with it
(``python -m timm_attnconv.benchmark --evolution-layouts``, BENCHMARK.md, session 63). Two other kernels, the
convolution as matrix products on tensor cores and the layer's whole evolved attention in one kernel, were slower in
that run and were retired (BENCHMARK.md, "Retired forms").

On CUDA, Triton's autotuner picks the block and the warps once per map shape and dtype, at the first call. Forward
only: there is no autograd formula, so :func:`fused_evolution_unsupported_reason` sends every call that needs a
gradient (training), and calls inside a compiled graph (inductor lowers the reference there), to the reference; so
does :func:`fused_evolve_or_none` for maps whose kernel failed to build or run, once, with a warning. A layer forced to
the layout ``'triton'`` raises there instead, with that reason.
``TRITON_INTERPRET=1`` runs the kernel on CPU tensors through Triton's interpreter: that is how the tests check it
without a GPU.
"""
import functools
import importlib.util
import os
import warnings
from typing import Optional, Tuple

import torch

from ..constants import EVOLUTION_KERNEL_ACCUMULATORS
from .forward_errors import raise_value_error
from .kernel_failures import KernelFailed, KernelFailures

__all__ = ['FORCED_KERNEL_ERROR', 'fused_evolution_unsupported_reason', 'fused_evolve', 'fused_evolve_or_none',
           'kernel_shapes']

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ACCUMULATORS = 2 * EVOLUTION_KERNEL_ACCUMULATORS
_MAX_HEADS = 16
# what a layer in the layout 'triton' raises where the kernel cannot run ({reason}: why)
FORCED_KERNEL_ERROR = ("evolution layout 'triton' cannot run here: {reason}. Use the layout 'auto' (the default: "
                       "the kernel where it runs, the reference update elsewhere) or 'channels_last' "
                       "(set_evolution_layout)")
# (device type, dtype, heads, keys) → why the kernel failed for such maps: each try costs compilations, so
# none is made twice
_FAILURES = KernelFailures()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec('triton') is not None  # asked once: the check runs in every layer's forward


def _interpreting() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _maps_key(logits: torch.Tensor) -> Tuple[str, torch.dtype, int, int]:
    return logits.device.type, logits.dtype, logits.shape[1], logits.shape[-1]


def kernel_shapes(heads: int, num_tokens: int, kernel_size: int, has_bias: bool, conv_weight: float) -> dict:
    """The constexpr arguments of ``_evolution_triton.evolve`` (all but the autotuned ``BLOCK_Q``) for
    ``(B, heads, num_tokens, num_tokens)`` maps."""
    return dict(HEADS=heads, OUTS=_next_power_of_2(heads), KSIZE=kernel_size,
                KEYS=_next_power_of_2(num_tokens), HAS_BIAS=has_bias, MIX_BACK=conv_weight != 1.)


def fused_evolution_unsupported_reason(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor
                                       ) -> Optional[str]:
    """Why :func:`fused_evolve` cannot run on these inputs (``None`` when it can)."""
    reason = _inputs_reason(logits, (logits, prev, weight), weight)
    if reason:
        return reason
    heads, keys = logits.shape[1], _next_power_of_2(logits.shape[-1])
    if heads > _MAX_HEADS or _next_power_of_2(heads) * keys > _MAX_ACCUMULATORS:
        return f'{heads} heads of {logits.shape[-1]} keys do not fit one program\'s registers'
    return _machine_reason(logits, _maps_key(logits))


def _inputs_reason(maps: torch.Tensor, inputs: Tuple[torch.Tensor, ...], weight: torch.Tensor) -> Optional[str]:
    # what the kernel needs of its inputs: no graph (asked first: there shapes may be traced values), no gradient, a
    # dtype and a convolution it takes
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return 'inside a compiled or traced graph the reference update runs (inductor lowers it there)'
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return 'a gradient is needed and the Triton kernel has no backward (run inference under torch.no_grad())'
    if maps.shape[0] == 0:
        return 'an empty batch: nothing to launch the kernel for (the reference update returns it as it is)'
    if maps.dtype not in _DTYPES:
        return f'maps in {maps.dtype}: the kernel takes {", ".join(str(d) for d in _DTYPES)}'
    size = weight.shape[-1]
    if weight.shape[-2] != size or size % 2 == 0:
        return f'a {weight.shape[-2]}×{size} kernel: the fused update takes odd square kernels'
    return None


def _machine_reason(maps: torch.Tensor, key: tuple) -> Optional[str]:
    # what the kernel needs of the machine: Triton, CUDA (or the interpreter), and no failure for maps of this kind
    if not _triton_installed():
        return 'Triton is not installed'
    if maps.device.type != 'cuda' and not _interpreting():
        return f'the maps are on {maps.device.type}: the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1)'
    failed = _FAILURES.cause(key)
    if failed:
        return f'the kernel failed for such maps before ({failed})'
    return None


def fused_evolve(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: float, conv_weight: float) -> torch.Tensor:
    """``L = c·ReLU(conv(M)) + (1 − c)·M`` with ``M = (1 − r)·S + r·L_prev``: the reference update with the
    convolution ``(weight, bias)`` (zero padding, the same size out), in one kernel. ``logits`` (``S``) and
    ``prev``: ``(B, H, N, N)``; returns ``L`` contiguous in the dtype of ``logits``. Check
    :func:`fused_evolution_unsupported_reason` first."""
    from . import _evolution_triton  # on first use: the package imports without Triton
    batch, heads, num_tokens, _ = logits.shape
    dtype = logits.dtype
    logits, prev = logits.contiguous(), prev.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()  # the reference convolves in the maps' dtype
    has_bias = bias is not None
    bias = bias.to(dtype).contiguous() if bias is not None else weight  # without one, a pointer the kernel ignores
    out = torch.empty_like(logits)
    args = (logits, prev, weight, bias, out, num_tokens, float(residual), float(conv_weight))
    shapes = kernel_shapes(heads, num_tokens, weight.shape[-1], has_bias, conv_weight)
    autotuned = _evolution_triton.evolve_autotuned
    if _interpreting():  # the interpreter cannot time configurations: the middle one of the autotuner's
        block_q = max(1, EVOLUTION_KERNEL_ACCUMULATORS // (shapes['OUTS'] * shapes['KEYS']))
        autotuned.fn[(batch, -(-num_tokens // block_q))](*args, **shapes, BLOCK_Q=block_q, num_warps=4)
    else:
        autotuned[lambda meta: (batch, -(-num_tokens // meta['BLOCK_Q']))](*args, **shapes)
    return out


def fused_evolve_or_none(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         residual: float, conv_weight: float, forced: bool = False) -> Optional[torch.Tensor]:
    """:func:`fused_evolve` where it can run, else ``None`` (the caller runs the reference). A kernel that fails to
    build or launch for some maps (Triton's compiler, the GPU's resources) is remembered and said once, with a
    warning; the device running out of memory is raised. ``forced`` (the layout ``'triton'``): where the kernel
    cannot run, or failed, a ``ValueError`` that says why, not the reference; an empty batch, which the kernel has
    nothing to launch for, still gets ``None``."""
    reason = fused_evolution_unsupported_reason(logits, prev, weight)
    if reason is not None:
        if forced and logits.shape[0] != 0:
            raise_value_error(FORCED_KERNEL_ERROR.format(reason=reason))
        return None
    key = _maps_key(logits)
    try:
        return _FAILURES.run(key, fused_evolve, logits, prev, weight, bias, residual, conv_weight)
    except KernelFailed as failure:
        if forced:
            raise ValueError(FORCED_KERNEL_ERROR.format(reason=f'the kernel failed for such maps ({failure})')
                             ) from failure
        warnings.warn(f"the Triton kernel of EA's update failed on {key[0]} for {key[2]} heads of {key[3]} keys in "
                      f"{key[1]} ({failure}); such maps take the 'channels_last' layout (the same update)",
                      stacklevel=3)
        return None
