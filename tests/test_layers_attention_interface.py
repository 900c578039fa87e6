"""The attention-layer interface: every layer of the package declares it, and explicit maps leave outputs alone."""
import pytest
import timm
import torch
from timm.models.vision_transformer import Attention

from timm_attnconv.layers import (
    AAConv2d, AttentionLayer, PositionalSelfAttention, attention_layers, explicit_attention)


def _tapped_logits(layer, x):
    seen = []
    hook = layer.logits_tap.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        out = layer(x)
    hook.remove()
    return out, seen


def _layers():
    return [(PositionalSelfAttention(8, 3, position='quadratic'), torch.randn(2, 4, 5, 8)),  # separable path
            (PositionalSelfAttention(8, 2, position='learned', content=True), torch.randn(2, 4, 5, 8)),  # fused SDPA
            (AAConv2d(8, 16, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 5)),
             torch.randn(2, 8, 4, 5))]  # fused SDPA on CUDA


@pytest.mark.parametrize('index', range(3))
def test_explicit_maps_form_the_maps_for_one_block_only(index):
    layer, x = _layers()[index]
    layer.eval().fused_attn = True  # the fast paths, as on a GPU
    assert isinstance(layer, AttentionLayer) and layer.evolve is None
    fast, formed = _tapped_logits(layer, x)
    assert formed == []
    with layer.explicit_maps():
        explicit, seen = _tapped_logits(layer, x)
    assert [t.shape[1] for t in seen] == [layer.num_heads] and not layer.form_maps
    torch.testing.assert_close(explicit, fast)


def test_explicit_attention_covers_every_layer_of_a_model():
    model = timm.create_model('sa_quadratic_tiny_cifar', depth=2).eval()
    layers = [layer for _, layer in attention_layers(model)]
    assert [name for name, _ in attention_layers(model)] == ['blocks.0.attn', 'blocks.1.attn']
    with explicit_attention(model):
        assert all(layer.form_maps for layer in layers)
    assert not any(layer.form_maps for layer in layers)


def test_the_chain_method_is_declared():
    with pytest.raises(NotImplementedError, match='evolving-attention chain'):
        AttentionLayer().forward_chain(torch.randn(1, 4, 8), None)


def test_a_timm_attention_can_implement_the_interface():
    class TimmAttention(AttentionLayer, Attention):
        def __init__(self, dim, num_heads):
            super().__init__(dim, num_heads)  # timm's __init__: the interface has none
            self.init_attention(num_heads)

    layer = TimmAttention(16, 2)
    assert attention_layers(layer) == [('', layer)] and layer.num_heads == 2 and layer.head_dim == 8
    with layer.explicit_maps():
        assert layer.form_maps
