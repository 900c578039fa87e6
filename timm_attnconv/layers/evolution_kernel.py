"""EA's update ``(S, L_prev) → L`` as one Triton kernel, and a layer's whole evolved attention as another (which
forms ``S`` itself or reads it), for inference on CUDA (Wang et al. 2021, §3, eq. 4–5).

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

Around the update the layer still writes ``S = q kᵀ`` (its matrix product), and the softmax over keys reads ``L`` and
writes the probabilities, which the product with the values reads again: seven passes over the maps per layer, where
``L`` must be written once and ``L_prev`` read once. :func:`fused_evolving_attention` (layout
``'triton_attention'``) is the whole attention of an evolved layer in one kernel that makes those two: a program takes
16 or 32 query rows of one image, every head, and a block of keys at a time; it forms ``S`` for its pairs and their
neighbours (the convolution's taps) as matrix products of the shifted query and key rows (``k²·H`` products of
``d`` channels per pair, ``k²`` times the layer's own ``q kᵀ``, on tensor cores in half precision), mixes in
``L_prev``, convolves, stores ``L`` for the next layer, and takes the softmax online with its product with the values,
as FlashAttention does (a running maximum and sum per query row). Axis terms of the logits (AA's relative logits)
enter as channels of ``q`` and ``k`` (:func:`~timm_attnconv.layers.attention_kernels.with_axis_channels`). A layer
starting a chain (no ``L_prev``) keeps its explicit maps. Forming ``S`` again for each tap costs ``k²`` times the
layer's ``q kᵀ`` (1.48 G multiply-adds per image in EA-DeiT-S); :func:`fused_evolving_attention_from_logits`
(layout ``'triton_attention_from_logits'``) is the same kernel reading ``S`` from the layer's own matrix product
instead: four passes over the maps per layer (``S`` written and read, ``L_prev`` read, ``L`` written), no product
formed twice.

The default layout of :class:`~timm_attnconv.layers.AttentionEvolution`, ``'auto'``, runs the first form wherever it
can run: on an H100, bf16 inference, EA-DeiT-S ran 1.51× and EA-AA-ResNet-50 1.12× as fast as with the reference update
(``python -m timm_attnconv.benchmark --evolution-layouts channels_last triton``, BENCHMARK.md). The second form and
the fused attentions are asked for by name until a GPU has timed them against the first (not measured yet).

On CUDA, Triton's autotuner picks the blocks and the warps once per map shape and dtype, at the first call. Forward
only: there is no autograd formula, so :func:`fused_evolution_unsupported_reason` and
:func:`fused_attention_unsupported_reason` send every call that needs a gradient (training), and calls inside a
compiled graph (inductor lowers the reference there), to the reference; so do the ``..._or_none`` functions for maps
whose kernel failed to build or run, once, with a warning.
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

__all__ = ['attention_shapes', 'fused_attention_unsupported_reason', 'fused_evolution_unsupported_reason',
           'fused_evolve', 'fused_evolve_or_none', 'fused_evolving_attention', 'fused_evolving_attention_or_none',
           'fused_evolving_attention_from_logits', 'fused_evolving_attention_from_logits_or_none',
           'fused_logits_attention_unsupported_reason', 'kernel_shapes']

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ACCUMULATORS = 2 * EVOLUTION_KERNEL_ACCUMULATORS
_MAX_HEADS = 16
# a tl.dot's least M, N and K: the least output heads of the matrix-product form, the least blocks of query rows and
# keys and the least channels of the fused attention
_MIN_DOT = 16
# the widest heads (query, key or value channels) the fused attention takes
_MAX_ATTENTION_HEAD_DIM = 128
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
    return max(_next_power_of_2(heads), _MIN_DOT if matmul else 1)


def kernel_shapes(heads: int, num_tokens: int, kernel_size: int, has_bias: bool, conv_weight: float,
                  matmul: bool) -> dict:
    """The constexpr arguments of the kernels in ``_evolution_triton`` (all but the autotuned ``BLOCK_Q``) for
    ``(B, heads, num_tokens, num_tokens)`` maps."""
    return dict(HEADS=heads, OUTS=_output_heads(heads, matmul), KSIZE=kernel_size,
                KEYS=_next_power_of_2(num_tokens), HAS_BIAS=has_bias, MIX_BACK=conv_weight != 1.)


def fused_evolution_unsupported_reason(logits: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                                       matmul: bool = False) -> Optional[str]:
    """Why :func:`fused_evolve` cannot run on these inputs in the form ``matmul`` names (``None`` when it can)."""
    reason = _inputs_reason(logits, (logits, prev, weight), weight)
    if reason:
        return reason
    heads, keys = logits.shape[1], _next_power_of_2(logits.shape[-1])
    if heads > _MAX_HEADS or _output_heads(heads, matmul) * keys > _MAX_ACCUMULATORS:
        return f'{heads} heads of {logits.shape[-1]} keys do not fit one program\'s registers'
    return _machine_reason(logits, _maps_key(logits, matmul))


def _inputs_reason(maps: torch.Tensor, inputs: Tuple[torch.Tensor, ...], weight: torch.Tensor) -> Optional[str]:
    # what both kernels need of their inputs: no graph (asked first: there shapes may be traced values), no
    # gradient, a dtype and a convolution they take
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
    # what both kernels need of the machine: Triton, CUDA (or the interpreter), and no failure for maps of this kind
    if not _triton_installed():
        return 'Triton is not installed'
    if maps.device.type != 'cuda' and not _interpreting():
        return f'the maps are on {maps.device.type}: the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1)'
    failed = _FAILURES.cause(key)
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
    form = 'matrix-product Triton kernel' if matmul else 'Triton kernel'
    return _run_or_none(_maps_key(logits, matmul), form, fused_evolve, logits, prev, weight, bias, residual,
                        conv_weight, matmul)


def _run_or_none(key: tuple, form: str, kernel, *args):
    try:
        return _FAILURES.run(key, kernel, *args)
    except KernelFailed as failure:
        warnings.warn(f"the {form} of EA's update failed on {key[0]} for {key[2]} heads of {key[3]} keys in "
                      f"{key[1]} ({failure}); such maps take the 'channels_last' layout (the same update)",
                      stacklevel=4)
        return None


def attention_shapes(heads: int, qk_dim: int, v_dim: int, kernel_size: int, has_bias: bool, conv_weight: float,
                     from_logits: bool = False) -> dict:
    """The constexpr arguments of ``_evolution_triton.evolving_attention`` (all but its autotuned blocks) for
    ``heads`` heads of ``qk_dim`` query and key channels (unused ``from_logits``: ``S`` is read) and ``v_dim`` value
    channels."""
    return dict(HEADS=heads, OUTS=_next_power_of_2(heads), KSIZE=kernel_size,
                QK_DIM=max(_MIN_DOT, _next_power_of_2(qk_dim)), V_DIM=max(_MIN_DOT, _next_power_of_2(v_dim)),
                HAS_BIAS=has_bias, MIX_BACK=conv_weight != 1., FROM_LOGITS=from_logits)


def _attention_key(maps: torch.Tensor, qk_dim: int, v: torch.Tensor) -> tuple:
    # qk_dim 0: the form that reads S
    return maps.device.type, maps.dtype, maps.shape[1], maps.shape[2], 'attention', qk_dim, v.shape[-1]


def _attention_reason(maps: torch.Tensor, inputs: Tuple[torch.Tensor, ...], qk_dim: int, v: torch.Tensor,
                      weight: torch.Tensor) -> Optional[str]:
    # what the fused attention needs, in either form (qk_dim 0: S is read)
    reason = _inputs_reason(maps, inputs, weight)
    if reason:
        return reason
    heads, widest = maps.shape[1], max(qk_dim, v.shape[-1])
    shapes = attention_shapes(heads, max(qk_dim, 1), v.shape[-1], weight.shape[-1], True, 1.)
    if (heads > _MAX_HEADS or widest > _MAX_ATTENTION_HEAD_DIM
            or shapes['OUTS'] * _MIN_DOT * (_MIN_DOT + shapes['V_DIM']) > _MAX_ACCUMULATORS):  # the least blocks
        return f'{heads} heads of {widest} channels do not fit one program\'s registers'
    return _machine_reason(maps, _attention_key(maps, qk_dim, v))


def fused_attention_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                                       weight: torch.Tensor) -> Optional[str]:
    """Why :func:`fused_evolving_attention` cannot run on these inputs (``None`` when it can)."""
    return _attention_reason(q, (q, k, v, prev, weight), q.shape[-1], v, weight)


def fused_logits_attention_unsupported_reason(logits: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                                              weight: torch.Tensor) -> Optional[str]:
    """Why :func:`fused_evolving_attention_from_logits` cannot run on these inputs (``None`` when it can)."""
    return _attention_reason(logits, (logits, v, prev, weight), 0, v, weight)


def _evolving_attention(q: torch.Tensor, k: torch.Tensor, logits: Optional[torch.Tensor], v: torch.Tensor,
                        prev: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: float,
                        conv_weight: float) -> Tuple[torch.Tensor, torch.Tensor]:
    # the kernel of both forms: S formed from q and k, or read from logits (then q and k are logits, unread)
    from . import _evolution_triton  # on first use: the package imports without Triton
    from_logits = logits is not None
    maps = logits if logits is not None else q
    batch, heads, num_tokens = maps.shape[:3]
    dtype, v_dim = maps.dtype, v.shape[-1]
    qk_dim = 1 if from_logits else q.shape[-1]
    k, v, prev = k.to(dtype), v.to(dtype), prev.to(dtype).contiguous()
    weight = weight.to(dtype).contiguous()  # the reference convolves in the maps' dtype
    has_bias = bias is not None
    bias = bias.to(dtype).contiguous() if bias is not None else weight  # without one, a pointer the kernel ignores
    s = logits.contiguous() if logits is not None else prev  # without S to read, a pointer the kernel ignores
    out = maps.new_empty(batch, heads, num_tokens, v_dim)
    evolved = maps.new_empty(batch, heads, num_tokens, num_tokens)
    args = (q, k, v, s, prev, weight, bias, out, evolved, num_tokens, qk_dim, v_dim, float(residual),
            float(conv_weight), *q.stride(), *k.stride(), *v.stride())
    shapes = attention_shapes(heads, qk_dim, v_dim, weight.shape[-1], has_bias, conv_weight, from_logits)
    autotuned = _evolution_triton.evolving_attention_autotuned
    if _interpreting():  # the interpreter cannot time configurations: the least blocks
        autotuned.fn[(batch, -(-num_tokens // _MIN_DOT))](*args, **shapes, BLOCK_Q=_MIN_DOT, BLOCK_K=_MIN_DOT,
                                                          num_warps=4)
    else:
        autotuned[lambda meta: (batch, -(-num_tokens // meta['BLOCK_Q']))](*args, **shapes)
    return out, evolved


def fused_evolving_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                             weight: torch.Tensor, bias: Optional[torch.Tensor], residual: float, conv_weight: float
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(L) v, L)``, ``L`` the update of ``S = q kᵀ`` (``q`` scaled) and ``prev`` that :func:`fused_evolve`
    computes, in one kernel that never writes ``S`` or the probabilities: each program forms the ``S`` of its pairs
    and of their neighbours (the convolution's taps) as matrix products, the update, stores ``L`` for the next layer,
    and takes the softmax over keys online (FlashAttention's running maximum and sum) with its product with ``v``.
    ``q``, ``k``: ``(B, H, N, d)``, ``v``: ``(B, H, N, d_v)``, any strides; ``prev``: ``(B, H, N, N)``. Returns
    ``(B, H, N, d_v)`` and ``(B, H, N, N)``, contiguous, in the dtype of ``q``. Check
    :func:`fused_attention_unsupported_reason` first."""
    return _evolving_attention(q, k, None, v, prev, weight, bias, residual, conv_weight)


def fused_evolving_attention_from_logits(logits: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                                         weight: torch.Tensor, bias: Optional[torch.Tensor], residual: float,
                                         conv_weight: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_evolving_attention` with ``S`` read from ``logits`` ``(B, H, N, N)``, the layer's own matrix
    product, instead of formed again for each tap: the update, ``L`` stored and the online softmax with its product
    with ``v`` in one kernel that never writes the probabilities. Check
    :func:`fused_logits_attention_unsupported_reason` first."""
    return _evolving_attention(logits, logits, logits, v, prev, weight, bias, residual, conv_weight)


def fused_evolving_attention_or_none(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                                     weight: torch.Tensor, bias: Optional[torch.Tensor], residual: float,
                                     conv_weight: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`fused_evolving_attention` where it can run, else ``None`` (the caller forms the logits and runs the
    update); failures as :func:`fused_evolve_or_none` handles them."""
    if fused_attention_unsupported_reason(q, k, v, prev, weight) is not None:
        return None
    return _run_or_none(_attention_key(q, q.shape[-1], v), 'fused-attention Triton kernel', fused_evolving_attention,
                        q, k, v, prev, weight, bias, residual, conv_weight)


def fused_evolving_attention_from_logits_or_none(logits: torch.Tensor, v: torch.Tensor, prev: torch.Tensor,
                                                 weight: torch.Tensor, bias: Optional[torch.Tensor], residual: float,
                                                 conv_weight: float) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`fused_evolving_attention_from_logits` where it can run, else ``None`` (the caller runs the update on
    ``logits``); failures as :func:`fused_evolve_or_none` handles them."""
    if fused_logits_attention_unsupported_reason(logits, v, prev, weight) is not None:
        return None
    return _run_or_none(_attention_key(logits, 0, v), 'fused-attention Triton kernel',
                        fused_evolving_attention_from_logits, logits, v, prev, weight, bias, residual, conv_weight)
