"""The EA update against a literal per-element reading of Wang et al. (2021), the chain rules, and the timm API the
EA layers build on."""
import weakref
from pathlib import Path

import pytest
import timm
import torch
from timm.layers import Attention

from timm_attnconv.layers import (
    EVOLUTION_LAYOUTS, AAConv2d, AttentionEvolution, ChainedAttention, link_chain, set_evolution_layout)
from timm_attnconv.layers import evolving
from timm_attnconv.layers.evolving import TIMM_TESTED, check_timm_api

from .kernels import recording


@pytest.mark.parametrize('residual,conv_weight', [(0.5, 1.0), (0.3, 0.6), (0.0, 0.0)])
def test_update_matches_the_per_element_formula(residual, conv_weight):
    heads, n = 3, 5
    ea = AttentionEvolution(heads, residual, conv_weight)
    torch.nn.init.normal_(ea.conv.bias)
    s, prev = torch.randn(2, heads, n, n), torch.randn(2, heads, n, n)
    w, b = ea.conv.weight, ea.conv.bias
    mixed = (1 - residual) * s + residual * prev
    expected = torch.empty_like(s)
    for batch in range(2):
        for g in range(heads):
            for p in range(n):
                for q in range(n):
                    acc = b[g].clone()
                    for h in range(heads):
                        for u in (-1, 0, 1):
                            for v in (-1, 0, 1):
                                if 0 <= p + u < n and 0 <= q + v < n:  # zero padding outside the map
                                    acc = acc + w[g, h, u + 1, v + 1] * mixed[batch, h, p + u, q + v]
                    expected[batch, g, p, q] = conv_weight * torch.relu(acc) + (1 - conv_weight) * mixed[batch, g, p, q]
    with torch.no_grad():
        torch.testing.assert_close(ea(s, prev), expected)
        # every way of running the convolution on the CPU: the same update, handed on contiguous for the softmax
        # ('triton', the GPU kernel, refuses CPU tensors: its own tests run it through Triton's interpreter)
        for layout in ('auto', 'channels_last'):
            out = set_evolution_layout(ea, layout)(s, prev)
            torch.testing.assert_close(out, expected)
            assert out.is_contiguous()
            torch.testing.assert_close(torch.jit.script(ea)(s, prev), expected)


def test_the_layout_switch_reaches_the_update(monkeypatch):
    ea = AttentionEvolution(3)
    s, prev = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    conv, kernel, seen = evolving._conv_in_maps_dtype, evolving.fused_evolve_or_none, []

    def recording_conv(maps, weight, bias, padding):
        seen.append(('conv', maps.is_contiguous(memory_format=torch.channels_last) and not maps.is_contiguous()))
        return conv(maps, weight, bias, padding)

    def recording_kernel(*args, forced):
        seen.append(('kernel', forced))
        return kernel(*args, forced=forced)
    monkeypatch.setattr(evolving, '_conv_in_maps_dtype', recording_conv)
    monkeypatch.setattr(evolving, 'fused_evolve_or_none', recording_kernel)
    with torch.no_grad():
        for layout in EVOLUTION_LAYOUTS:
            set_evolution_layout(torch.nn.Sequential(ea), layout)  # found inside a model
            if layout == 'triton':
                with pytest.raises(ValueError, match="'triton' cannot run here: (the maps are on cpu|Triton is not "
                                                     "installed)"):
                    ea(s, prev)
            else:
                ea(s, prev)
    # 'auto' asks for the Triton kernel, which does not run on CPU tensors (outside its interpreter): it, and
    # 'channels_last' without asking, run the reference convolution over channels_last maps; 'triton' insists
    assert seen == [('kernel', False), ('conv', True), ('conv', True), ('kernel', True)]
    with pytest.raises(ValueError, match="layout must be one of \\('auto', 'channels_last', 'triton'\\)"):
        set_evolution_layout(ea, 'nhwc')


def _aa(grid, heads=2):
    return AAConv2d(8, 16, num_heads=heads, kappa=0.5, upsilon=0.5, min_dim_head_qk=2, attn_grid=grid)


def test_chain_rules():
    layers = [_aa((4, 4)), _aa((4, 4)), _aa((2, 2)), _aa((2, 2)), _aa((2, 2))]
    assert link_chain(layers, [layer.attn_grid for layer in layers]) == 3
    assert [layer.evolve is None for layer in layers] == [True, False, True, False, False]  # new shape: new chain
    x = torch.randn(1, 8, 4, 4)
    out, logits = layers[0].forward_chain(x, None)
    with torch.no_grad():
        torch.testing.assert_close(out, layers[0](x))  # a chain start is the plain layer
    out2, evolved = layers[1].forward_chain(out[:, :8], logits)
    assert evolved.shape == logits.shape == (1, 2, 16, 16)
    with pytest.raises(ValueError, match='expects the previous layer\'s logits of shape'):
        layers[1].forward_chain(out[:, :8], None)


def test_incompatible_chains_fail_at_construction():
    with pytest.raises(ValueError, match='2 and 4 heads'):
        link_chain([_aa((4, 4), heads=2), _aa((4, 4), heads=4)], [(4, 4), (4, 4)])
    with pytest.raises(ValueError, match='evolve_residual must be in'):
        AttentionEvolution(2, evolve_residual=1.5)


class _RecordedScale:
    """A layer's ``scale`` that keeps a weak reference to each product ``q * scale`` it forms."""

    def __init__(self, value, refs):
        self.value, self.refs = value, refs

    def __rmul__(self, other):
        out = other * self.value
        self.refs.append(weakref.ref(out))
        return out


@pytest.mark.parametrize('kind', ['aa', 'vit'])
def test_queries_and_axis_terms_are_freed_before_the_maps_evolve(kind):
    # held through the evolution and the softmax, the layer's peak, they took EA-AA-ResNet-20 8 MB and EA-DeiT-S
    # 2.3 MB over their peaks before (BENCHMARK.md)
    refs, alive = [], []
    if kind == 'aa':  # 16 tokens
        layer, x, tokens = _aa((4, 4)), torch.randn(2, 8, 4, 4), 16
        layer._qkv = recording(layer._qkv, refs)  # the scaled queries
        layer._relative_terms = recording(layer._relative_terms, refs, [0, 1])  # the row and column terms
    else:
        layer, x, tokens = ChainedAttention(16, num_heads=2), torch.randn(2, 5, 16), 5
        layer.scale = _RecordedScale(layer.scale, refs)  # the scaled queries
    layer.evolve = AttentionEvolution(2)
    layer.evolve.register_forward_pre_hook(lambda module, args: alive.extend(ref() is not None for ref in refs))
    with torch.no_grad():
        layer.forward_chain(x, torch.randn(2, 2, tokens, tokens))
    assert len(refs) == (3 if kind == 'aa' else 1) and alive == [False] * len(refs)


@pytest.mark.parametrize('options', [{}, dict(qkv_bias=True, qk_norm=True, scale_norm=True, gated=True)])
def test_chained_attention_at_a_chain_start_is_timms_attention(options):
    # ChainedAttention forms timm's attention from timm's parts: a timm release that changes it must fail here
    ref = Attention(16, num_heads=2, norm_layer=torch.nn.LayerNorm, **options).eval()
    ref.fused_attn = False  # the explicit maps EA needs; fused kernels agree only to rounding
    layer = ChainedAttention(16, num_heads=2, norm_layer=torch.nn.LayerNorm, **options).eval()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out, logits = layer.forward_chain(x, None)
        assert torch.equal(out, ref(x)) and logits.shape == (2, 2, 5, 5)
        layer.chain_put(None)
        assert torch.equal(layer(x), out) and torch.equal(layer.chain_take(), logits)
    with pytest.raises(ValueError, match='masks are not supported'):
        layer(x, is_causal=True)


def test_a_changed_timm_class_fails_at_construction():
    class Changed(torch.nn.Module):
        def forward(self, x, rope=None):
            return x

    with pytest.raises(RuntimeError, match=rf'timm {timm.__version__} changed .*Changed.*forward\(\'x\', \'rope\'\)'):
        check_timm_api(Changed, ('x',), Changed(), ())
    with pytest.raises(RuntimeError, match='without qkv'):
        check_timm_api(Attention, ('x', 'attn_mask', 'is_causal'), torch.nn.Identity(), ('qkv',))


def test_setup_cfg_states_the_tested_timm_range():
    requires = (Path(__file__).parents[1] / 'setup.cfg').read_text()
    assert f'timm>={TIMM_TESTED[0]},<={TIMM_TESTED[1]}' in requires


@pytest.mark.parametrize('conv_weight', [1.0, 0.6])
def test_the_update_runs_in_the_dtype_of_the_maps_under_autocast(conv_weight):
    ea = AttentionEvolution(3, 0.5, conv_weight)
    s, prev = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        reference = ea(s, prev)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            # fp32 maps (position-only quadratic logits are fp32 under autocast): an fp32 convolution, no bf16 trip
            assert torch.equal(ea(s, prev), reference)
            low = ea(s.bfloat16(), prev.bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.05, atol=0.05)
    assert ea(s, prev).is_contiguous()  # the layout the softmax over keys wants, whatever the convolution ran in
    scripted = torch.jit.script(ea)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        # TorchScript ignores the autocast switch: its conv runs in bf16, the result still comes back as fp32 maps
        torch.testing.assert_close(scripted(s, prev), reference, rtol=0.05, atol=0.05)
