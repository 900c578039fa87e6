"""EA's update ``(S, L_prev) → L`` as one Triton kernel, for inference on CUDA (Wang et al. 2021, §3, eq. 4–5).

The reference update (:func:`~timm_attnconv.layers.evolving.AttentionEvolution`, layout ``'channels_last'``) makes
separate passes over the ``(B, H, N, N)`` maps: the residual mix, a copy into channels_last, cuDNN's 3×3 convolution
over few channels (which cuDNN pads to 8), its bias, the ReLU, a copy back. On a GPU those passes were most of what EA
adds to its base model (BENCHMARK.md's op profiles: 12.7 of EA-DeiT-S's 22.3 ms per batch, where DeiT-S takes 6.5).
This kernel reads ``S`` and ``L_prev`` once and writes ``L`` once. Each program takes ``BLOCK_Q`` query rows of one
image with every key and every head: it forms the mixed maps ``M`` as it loads them (the rows next to its own too, the
convolution's zero-padded halo), accumulates all output heads in fp32, adds the bias, applies the ReLU (and the
``c``-weighted mix back to ``M``) and rounds once. ``M`` and the convolution's output are rounded to the maps' dtype
where the reference rounds them, and the weights are cast to it as the reference casts them.

The convolution itself runs in one of two forms:

- multiply-adds on the GPU's CUDA cores (``matmul=False``, layout ``'triton'``): ``H²·k²`` per query-key pair (576 in
  EA-AA-ResNet-50, 324 in EA-DeiT-S), 0.20 and 0.14 G per image, 5% and 3% of their base models' multiply-adds, but
  at a fifteenth of the rate of the tensor cores that run the rest in bf16 (an H100: 67 against 989 TFLOPS);
- matrix products (``matmul=True``, layout ``'triton_matmul'``), the pairs as rows and the ``H·k²`` taps as columns
  against the weights: in bf16 and fp16 these run on tensor cores, in fp32 as fp32 products (no TF32), as the
  reference's.

The default layout of :class:`~timm_attnconv.layers.AttentionEvolution`, ``'auto'``, runs the first form wherever it
can run: on an H100, bf16 inference, EA-DeiT-S ran 1.51× and EA-AA-ResNet-50 1.12× as fast as with the reference update
(``python -m timm_attnconv.benchmark --evolution-layouts channels_last triton``, BENCHMARK.md). The second form is asked
for by name until a GPU has timed it against the first (not measured yet).

On CUDA, Triton's autotuner picks the block of query rows and the warps once per map shape and dtype, at the first
call. Forward only: there is no autograd formula, so :func:`fused_evolution_unsupported_reason` sends every call that
needs a gradient (training), and calls inside a compiled graph (inductor lowers the reference there), to the
reference; so does :func:`fused_evolve_or_none` for maps whose kernel failed to build or run, once, with a warning.
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's interpreter: that is how the tests check them
without a GPU (except the matrix products in bf16, which the interpreter of Triton 3.8 gets wrong by orders of
magnitude: those the GPU checks).
"""
import functools
import importlib.util
import os
import warnings
from typing import Optional, Tuple

import torch

from ..constants import EVOLUTION_KERNEL_ACCUMULATORS
from .kernel_failures import KernelFailed, KernelFailures

__all__ = ['fused_evolution_unsupported_reason', 'fused_evolve', 'fused_evolve_or_none', 'kernel_shapes']

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ACCUMULATORS = 2 * EVOLUTION_KERNEL_ACCUMULATORS
_MAX_HEADS = 16
# the least output heads of the matrix-product form: a tl.dot's least N
_MATMUL_MIN_OUTS = 16
# (device type, dtype, heads, keys, matmul) → why the kernel failed for such maps: each try costs compilations, so
# none is made twice
_FAILURES = KernelFailures()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec('triton') is not None  # asked once: the check runs in every layer's forward


def _interpreting() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _maps_key(logits: torch.Tensor, matmul: bool) -> Tuple[str, torch.dtype, int, int, bool]:
    return logits.device.type, logits.dtype, logits.shape[1], logits.shape[-1], matmul


def _output_heads(heads: int, matmul: bool) -> int:
    # the output heads a program accumulates: a power of two, and a matrix product's least N
    return max(_next_power_of_2(heads), _MATMUL_MIN_OUTS if matmul else 1)


def kernel_shapes(heads: int, num_tokens: int, kernel_size: int, has_bias: bool, conv_weight: float,
                  matmul: bool) -> dict:
    """The constexpr arguments of the kernels in ``_evolution_triton`` (all but the autotuned ``BLOCK_Q``) for
    ``(B, heads, num_tokens, num_tokens)`` maps."""
    return dict(HEADS=heads, OUTS=_output_heads(heads, matmul), KSIZE=kernel_size,
                KEYS=_next_power_of_2(num_tokens), HAS_BIAS=has_bias, MIX_BACK=conv_weight != 1.)


def fused_evolution_unsupported_reason(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                                       matmul: bool = False) -> Optional[str]:
    """Why :func:`fused_evolve` cannot run on these inputs in the form ``matmul`` names (``None`` when it can)."""
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
    if heads > _MAX_HEADS or _output_heads(heads, matmul) * keys > _MAX_ACCUMULATORS:
        return f'{heads} heads of {logits.shape[-1]} keys do not fit one program\'s registers'
    if not _triton_installed():
        return 'Triton is not installed'
    if logits.device.type != 'cuda' and not _interpreting():
        return f'the maps are on {logits.device.type}: the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1)'
    failed = _FAILURES.cause(_maps_key(logits, matmul))
    if failed:
        return f'the kernel failed for such maps before ({failed})'
    return None


def fused_evolve(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 residual: float, conv_weight: float, matmul: bool = False) -> torch.Tensor:
    """``L = c·ReLU(conv(M)) + (1 − c)·M`` with ``M = (1 − r)·S + r·L_prev``: the reference update with the
    convolution ``(weight, bias)`` (zero padding, the same size out), in one kernel, the convolution as matrix products
    where ``matmul``. ``logits`` (``S``) and ``prev``: ``(B, H, N, N)``; returns ``L`` contiguous in the dtype of
    ``logits``. Check :func:`fused_evolution_unsupported_reason` first."""
    from . import _evolution_triton  # on first use: the package imports without Triton
    batch, heads, num_tokens, _ = logits.shape
    dtype = logits.dtype
    logits, prev = logits.contiguous(), prev.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()  # the reference convolves in the maps' dtype
    has_bias = bias is not None
    bias = bias.to(dtype).contiguous() if bias is not None else weight  # without one, a pointer the kernel ignores
    out = torch.empty_like(logits)
    args = (logits, prev, weight, bias, out, num_tokens, float(residual), float(conv_weight))
    shapes = kernel_shapes(heads, num_tokens, weight.shape[-1], has_bias, conv_weight, matmul)
    autotuned = _evolution_triton.evolve_as_matmul_autotuned if matmul else _evolution_triton.evolve_autotuned
    if _interpreting():  # the interpreter cannot time configurations: the middle one of the autotuner's
        block_q = max(1, EVOLUTION_KERNEL_ACCUMULATORS // (shapes['OUTS'] * shapes['KEYS']))
        autotuned.fn[(batch, -(-num_tokens // block_q))](*args, **shapes, BLOCK_Q=block_q, num_warps=4)
    else:
        autotuned[lambda meta: (batch, -(-num_tokens // meta['BLOCK_Q']))](*args, **shapes)
    return out


def fused_evolve_or_none(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         residual: float, conv_weight: float, matmul: bool = False) -> Optional[torch.Tensor]:
    """:func:`fused_evolve` where it can run, else ``None`` (the caller runs the reference). A kernel that fails to
    build or launch for some maps (Triton's compiler, the GPU's resources) is remembered and said once, with a
    warning; the device running out of memory is raised."""
    if fused_evolution_unsupported_reason(logits, prev, weight, matmul) is not None:
        return None
    key = _maps_key(logits, matmul)
    try:
        return _FAILURES.run(key, fused_evolve, logits, prev, weight, bias, residual, conv_weight, matmul)
    except KernelFailed as failure:
        form = 'matrix-product Triton kernel' if matmul else 'Triton kernel'
        warnings.warn(f"the {form} of EA's update failed on {key[0]} for {key[2]} heads of {key[3]} keys in "
                      f"{key[1]} ({failure}); such maps take the 'channels_last' layout (the same update)",
                      stacklevel=3)
        return None
