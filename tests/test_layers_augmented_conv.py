"""AAConv2d against a literal per-head, per-position reading of Bello et al. (2019), eq. 1–3 and §3.1."""
import math

import pytest
import torch
import torch.nn.functional as F

from timm_attnconv.layers import AAConv2d, aa_dims

from .kernels import TOL, assert_sdpa_kernels_match_explicit


def _naive_aa(layer: AAConv2d, x: torch.Tensor) -> torch.Tensor:
    """Loops over batch, head and query pixel; every index spelled out (catches head-split and reshape bugs)."""
    a = x
    for _ in range(layer.num_pools):
        a = F.avg_pool2d(a, 3, 2, 1, count_include_pad=False)
    batch, _, height, width = a.shape
    w_qkv = layer.qkv.weight[:, :, 0, 0]
    b_qkv = layer.qkv.bias if layer.qkv.bias is not None else torch.zeros(w_qkv.shape[0])
    dk, dv, heads = layer.dim_k, layer.dim_v, layer.num_heads
    dkh, dvh = dk // heads, dv // heads
    out = torch.zeros(batch, dv, height, width)
    for b in range(batch):
        for h in range(heads):
            rq = slice(h * dkh, (h + 1) * dkh)                     # head h owns channels h·d_kh … (head-major)
            rk = slice(dk + h * dkh, dk + (h + 1) * dkh)
            rv = slice(2 * dk + h * dvh, 2 * dk + (h + 1) * dvh)

            def wq(pixel):
                return w_qkv[rq] @ pixel + b_qkv[rq]

            def wk(pixel):
                return w_qkv[rk] @ pixel + b_qkv[rk]

            def wv(pixel):
                return w_qkv[rv] @ pixel + b_qkv[rv]

            for i in range(height):
                for j in range(width):
                    q = wq(a[b, :, i, j]) / math.sqrt(dkh)
                    logits = torch.empty(height, width)
                    for k in range(height):
                        for col in range(width):
                            logit = q @ wk(a[b, :, k, col])
                            if layer.rel_rows is not None:
                                logit = logit + q @ layer.rel_rows[k - i + layer.rel_rows.shape[0] // 2] \
                                    + q @ layer.rel_cols[col - j + layer.rel_cols.shape[0] // 2]
                            logits[k, col] = logit
                    probs = logits.flatten().softmax(0).reshape(height, width)
                    value = sum(probs[k, col] * wv(a[b, :, k, col])
                                for k in range(height) for col in range(width))
                    out[b, h * dvh:(h + 1) * dvh, i, j] = value
    attn = F.conv2d(out, layer.proj.weight, layer.proj.bias)
    out_size = (-(-x.shape[-2] // layer.stride), -(-x.shape[-1] // layer.stride))
    if attn.shape[-2:] != out_size:
        attn = F.interpolate(attn, size=out_size, mode='bilinear', align_corners=False)
    if layer.conv is None:
        return attn
    return torch.cat([layer.conv(x), attn], 1)


@pytest.mark.parametrize('stride,attn_pool,size,upsilon', [
    (1, False, (3, 4), 0.5), (2, False, (5, 7), 0.5), (1, True, (5, 6), 0.5), (1, False, (4, 3), 1.0)])
@pytest.mark.parametrize('kernel', ['auto', 'sdpa', 'sdpa_onehot', 'flex'])  # the fused kernels: for GPUs
def test_matches_the_naive_per_head_per_position_reference(stride, attn_pool, size, upsilon, kernel, eager_flex):
    layer = AAConv2d(6, 16, 3, stride, num_heads=2, kappa=0.5, upsilon=upsilon, min_dim_head_qk=3, attn_grid=size,
                     attn_pool=attn_pool, qkv_bias=True, proj_bias=True, attn_kernel=kernel).eval()
    for p in (layer.qkv.bias, layer.proj.bias):
        torch.nn.init.normal_(p)
    x = torch.randn(2, 6, *size)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _naive_aa(layer, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('stride,attn_pool,size', [(1, False, (4, 4)), (1, False, (3, 5)), (2, True, (9, 11))])
@pytest.mark.parametrize('rel_pos', [True, False])
def test_kernels_agree_with_the_explicit_maps_forward_and_gradients(stride, attn_pool, size, rel_pos, eager_flex):
    layer = AAConv2d(6, 16, 3, stride, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=size,
                     attn_pool=attn_pool, rel_pos=rel_pos)
    x = torch.randn(2, 6, *size)
    ref = assert_sdpa_kernels_match_explicit(layer, x)
    layer.attn_kernel = 'flex'  # forward only: FlexAttention has no backward on CPU
    with torch.no_grad():
        torch.testing.assert_close(layer(x), ref, **TOL)


@pytest.mark.parametrize('stride,upsilon', [(1, 0.5), (2, 0.5), (1, 1.0)])
@pytest.mark.parametrize('kernel', ['explicit', 'sdpa', 'sdpa_onehot', 'flex'])
def test_channels_last_in_channels_last_out_with_the_same_head_order(stride, upsilon, kernel, eager_flex):
    # the heads are combined NHWC: an NCHW map would cost the output projection a layout conversion
    layer = AAConv2d(6, 16, 3, stride, num_heads=2, kappa=0.5, upsilon=upsilon, min_dim_head_qk=3, attn_grid=(5, 6),
                     attn_kernel=kernel).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 6, 5, 6)
    seen = []
    layer.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        out = layer(x.contiguous(memory_format=torch.channels_last))
        for tensor in (seen[0], out):
            assert tensor.is_contiguous(memory_format=torch.channels_last) and not tensor.is_contiguous()
        torch.testing.assert_close(out, _naive_aa(layer, x), rtol=1e-4, atol=1e-5)


def test_relative_logits_shared_by_heads_and_grid_sizes_run():
    layer = AAConv2d(8, 16, 3, 1, num_heads=4, kappa=1.0, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 4))
    assert layer.rel_rows.shape == (7, layer.dim_k // 4) and layer.rel_cols.shape == (7, layer.dim_k // 4)
    for size in ((1, 1), (3, 9), (11, 5), (15, 8)):  # smaller grids slice the tables, larger ones interpolate
        out = layer(torch.randn(1, 8, *size))
        assert out.shape == (1, 16, *size) and torch.isfinite(out).all()
    strided = AAConv2d(8, 16, 3, 2, num_heads=2, kappa=1.0, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 4),
                       attn_pool=True)
    assert strided(torch.randn(1, 8, 15, 9)).shape == (1, 16, 8, 5)


def test_channel_order_is_conv_then_attention():
    layer = AAConv2d(4, 12, 3, 1, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 4)).eval()
    x = torch.randn(1, 4, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[:, :12 - layer.dim_v], layer.conv(x))


def test_dims_follow_the_floor_rules():
    assert aa_dims(128, 8, 0.2, 0.1) == (160, 8)   # stage 2 of AA-ResNet-50: the 20-per-head key floor
    assert aa_dims(512, 8, 0.2, 0.1) == (160, 48)
    assert aa_dims(512, 8, 0.25, 0.25) == (160, 128)
    assert aa_dims(2048, 8, 1.0, 1.0) == (2048, 2048)


@pytest.mark.parametrize('kwargs,match', [
    (dict(upsilon=0.01), 'upsilon=0.01'), (dict(upsilon=0), 'upsilon'), (dict(kappa=-1), 'kappa'),
    (dict(num_heads=0), 'num_heads'), (dict(stride=3), 'stride 1 or 2')])
def test_bad_settings_fail_at_construction(kwargs, match):
    args = dict(in_chs=16, out_chs=64, num_heads=8, kappa=0.2, upsilon=0.1, stride=1)
    with pytest.raises(ValueError, match=match):
        AAConv2d(**dict(args, **kwargs))


def test_wrong_input_channels_are_named():
    with pytest.raises(ValueError, match=r'expects \(B, 16, H, W\)'):
        AAConv2d(16, 64, upsilon=0.25)(torch.randn(1, 8, 7, 7))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('channels_last', [False, True])
def test_the_folded_bilinear_resize_is_interpolate(dtype, channels_last):
    # the attention output of a pooled layer, upsampled to the convolution's grid: values, gradients and the layout
    # of the form CUDA runs (tests/test_cuda.py checks it there; on CPU tensors the layer calls F.interpolate). An
    # empty batch too: folded, it would be an image of no channels, which the resize kernels refuse on both devices
    from timm_attnconv.layers.augmented_conv import _folded_resize
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for shape, size in (((3, 8, 14, 14), (28, 28)), ((2, 5, 4, 6), (7, 11)), ((1, 3, 5, 5), (5, 9)),
                        ((0, 8, 4, 4), (8, 8))):
        x = torch.randn(shape).to(dtype).contiguous(memory_format=memory_format).requires_grad_()
        out = _folded_resize(x, *size, channels_last)
        expected = F.interpolate(x, size=size, mode='bilinear', align_corners=False)
        if size == (28, 28):  # AA's 2× upsampling: bit for bit (the CPU's vector kernels round other ratios apart)
            assert torch.equal(out, expected)
        torch.testing.assert_close(out, expected)
        assert out.is_contiguous(memory_format=memory_format)
        grad = torch.randn_like(out)
        torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


def test_a_pooled_layer_keeps_channels_last():
    layer = AAConv2d(6, 16, 3, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=3, attn_grid=(5, 6),
                     attn_pool=True).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 6, 10, 12)
    with torch.no_grad():
        out = layer(x.contiguous(memory_format=torch.channels_last))
        assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
        torch.testing.assert_close(out, _naive_aa(layer, x), rtol=1e-4, atol=1e-5)
