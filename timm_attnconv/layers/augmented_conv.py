"""Attention-augmented convolution (Bello et al., ICCV 2019, §3).

``AAConv2d(X) = concat[Conv_kxk(X) → F_out − d_v channels, MHA(X) → d_v channels]`` where the multi-head attention
has 2-D relative position logits (eq. 3)::

    O_h = softmax((q_h k_hᵀ + S_H(q_h) + S_W(q_h)) / √d_kh) v_h         one 1x1 conv gives q, k, v (head-major)
    MHA = conv1x1( concat_h O_h )                                         W^O, d_v → d_v

``q`` is scaled by ``d_kh^-½`` before both the content and the relative logits, as the paper's appendix code does.
The relative tables ``r^H`` ``(2H−1, d_kh)`` and ``r^W`` ``(2W−1, d_kh)`` are shared across heads (not layers) and
sized for the attention grid at the model's default input size; other grid sizes take the central rows (smaller)
or a linear interpolation of the table over offsets (larger), see :func:`~timm_attnconv.layers.table_for_length`.
"""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module, to_2tuple, trunc_normal_, use_fused_attn

from .attention_interface import AttentionLayer
from .forward_errors import raise_value_error
from .relative import rel_logits_2d
from .attention_kernels import attention_probs, check_attn_kernel, choose_kernel, relative_attention, relative_logits

__all__ = ['AAConv2d', 'aa_dims']


def aa_dims(out_chs: int, num_heads: int, kappa: float, upsilon: float, min_dim_head_qk: int = 20) -> Tuple[int, int]:
    """``(d_k, d_v)`` = ``(max(N_h·⌊κ·F_out/N_h⌋, N_h·min_dim_head_qk), N_h·⌊υ·F_out/N_h⌋)``.

    The key floor (20 per head, §4.1) and flooring ``d_v`` to a multiple of the heads are what reproduce the paper's
    parameter counts (Table 3: 20.7M to 61.6M). Combinations with no attention channels are refused.
    """
    if num_heads < 1:
        raise ValueError(f'num_heads must be ≥ 1, got {num_heads}')
    if not 0 < upsilon <= 1:
        raise ValueError(f'upsilon (d_v / F_out) must be in (0, 1], got {upsilon}')
    if kappa <= 0:
        raise ValueError(f'kappa (d_k / F_out) must be > 0, got {kappa}')
    dim_k = max(num_heads * math.floor(kappa * out_chs / num_heads), num_heads * min_dim_head_qk)
    dim_v = num_heads * math.floor(upsilon * out_chs / num_heads)
    if dim_k == 0:
        raise ValueError(f'kappa={kappa} with {out_chs} output channels and min_dim_head_qk={min_dim_head_qk} '
                         f'gives no key channels: raise kappa or min_dim_head_qk')
    if dim_v == 0:
        raise ValueError(f'upsilon={upsilon} × {out_chs} output channels gives fewer value channels than '
                         f'{num_heads} heads: raise upsilon to at least {num_heads / out_chs:.3g} or use fewer heads')
    return dim_k, dim_v


def _resize_bilinear(x: torch.Tensor, height: int, width: int, channels_last: bool) -> torch.Tensor:
    """``F.interpolate(x, (height, width), mode='bilinear', align_corners=False)`` in the block's memory format.

    On CUDA, eager, with the images and channels folded into the channels of one channels_last image
    (:func:`_folded_resize`): PyTorch's CUDA kernel for NCHW maps (and its NHWC one below 16 channels) runs one
    thread per output pixel that loops over every image and channel. AA-ResNet-50's stage-2 upsample (8 channels,
    14² → 28², batch 128) took 213 µs per call that way on an H200, 4% of the model's time (BENCHMARK.md's op
    profiles). On the CPU the plain call was as fast or faster (its kernels share the images out among threads), and
    compiled graphs lower the resize themselves."""
    fold = x.is_cuda and not (channels_last and x.shape[1] >= 16)  # channels_last with 16 or more: already per value
    if not torch.jit.is_scripting():
        fold = fold and not torch.compiler.is_compiling()
    if fold:
        return _folded_resize(x, height, width, channels_last)
    return F.interpolate(x, size=(height, width), mode='bilinear', align_corners=False)  # in x's memory format


def _folded_resize(x: torch.Tensor, height: int, width: int, channels_last: bool) -> torch.Tensor:
    # (B, C, h, w) as (1, B·C, h, w) channels_last: the NHWC kernel, one thread per output value, each computed with
    # the expression of the NCHW kernel: the same values to a rounding step (bit for bit on the CPU at AA's 2× and
    # on CUDA in bf16; not in fp32 on CUDA, an H200, session 46)
    batch, channels = x.shape[0], x.shape[1]
    if batch == 0:  # no images fold into no channels, which the resize kernels refuse ("Non-empty 4D data tensor")
        out = F.interpolate(x, size=(height, width), mode='bilinear', align_corners=False)
    else:
        folded = x.reshape(1, batch * channels, x.shape[2], x.shape[3]).contiguous(memory_format=torch.channels_last)
        out = F.interpolate(folded, size=(height, width), mode='bilinear', align_corners=False)
        out = out.view(batch, channels, height, width)  # memory holds (h, w, B, C): laid out as the block expects
    return out.contiguous(memory_format=torch.channels_last) if channels_last else out.contiguous()


@register_notrace_module  # grid-size-dependent table slicing: a leaf for FX feature extraction
class AAConv2d(AttentionLayer):
    """Attention-augmented ``k×k`` convolution, a drop-in for ``nn.Conv2d(in_chs, out_chs, k, stride)``.

    Args:
        in_chs, out_chs, kernel_size, stride: as the convolution it replaces (``padding = k // 2``).
        num_heads: ``N_h``.
        kappa, upsilon: ``d_k / F_out`` and ``d_v / F_out`` before rounding (:func:`aa_dims`). ``upsilon=1`` is the
            fully attentional layer: no convolution branch.
        min_dim_head_qk: floor on key/query channels per head (20 in the paper).
        attn_grid: attention grid ``(H, W)`` at the model's default input size; sizes the relative tables.
        attn_pool: average-pool the attention input once more (3×3, stride 2) and upsample the attention output
            bilinearly to the convolution's size: the paper's memory saving for the largest AA stage.
        rel_pos: add the 2-D relative logits (the paper's "Relative" row of Table 7; off gives "None").
        qkv_bias, proj_bias: biases of the 1×1 convolutions (the appendix code's TF defaults have them).
        resize_tables: interpolate relative tables for grids larger than ``attn_grid`` (else ``ValueError``).
        attn_kernel: how the attention runs, one of :data:`~timm_attnconv.layers.ATTN_KERNELS`: ``'explicit'``
            (the ``(hw)²`` logits in place, the reference), ``'sdpa'`` (the relative logits as SDPA's additive mask),
            ``'sdpa_onehot'`` (the relative logits as query channels against one-hot key channels: SDPA without a
            mask), ``'flex'`` (FlexAttention adds them inside the kernel: no ``(hw)²`` tensor) or ``'auto'`` (default:
            ``'sdpa_onehot'``, measured fastest on CPU and, eager, on CUDA; ``'flex'`` in a compiled model on CUDA;
            the explicit maps wherever timm's fused attention is switched off). All agree to float rounding.

    A stride-2 layer average-pools the attention input (3×3, stride 2, padding 1, padding not counted) so that the
    attention runs at the output resolution: the paper is silent on strided AA layers, so they reuse the pooling it
    downsamples attention inputs with (§3.2), as the EA authors' released AA-ResNet does.
    """

    def __init__(
            self,
            in_chs: int,
            out_chs: int,
            kernel_size: int = 3,
            stride: int = 1,
            num_heads: int = 8,
            kappa: float = 0.2,
            upsilon: float = 0.1,
            min_dim_head_qk: int = 20,
            attn_grid: Tuple[int, int] = (14, 14),
            attn_pool: bool = False,
            rel_pos: bool = True,
            qkv_bias: bool = True,
            proj_bias: bool = True,
            resize_tables: bool = True,
            attn_kernel: str = 'auto',
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        if stride not in (1, 2):
            raise ValueError(f'AAConv2d supports stride 1 or 2, got {stride}')
        self.dim_k, self.dim_v = aa_dims(out_chs, num_heads, kappa, upsilon, min_dim_head_qk)
        if self.dim_v > out_chs:
            raise ValueError(f'upsilon={upsilon} asks for {self.dim_v} attention channels of {out_chs}')
        self.init_attention(num_heads)
        self.in_channels, self.out_channels, self.stride = in_chs, out_chs, stride
        self.dim_head_k = self.dim_k // num_heads
        self.scale = self.dim_head_k ** -0.5
        self.num_pools = int(stride == 2) + int(attn_pool)
        self.attn_grid = to_2tuple(attn_grid)
        self.resize_tables = resize_tables
        self.fused_attn = use_fused_attn()
        self.attn_kernel = check_attn_kernel(attn_kernel)

        conv_chs = out_chs - self.dim_v
        self.conv = nn.Conv2d(in_chs, conv_chs, kernel_size, stride, kernel_size // 2, bias=False, **dd) \
            if conv_chs > 0 else None
        self.qkv = nn.Conv2d(in_chs, 2 * self.dim_k + self.dim_v, 1, bias=qkv_bias, **dd)
        self.proj = nn.Conv2d(self.dim_v, self.dim_v, 1, bias=proj_bias, **dd)
        grid_h, grid_w = to_2tuple(attn_grid)
        if rel_pos:
            self.rel_rows = nn.Parameter(torch.empty(2 * grid_h - 1, self.dim_head_k, **dd))
            self.rel_cols = nn.Parameter(torch.empty(2 * grid_w - 1, self.dim_head_k, **dd))
        else:
            self.register_parameter('rel_rows', None)
            self.register_parameter('rel_cols', None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.conv is not None:
            nn.init.kaiming_normal_(self.conv.weight, mode='fan_out', nonlinearity='relu')
        trunc_normal_(self.qkv.weight, std=self.qkv.in_channels ** -0.5)
        trunc_normal_(self.proj.weight, std=self.proj.in_channels ** -0.5)
        for conv in (self.qkv, self.proj):
            if conv.bias is not None:
                nn.init.zeros_(conv.bias)
        if self.rel_rows is not None and self.rel_cols is not None:
            # std d_kh^-½: the appendix code passes it as the *mean* of tf.random_normal_initializer, a slip
            trunc_normal_(self.rel_rows, std=self.scale)
            trunc_normal_(self.rel_cols, std=self.scale)

    def _qkv(self, x: torch.Tensor):
        for _ in range(self.num_pools):
            x = F.avg_pool2d(x, 3, 2, 1, count_include_pad=False)
        batch, _, height, width = x.shape
        # sizes spelled out, never -1: an empty batch has no size to infer
        q, k, v = self.qkv(x).flatten(2).split([self.dim_k, self.dim_k, self.dim_v], dim=1)
        # head-major channels: channel c of q belongs to head c // d_kh (the appendix's split_heads_2d)
        q = q.reshape(batch, self.num_heads, self.dim_head_k, height * width).transpose(-1, -2) * self.scale
        k = k.reshape(batch, self.num_heads, self.dim_head_k, height * width).transpose(-1, -2)
        v = v.reshape(batch, self.num_heads, self.dim_v // self.num_heads, height * width).transpose(-1, -2)
        return q, k, v, (height, width)

    def _relative_terms(
            self, q: torch.Tensor, grid: Tuple[int, int]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        # (B, N_h, h, w, h) and (B, N_h, h, w, w): S_H and S_W of eq. 3 per query and key row / key column
        if self.rel_rows is None or self.rel_cols is None:
            return None, None
        height, width = grid
        q_grid = q.reshape(q.shape[0], self.num_heads, height, width, self.dim_head_k)
        rows, cols = rel_logits_2d(q_grid, q_grid, self.rel_rows, self.rel_cols, self.resize_tables)
        return rows, cols

    def _combine_heads(self, heads: torch.Tensor, grid: Tuple[int, int], channels_last: bool) -> torch.Tensor:
        # (B, N_h, hw, d_vh) → head-major channels (B, d_v, h, w): the transpose public ports forget (the appendix's
        # combine_heads_2d; leaderj1001/Attention-Augmented-Conv2d issues #21, #25). In the input's memory format:
        # an NCHW map in a channels_last model costs the output projection a layout conversion
        batch, height, width = heads.shape[0], grid[0], grid[1]
        if channels_last:  # (B, hw, N_h, d_vh) in memory: the same one copy, viewed as NCHW
            return heads.transpose(1, 2).reshape(batch, height, width, self.dim_v).permute(0, 3, 1, 2)
        return heads.transpose(-1, -2).reshape(batch, self.dim_v, height, width)

    def _output(self, x: torch.Tensor, heads: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        attn = self.proj(self._combine_heads(heads, grid, channels_last))
        out_h, out_w = -(-x.shape[-2] // self.stride), -(-x.shape[-1] // self.stride)  # the conv's 'same' output
        if attn.shape[-2] != out_h or attn.shape[-1] != out_w:
            attn = _resize_bilinear(attn, out_h, out_w, channels_last)
        if self.conv is None:
            return attn
        return torch.cat([self.conv(x), attn], dim=1)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise_value_error(f'AAConv2d expects (B, {self.in_channels}, H, W) input, got {list(x.shape)}')

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Tuple[int, int],
               kernel: Optional[str] = None) -> torch.Tensor:
        """``O_h`` of every head, ``(B, N_h, hw, d_vh)``, through ``kernel`` (default: the layer's choice)."""
        rows, cols = self._relative_terms(q, grid)
        if kernel is None:
            kernel = self._kernel(q, k, v, rows)
        if kernel == 'explicit':
            return attention_probs(self.logits_tap(relative_logits(q, k, 1.0, rows, cols))) @ v
        # q is scaled, the relative logits with it
        return relative_attention(q, k, v, 1.0, kernel, rows, cols, requested=self.attn_kernel)

    def _kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[torch.Tensor]) -> str:
        if self.form_maps or (self.attn_kernel == 'auto' and not self.fused_attn):
            return 'explicit'
        # SDPA without a mask beats the explicit maps on CPU (a float mask sends it to its slower math kernel):
        # AA-ResNet-20 1.36× at inference, 1.38× in training; and eager on an H100, AA-ResNet-50 1.16× where
        # FlexAttention gave 1.09×. Compiled on an H100, FlexAttention won: 1.10× SDPA, 1.15× SDPA one-hot.
        # BENCHMARK.md
        return choose_kernel(self.attn_kernel, q, k, v, rows, cpu_kernel='sdpa_onehot', cuda_kernel='sdpa_onehot',
                             compiled_cuda_kernel='flex')

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        q, k, v, grid = self._qkv(x)
        return self._output(x, self._heads(q, k, v, grid), grid)

    def forward_chain(self, x: torch.Tensor, prev: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward pass inside an evolving-attention chain (Wang et al. 2021): ``(output, logits to hand on)``.

        Without ``self.evolve`` the layer starts a chain and ignores ``prev``; the maps are materialised either way.
        """
        self._check_input(x)
        q, k, v, grid = self._qkv(x)
        rows, cols = self._relative_terms(q, grid)
        logits = relative_logits(q, k, 1.0, rows, cols)  # q is already scaled, the relative logits with it
        # the scaled queries and the axis terms are in the logits now: not held while the maps are evolved and
        # softmaxed, the layer's peak (EA-AA-ResNet-20, batch 64: 8 MB more with them, BENCHMARK.md)
        del q, k, rows, cols
        if self.evolve is not None:
            logits = self.evolve(logits, prev)
        return self._output(x, attention_probs(self.logits_tap(logits)) @ v, grid), logits
