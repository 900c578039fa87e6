"""Attention whose logits add per-axis relative terms to ``q kᵀ``, through three kernels with one result.

Tokens lie on an ``(H, W)`` grid in row-major order (``N = H·W``). For the query at cell ``(i, j)`` and the key at
``(k, l)``::

    logit[(i,j), (k,l)] = scale · q_(i,j) · k_(k,l) + rows[(i,j), k] + cols[(i,j), l]

``rows`` ``(B or 1, h, H, W, H)`` and ``cols`` ``(B or 1, h, H, W, W)`` are the two axis terms: the 2-D relative
logits ``q·r^H_{k−i} + q·r^W_{l−j}`` of attention-augmented convolution (Bello et al. 2019, eq. 3;
:func:`~timm_attnconv.layers.rel_logits_2d`), the ``q·r`` scores of the content model of Cordonnier et al. (2020,
§4.2 with Ramachandran et al. 2019's relative logits), or a row+column position term that does not depend on the
input (broadcast over the batch). They hold ``O(N (H + W))`` numbers where the dense bias holds ``O(N²)``.

Kernels (:data:`ATTN_KERNELS`):

* ``'explicit'``: forms the ``(B, h, N, N)`` logits, adding the axis terms through their ``(H, W, H, W)`` view (in
  place where no gradient is needed; on CUDA as channels of the one matrix product, as ``'sdpa_onehot'`` below
  does, which writes the maps once). The reference; the only kernel that shows its maps (analysis, evolving
  attention), counts its FLOPs and exports everywhere (TorchScript, legacy ONNX).
* ``'sdpa'``: materialises the ``(B or 1, h, N, N)`` bias and hands it to ``F.scaled_dot_product_attention`` as an
  additive mask.
* ``'sdpa_onehot'``: the axis terms as channels, so that SDPA needs no mask: ``[scale·q, rows, cols]`` against
  ``[k, e_row(key), e_col(key)]`` (one-hot key channels pick each query's term for the key's row and column) is the
  logit above, exactly. Without a float mask ``F.scaled_dot_product_attention`` may take its fused kernels
  (FlashAttention, memory-efficient), which hold no ``N × N`` tensor either; the price is ``H + W`` more channels
  per head (zero-padded to a multiple of 8, the values to the same width, as FlashAttention wants one width).
* ``'flex'``: FlexAttention (``torch.nn.attention.flex_attention``); a ``score_mod`` adds ``rows`` and ``cols``
  inside the kernel, so no ``N × N`` tensor exists, forward or backward. Run compiled (eager FlexAttention forms the
  full score matrix); compiled once per shape, up to :data:`RECOMPILE_LIMIT` shapes. In a ``torch.compile``'d
  model the model's graph lowers it on CUDA; on CPU it runs as its own compiled kernel there too (a graph break). It
  cannot run on every input, :func:`flex_unsupported_reason` says why; ``'auto'`` then takes another kernel, a forced
  ``'flex'`` raises. Nor does its compiled kernel build for every shape on every GPU (Triton's shared memory: an H100
  could not fit the 400-channel heads of ``sa_learned_content_cifar`` with inductor's default blocks: heads wider
  than :data:`FLEX_WIDE_HEAD_DIM` now take one pipeline stage); such a shape is remembered, and
  :func:`relative_attention` runs SDPA there with a warning when the layer asked for ``'auto'``, or raises.
* ``'auto'``: the layer's own choice for the device, what it measured fastest there (``python -m
  timm_attnconv.benchmark --kernels``). On CPU ``'sdpa_onehot'`` wherever it applies. On CUDA, eager,
  ``'sdpa_onehot'`` for attention-augmented convolution (AA-ResNet-50 on an H100, bf16: 1.16× the explicit maps'
  speed, FlexAttention 1.09×, SDPA with the bias as its mask 0.80×); for the content model the explicit maps up to
  16×16 tokens (an H200, bf16, batch 256: the fastest, at 1,966 MB; FlexAttention 0.58× at 1,228 MB) and
  ``'flex'`` above where it can run (no ``N × N`` tensor where the maps grow as ``N²``), else ``'sdpa'``. In a
  ``torch.compile``'d model on CUDA ``'flex'`` for attention-augmented convolution (AA-ResNet-50 on an H100, bf16,
  compiled: 1.10× SDPA's speed with the least memory, 441 MB against 615; SDPA one-hot 0.96×) and ``'sdpa'`` for
  the content model, whose FlexAttention inside a compiled graph on a GPU is not yet measured. The explicit maps
  under tracing and ONNX export.
"""
import functools
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from .attention_interface import AttentionLayer
from .forward_errors import raise_value_error
from .kernel_failures import KernelFailed, KernelFailures

__all__ = ['ATTN_KERNELS', 'RECOMPILE_LIMIT', 'FlexKernelError', 'check_attn_kernel', 'relative_bias',
           'relative_logits', 'attention_probs', 'relative_attention', 'flex_unsupported_reason', 'choose_kernel',
           'run_compiled_alone', 'set_attn_kernel', 'with_axis_channels', 'matmul_shared_heads']

ATTN_KERNELS = ('auto', 'explicit', 'sdpa', 'sdpa_onehot', 'flex')
# Triton's tl.dot, which FlexAttention's CUDA kernel is built on, needs at least 16 channels per head
FLEX_MIN_HEAD_DIM = 16
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FlexAttention's compiled CPU kernel needs AVX2; read once: under torch.compile the query (a string, not a tensor)
# would break the graph on every call
_CPU_HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ('AVX2', 'AVX512')
# Inductor's default forward blocks for heads wider than 256 channels keep 3 pipeline stages of key and value blocks
# in shared memory: for the 400-channel heads of sa_learned_content_cifar (Triton pads them to 512) that asked for
# 264,192 bytes on an H100, which has 232,448 per block. One stage asks for half as much.
FLEX_WIDE_HEAD_DIM = 256
# Shapes a kernel compiled alone in an eager model (FlexAttention) is compiled for before
# dynamo gives up and runs its function uncompiled. Dynamo's own limit (recompile_limit, 8) counts every shape, grad
# mode and dtype of the one function: aa_resnet50 attends at 3 shapes per batch size, so training plus evaluation at
# two batch sizes already passes 8.
RECOMPILE_LIMIT = 64


class FlexKernelError(KernelFailed):
    """FlexAttention's compiled kernel failed for these inputs (the GPU's resources, a dynamo or inductor failure)."""


# the shapes whose compiled kernel failed, and why: each attempt costs a compilation, so none is made twice
_FLEX_FAILURES = KernelFailures()


def check_attn_kernel(kernel: str) -> str:
    """``kernel`` if it names one of :data:`ATTN_KERNELS`, else a ``ValueError`` that lists them."""
    if kernel not in ATTN_KERNELS:
        raise ValueError(f'attn_kernel must be one of {ATTN_KERNELS}, got {kernel!r}')
    return kernel


def relative_bias(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Axis terms ``(B', h, H, W, H)`` and ``(B', h, H, W, W)`` → the dense bias ``(B', h, H·W, H·W)``."""
    batch, heads, height, width = rows.shape[:4]
    return (rows[..., :, None] + cols[..., None, :]).reshape(batch, heads, height * width, height * width)


def relative_logits(
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float,
        rows: Optional[torch.Tensor] = None,
        cols: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The explicit logits ``(B, h, N, N)``: ``scale · q kᵀ`` plus the axis terms (or a dense ``bias``).

    ``q``, ``k``: ``(B, h, N, d)``; ``rows``/``cols``: the axis terms of the module docstring; ``bias``:
    ``(B or 1, h, N, N)``, for position terms without a row+column form.

    On CUDA the axis terms enter as channels of one matrix product (:func:`with_axis_channels`, as SDPA one-hot's
    do), which writes the maps once: added to them afterwards, each term was a pass that reads and writes the
    ``(B, h, N, N)`` maps, and on an H200 the two took 2.7 ms of EA-AA-ResNet-50's 30 ms per batch of 128
    (BENCHMARK.md's op profiles). On the CPU, and under tracing, they are added through the maps' ``(h, w, h, w)``
    view. Keys shared by every head (the content model's folded keys) enter as one tensor
    (:func:`matmul_shared_heads`).
    """
    if rows is not None and cols is not None and bias is None and q.is_cuda and not torch.jit.is_tracing():
        q, k = with_axis_channels(q, k, scale, rows, cols)
        return matmul_shared_heads(q, k.transpose(-1, -2))
    logits = matmul_shared_heads(q * scale if scale != 1.0 else q, k.transpose(-1, -2))
    if bias is not None:
        return logits + bias.to(logits.dtype)
    if rows is not None and cols is not None:
        row_terms, col_terms = rows.to(logits.dtype)[..., :, None], cols.to(logits.dtype)[..., None, :]
        height, width = rows.shape[2], rows.shape[3]
        as_grid = logits.view(q.shape[0], q.shape[1], height, width, height, width)
        if logits.requires_grad or torch.jit.is_tracing():
            # not in place through the view: autograd would clone and copy back the whole (hw)² gradient in the
            # backward pass (CopySlices), and a traced graph (legacy ONNX export) drops such writes. One new tensor,
            # the second add in place on it
            return as_grid.add(row_terms).add_(col_terms).view(logits.shape)
        # broadcast in place over the (h, w, h, w) view: no (hw)² bias tensor is ever allocated
        as_grid.add_(row_terms).add_(col_terms)
    return logits


def matmul_shared_heads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a`` ``(B, h, N, K)`` and ``b`` ``(B, h or 1, K, M)``: ``(B, h, N, M)``.

    Where ``b`` is one tensor for every head (a head axis of size 1 or stride 0: the tokens as every head's keys or
    values in the content model), one batched product of ``(B, h·N, K)`` and ``(B, K, M)``. ``a @ b`` would first
    copy ``b`` once per head, as ``torch.matmul`` expands a broadcast operand to full size, and its gradient would
    sum those copies again.
    """
    batch, heads, rows, inner = a.shape
    if b.dim() != 4 or b.shape[0] != batch:
        return a @ b
    one_head, b_heads = _one_head_if_shared(b)
    if b_heads != 1:
        return a @ b
    return torch.bmm(a.reshape(batch, heads * rows, inner), one_head[:, 0]).view(batch, heads, rows, b.shape[-1])


def attention_probs(logits: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the keys (last dim) of explicit logits, in the logits' dtype.

    CUDA autocast runs a ``softmax`` in fp32: bf16 logits would give an fp32 map ``(B, h, N, N)``, twice their size,
    which the next matmul casts back to bf16, two more passes over the largest tensor of the layer. With the dtype
    named, autocast leaves the op alone; the kernel still computes in fp32 and rounds once on the way out, as the cast
    did (CPU's vectorised kernel: 1 element in 10⁵ one rounding step apart, tested). On CPU, where autocast keeps a
    softmax in its input's dtype, nothing changes.
    """
    return logits.softmax(dim=-1, dtype=logits.dtype)


def relative_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        kernel: str,
        rows: Optional[torch.Tensor] = None,
        cols: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
        dropout_p: float = 0.,
        requested: Optional[str] = None,
) -> torch.Tensor:
    """``softmax(logits) v`` ``(B, h, N, d_v)`` through the fused kernel ``'sdpa'`` or ``'flex'``.

    ``logits`` as in :func:`relative_logits`. The explicit kernel is the caller's: it passes its maps through its
    ``logits_tap`` and its dropout module. ``kernel='flex'`` takes the axis terms only (see
    :func:`flex_unsupported_reason`); where its compiled kernel fails, SDPA runs instead (the same maths) if the
    layer's ``requested`` kernel was ``'auto'``, and otherwise a ``ValueError`` says why.
    """
    if q.shape[0] == 0:
        # an empty batch: the explicit maths, which every device runs on no batch. The fused kernels do not:
        # FlexAttention's score_mod cannot index no batch, and on CUDA (torch 2.11, an H200) SDPA returned None under
        # bf16 autocast and its memory-efficient kernel refused the stride-0 views of a compiled graph
        probs = attention_probs(relative_logits(q, k, scale, rows, cols, bias))
        return matmul_shared_heads(probs, v.to(probs.dtype))
    if kernel == 'flex' and not torch.jit.is_scripting():
        return _flex_or_fallback(q, k, v, scale, rows, cols, 'sdpa' if requested == 'auto' else None)
    if kernel == 'sdpa_onehot':
        if bias is not None:
            raise_value_error("attn_kernel='sdpa_onehot' takes row and column terms, not a dense bias: use 'sdpa'")
        if rows is not None and cols is not None:
            return _onehot_axis_attention(q, k, v, scale, rows, cols, dropout_p)
        kernel = 'sdpa'  # no position terms: plain attention, which SDPA runs fused as it is
    if kernel != 'sdpa':
        raise_value_error(
            f"relative_attention runs the fused kernels 'sdpa', 'sdpa_onehot' and 'flex', got '{kernel}'")
    if bias is None and rows is not None and cols is not None:
        bias = relative_bias(rows, cols)
    if bias is not None:
        bias = bias.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def _terms_per_query(rows: torch.Tensor, cols: torch.Tensor, batch: int) -> Tuple[torch.Tensor, torch.Tensor]:
    # (B', h, H, W, H) and (B', h, H, W, W) → (B, h, N, H) and (B, h, N, W): a row of terms per query token; stride 0
    # over a shared batch, so an input-independent term is not copied B times
    heads, height, width = rows.shape[1], rows.shape[2], rows.shape[3]
    return (rows.reshape(-1, heads, height * width, height).expand(batch, -1, -1, -1),
            cols.reshape(-1, heads, height * width, width).expand(batch, -1, -1, -1))


def _axis_onehot(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(H·W, H + W)``: for each key of the row-major grid, a one in its row's channel and one in its column's."""
    keys = torch.arange(height * width, device=device)
    return torch.cat([F.one_hot(keys // width, height), F.one_hot(keys % width, width)], dim=-1).to(dtype)


def with_axis_channels(q: torch.Tensor, k: torch.Tensor, scale: float, rows: torch.Tensor, cols: torch.Tensor,
                       min_channels: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[scale·q, rows, cols]`` and ``[k, e_row, e_col]``, zero-padded to a multiple of 8 channels (at least
    ``min_channels``): the product of a query's and a key's rows is ``scale q·k + rows[key's row] + cols[key's
    column]``, the logit (module docstring). Keys shared by every head (a stride-0 head axis) stay shared."""
    batch, heads, num_tokens, _ = q.shape
    height, width = rows.shape[2], rows.shape[3]
    channels = q.shape[-1] + height + width
    padding = (max(channels, min_channels) + 7) // 8 * 8 - channels
    rows, cols = _terms_per_query(rows.to(q.dtype), cols.to(q.dtype), batch)
    zeros = q.new_zeros(1, 1, 1, padding).expand(batch, heads, num_tokens, -1)
    q = torch.cat([q * scale if scale != 1.0 else q, rows, cols, zeros], dim=-1)
    k, key_heads = _one_head_if_shared(k)
    onehot = _axis_onehot(height, width, q.device, q.dtype).expand(batch, key_heads, -1, -1)
    keys = torch.cat([k.to(q.dtype), onehot, zeros[:, :key_heads]], dim=-1)
    return q, keys.expand(batch, heads, -1, -1)


def _one_head_if_shared(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    # (B, h, N, C) → its first head and 1 where every head is one tensor (a stride-0 view: the tokens as every head's
    # keys or values in the content model's inference form), else x and h: what is built from it (channels appended,
    # a cast) is then built once, not once per head
    if x.shape[1] > 1 and x.stride(1) == 0:
        return x[:, :1], 1
    return x, x.shape[1]


def _onehot_axis_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        rows: torch.Tensor, cols: torch.Tensor, dropout_p: float,
) -> torch.Tensor:
    # SDPA's own logit is the one of the axis channels: no mask (module docstring); one width for q, k and v
    value_dim, heads = v.shape[-1], v.shape[1]
    q, k = with_axis_channels(q, k, scale, rows, cols, value_dim)
    v, _ = _one_head_if_shared(v)
    v = F.pad(v.to(q.dtype), [0, q.shape[-1] - value_dim]).expand(-1, heads, -1, -1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=1.0)[..., :value_dim]


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    # eager flex_attention materialises the full score matrix; the compiled kernel never does. Static shapes: one
    # kernel per shape (a model has few: one per attention grid and head size), and torch 2.14's dynamic-shape CPU
    # kernel does not compile (undeclared cur_kvSplitSize in the generated C++)
    return torch.compile(flex_attention, dynamic=False)


def _pad_head_dim(x: torch.Tensor) -> torch.Tensor:
    # zero channels add nothing to q·k, and the zero value channels they give are sliced off
    return F.pad(x, (0, FLEX_MIN_HEAD_DIM - x.shape[-1])) if x.shape[-1] < FLEX_MIN_HEAD_DIM else x


def _flex_kernel_options(device_type: str, head_dim: int) -> Optional[Dict[str, int]]:
    # Triton's kernel only (CUDA); the CPU kernel has no pipeline stages
    if device_type == 'cuda' and head_dim > FLEX_WIDE_HEAD_DIM:
        return {'fwd_num_stages': 1}
    return None


def _axis_score_mod(rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], batch: int):
    # the key's row and column pick a term of the query's rows. No terms: plain attention (None)
    if rows is None or cols is None:
        return None
    width = rows.shape[3]
    rows, cols = _terms_per_query(rows, cols, batch)

    def add_axis_terms(score, b, h, q_idx, kv_idx):
        return score + rows[b, h, q_idx, kv_idx // width] + cols[b, h, q_idx, kv_idx % width]
    return add_axis_terms


def _flex_or_fallback(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], fallback: Optional[str],
) -> torch.Tensor:
    try:
        return _flex_relative_attention(q, k, v, scale, rows, cols)
    except FlexKernelError as error:
        if fallback is None:
            raise ValueError(f"attn_kernel='flex' cannot run here: {error}. Use attn_kernel='auto' (it takes SDPA "
                             f"there, with the same results), 'sdpa' or 'explicit'.") from error
        warnings.warn(f"{error}; attn_kernel='auto' takes '{fallback}' there (the same results)", stacklevel=3)
    return relative_attention(q, k, v, scale, fallback, rows, cols)


def _flex_relative_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        rows: Optional[torch.Tensor], cols: Optional[torch.Tensor],
) -> torch.Tensor:
    value_dim = v.shape[-1]
    v = v.to(q.dtype)  # FlexAttention takes one dtype (autocast leaves a layer's tokens in fp32)
    if rows is not None and cols is not None:
        rows, cols = rows.to(q.dtype), cols.to(q.dtype)
    q, k, v = _pad_head_dim(q), _pad_head_dim(k), _pad_head_dim(v)
    options = _flex_kernel_options(q.device.type, max(q.shape[-1], v.shape[-1]))
    if torch.compiler.is_compiling() and q.device.type != 'cpu':
        # inside a torch.compile'd model the caller's graph lowers flex_attention (a failure there fails the model's
        # compilation: no fallback can catch it, hence the kernel options are set before, not after a failure)
        out = flex_attention(q, k, v, score_mod=_axis_score_mod(rows, cols, q.shape[0]), scale=scale,
                             kernel_options=options)
    else:
        out = _flex_compiled_alone(q, k, v, scale, rows, cols, options)
    return out[..., :value_dim]


def run_compiled_alone(compiled: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """``compiled(*args, **kwargs)``, a function compiled alone (static shapes) for an eager model, compiled for up to
    :data:`RECOMPILE_LIMIT` shapes before dynamo runs it uncompiled."""
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)):
        return compiled(*args, **kwargs)


# Inside a compiled model on CPU the kernel runs outside the model's graph: inductor's C++ FlexAttention template
# cannot read score terms that the graph itself computes (torch 2.14: "All the buffers in the score and mask
# subgraph should be in kernel_group.args.input_buffers"); a graph break makes them inputs of the kernel.
@torch.compiler.disable
def _flex_compiled_alone(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        rows: Optional[torch.Tensor], cols: Optional[torch.Tensor], options: Optional[Dict[str, int]],
) -> torch.Tensor:
    backward = torch.is_grad_enabled() and q.requires_grad
    signature = (q.device, q.dtype, backward, q.shape, k.shape, v.shape, None if rows is None else rows.shape)
    try:
        # past the limit FlexAttention would run unfused: every score in memory, at eager speed
        return _FLEX_FAILURES.run(signature, run_compiled_alone, _compiled_flex_attention(), q, k, v, scale=scale,
                                  kernel_options=options, score_mod=_axis_score_mod(rows, cols, q.shape[0]))
    except KernelFailed as failure:
        raise FlexKernelError(f"FlexAttention's compiled kernel failed on {q.device.type} for q {list(q.shape)}, "
                              f"v {list(v.shape)} {q.dtype} ({failure})") from failure


def _is_exporting() -> bool:
    """Whether ``torch.export`` traces. Before torch 2.14, dynamo answers ``torch.compiler.is_exporting()`` with True
    wherever it traces, under ``torch.compile`` too, which made every compiled model refuse FlexAttention (a forced
    ``'flex'`` failed, ``'auto'`` took SDPA); the flag that ``torch.export`` itself sets is read instead."""
    return getattr(torch.compiler, '_is_exporting_flag', False)


def flex_unsupported_reason(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: Optional[torch.Tensor] = None,
        dense_bias: bool = False,
        dropout_p: float = 0.,
) -> Optional[str]:
    """Why the ``'flex'`` kernel cannot run on these inputs (``None`` when it can), in words for an error message."""
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or _is_exporting():
        return 'exporters take the explicit (or SDPA) maths, which they can lower'
    if dense_bias:
        return 'the position term has no row+column form, so it is a dense bias that SDPA takes as its mask'
    if dropout_p > 0:
        return f'FlexAttention has no attention dropout (attn_drop={dropout_p} in training)'
    if q.device.type not in ('cuda', 'cpu'):
        return f'the kernel is used on CUDA and CPU only, the inputs are on {q.device.type}'
    if q.dtype not in FLEX_DTYPES:
        return f'FlexAttention takes {", ".join(str(d) for d in FLEX_DTYPES)}, the inputs are {q.dtype}'
    if q.device.type == 'cuda' and rows is not None and not isinstance(rows.shape[3], int):
        # the score_mod maps a key to its row and column by the grid's width; inside a graph compiled with dynamic
        # shapes that width is symbolic, and inductor failed to lower it (torch 2.11, an H200: "'ShapeAsConstantBuffer'
        # object has no attribute 'dtype'"). On CPU the kernel is compiled alone, for concrete sizes
        return ('the grid size is symbolic (torch.compile with dynamic=True), which inductor cannot lower into '
                "FlexAttention's score_mod on CUDA; compile with dynamic=False to use it")
    if q.device.type == 'cpu':
        needs_grad = any(t is not None and t.requires_grad for t in (q, k, v, rows))
        if torch.is_grad_enabled() and needs_grad:
            return (f'FlexAttention has no backward on CPU in torch {torch.__version__}: run inference under '
                    f'torch.no_grad() or train on CUDA')
        if not _CPU_HAS_AVX2:
            return 'FlexAttention\'s compiled CPU kernel needs AVX2'
    return None


def choose_kernel(
        requested: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: Optional[torch.Tensor],
        cpu_kernel: str,
        dense_bias: bool = False,
        dropout_p: float = 0.,
        cuda_kernel: str = 'flex',
        compiled_cuda_kernel: str = 'sdpa',
) -> str:
    """The kernel that runs: ``requested`` unless it is ``'auto'`` (module docstring: ``cpu_kernel``, ``cuda_kernel``
    and ``compiled_cuda_kernel`` are the layer's measured choices for each device, the last in a compiled model; a
    ``'flex'`` choice takes ``'sdpa'`` where FlexAttention cannot run), or a ``ValueError`` when a forced ``'flex'``
    cannot run here (the reason of :func:`flex_unsupported_reason`, and what to use instead)."""
    if requested == 'explicit' or requested == 'sdpa':
        return requested
    if requested == 'sdpa_onehot':
        if dense_bias:
            raise_value_error("attn_kernel='sdpa_onehot' cannot run here: the position term has no row+column "
                              "form, so there are no axis terms to turn into channels. Use attn_kernel='sdpa' (it "
                              "takes the dense bias as its mask), 'auto' or 'explicit'.")
        return requested
    if requested == 'auto':
        compiled = False
        if not torch.jit.is_scripting():
            if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
                return 'explicit'  # the reference maths, which every exporter lowers
            compiled = torch.compiler.is_compiling()
        if q.device.type == 'cpu':
            return cpu_kernel
        chosen = compiled_cuda_kernel if compiled else cuda_kernel
        if q.device.type == 'cuda' and chosen != 'flex':
            return chosen
    if torch.jit.is_scripting():
        reason: Optional[str] = 'TorchScript cannot compile FlexAttention'
    else:
        reason = flex_unsupported_reason(q, k, v, rows, dense_bias, dropout_p)
    if requested == 'flex':
        if reason is not None:
            raise_value_error(f"attn_kernel='flex' cannot run here: {reason}. Use attn_kernel='auto' (it takes a "
                              f"kernel that can run), 'sdpa' or 'explicit'.")
        return 'flex'
    return 'flex' if reason is None else 'sdpa'


def set_attn_kernel(model: nn.Module, kernel: str) -> nn.Module:
    """Set ``attn_kernel`` of every attention layer of ``model`` that has that choice
    (:class:`~timm_attnconv.layers.AAConv2d`, :class:`~timm_attnconv.layers.PositionalSelfAttention`); returns
    ``model``. Layers that always form their maps (an evolving-attention chain step, a position-only layer) keep
    their own paths."""
    check_attn_kernel(kernel)
    for module in model.modules():
        if isinstance(module, AttentionLayer) and hasattr(module, 'attn_kernel'):
            module.attn_kernel = kernel
    return model
