"""The Cordonnier et al. family: names, exact parameter counts, original-checkpoint parity, exact fast paths, input
validation."""

import pytest
import timm
import torch

import timm_attnconv
from timm_attnconv.layers import PositionalSelfAttention, set_attn_path
from timm_attnconv.models.sa_cordonnier import checkpoint_filter_fn, init_content_from_positional

from . import original_bertimage as original
from .kernels import recording

PAPER_PARAMS = {
    'sa_quadratic_cifar': 12_086_844,
    'sa_quadratic_gen_cifar': 12_087_006,
    'sa_quadratic_gen_pruned_cifar': 9_686_916,
    'sa_quadratic_16h_cifar': 18_806_970,
    'sa_learned_cifar': 12_278_682,
    'sa_learned_content_cifar': 29_484_282,
}
SMALL = dict(embed_dim=24, depth=2, mlp_dim=40)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


TINY = {'sa_quadratic_tiny_cifar', 'sa_learned_tiny_cifar', 'sa_learned_content_tiny_cifar'}


def test_registered_names_are_exactly_the_family():
    assert set(timm.list_models(module='sa_cordonnier')) == set(PAPER_PARAMS) | TINY
    assert set(timm_attnconv.list_models()) >= set(PAPER_PARAMS)


@pytest.mark.parametrize('name', sorted(PAPER_PARAMS))
def test_parameter_count_matches_paper_code(name):
    model = timm.create_model(name)
    assert num_params(model) == PAPER_PARAMS[name]


def test_content_head_variant_count():
    assert num_params(timm.create_model('sa_learned_content_cifar', rel_pos_score='head')) == 29_601_882


def test_arch_kwargs_keep_other_paper_settings():
    model = timm.create_model('sa_learned_cifar', embed_dim=64, depth=2)
    assert len(model.blocks) == 2 and model.num_features == 64
    assert model.blocks[0].attn.num_heads == 9 and model.blocks[0].mlp.fc1.out_features == 512
    assert model.blocks[0].norm1.eps == 1e-12 and model.num_classes == 10


VARIANTS = [
    ('sa_quadratic_cifar', 'quadratic', {}),
    ('sa_quadratic_gen_cifar', 'quadratic_gen', {}),
    ('sa_learned_cifar', 'learned', {}),
    ('sa_learned_content_cifar', 'content_query', {}),
    ('sa_learned_content_cifar', 'content_head', dict(rel_pos_score='head')),
]


@pytest.mark.parametrize('name,variant,kwargs', VARIANTS, ids=[v[1] for v in VARIANTS])
def test_original_checkpoint_gives_original_logits(tmp_path, name, variant, kwargs):
    heads = (3, 2)
    sd = original.make_state_dict(variant, SMALL['embed_dim'], heads, SMALL['mlp_dim'])
    path = tmp_path / 'final.checkpoint'
    torch.save({'epoch': 300, 'test_accuracy': 0.9, 'model_state_dict': sd}, path)
    model = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), num_heads=heads, **SMALL, **kwargs)
    model.eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = original.forward(sd, x, variant)
        for path_name in ('dense', 'auto', 'separable_direct'):  # separable_direct: 'auto' where inexact
            set_attn_path(model, path_name)
            torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-5)


def test_original_paper_size_checkpoint_bare_state_dict(tmp_path):
    sd = original.make_state_dict('quadratic', 400, (9,) * 6, 512)
    sd = {k: v for k, v in sd.items()}
    path = tmp_path / 'bare.pth'
    torch.save(sd, path)
    model = timm.create_model('sa_quadratic_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), original.forward(sd, x, 'quadratic'), rtol=0, atol=1e-5)


def test_original_checkpoint_adapts_to_one_input_channel(tmp_path):
    sd = original.make_state_dict('quadratic', 16, (2, 2), 24)
    path = tmp_path / 'final.checkpoint'
    torch.save({'model_state_dict': sd}, path)
    model = timm.create_model('sa_quadratic_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              embed_dim=16, depth=2, mlp_dim=24, num_heads=2, in_chans=1, num_classes=4)
    rgb = sd['features_upscale.weight'].reshape(16, 2, 2, 3).permute(0, 3, 1, 2)
    torch.testing.assert_close(model.patch_embed.proj.weight, rgb.sum(dim=1, keepdim=True))
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 4)


def test_pruned_checkpoint_needs_matching_heads(tmp_path):
    sd = original.make_state_dict('quadratic_gen', 16, (3, 1), 24)
    model = timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, depth=2, mlp_dim=24)
    with pytest.raises(ValueError, match=r'num_heads=\(3, 1\)'):
        checkpoint_filter_fn({'model_state_dict': sd}, model)


def test_mismatched_checkpoint_is_refused_with_key_names(tmp_path):
    sd = original.make_state_dict('quadratic_gen', 16, (2, 2), 24)
    path = tmp_path / 'gen.checkpoint'
    torch.save({'model_state_dict': sd}, path)
    with pytest.raises(RuntimeError, match='attn.pos.spreads'):
        timm.create_model('sa_quadratic_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          embed_dim=16, depth=2, mlp_dim=24, num_heads=2)
    del sd['encoder.layer.1.output.dense.bias']
    torch.save(sd, path)
    with pytest.raises(RuntimeError, match=r'blocks\.1\.mlp\.fc2\.bias'):
        timm.create_model('sa_quadratic_gen_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          embed_dim=16, depth=2, mlp_dim=24, num_heads=2)


def test_timm_layout_round_trip(tmp_path):
    model = timm.create_model('sa_learned_cifar', **SMALL).eval()
    path = tmp_path / 'model.pth'
    torch.save(model.state_dict(), path)
    loaded = timm.create_model('sa_learned_cifar', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                               **SMALL)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize('name', ['sa_quadratic_cifar', 'sa_learned_cifar'])
@pytest.mark.parametrize('size', [(32, 32), (20, 36), (64, 64)])
def test_separable_path_equals_dense_path(name, size):
    model = timm.create_model(name, **SMALL).eval()
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        outputs = {}
        for path_name in ('dense', 'separable', 'separable_direct'):
            set_attn_path(model, path_name)
            outputs[path_name] = model(x)
    torch.testing.assert_close(outputs['separable'], outputs['dense'], rtol=0, atol=2e-5)
    torch.testing.assert_close(outputs['separable_direct'], outputs['dense'], rtol=0, atol=2e-5)


def test_separable_path_refused_where_inexact():
    with pytest.raises(ValueError, match='not separable'):
        timm.create_model('sa_quadratic_gen_cifar', attn_path='separable', **SMALL)
    with pytest.raises(ValueError, match='not separable'):
        timm.create_model('sa_learned_content_cifar', attn_path='separable', **SMALL)


def test_training_with_attention_dropout_uses_one_mask_for_the_batch():
    model = timm.create_model('sa_quadratic_cifar', attn_drop_rate=0.5, proj_drop_rate=0., **SMALL).train()
    x = torch.randn(1, 3, 32, 32).expand(4, -1, -1, -1)
    out = model(x)
    # identical samples see the same (batch-independent) dropped map, as in the original
    torch.testing.assert_close(out, out[:1].expand_as(out))
    with torch.no_grad():
        assert (out - model.eval()(x)).abs().max() > 1e-3  # and a map was dropped at all


@pytest.mark.parametrize('name', ['sa_quadratic_cifar', 'sa_quadratic_gen_cifar', 'sa_learned_content_cifar'])
def test_any_input_size(name):
    model = timm.create_model(name, **SMALL).eval()
    for size in [(2, 2), (6, 10), (48, 40)]:
        assert model(torch.randn(1, 3, *size)).shape == (1, 10)


def test_learned_tables_refuse_larger_grids_without_interpolation():
    model = timm.create_model('sa_learned_cifar', resize_tables=False, **SMALL).eval()
    assert model(torch.randn(1, 3, 16, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match='up to 16 tokens'):
        model(torch.randn(1, 3, 64, 32))


@pytest.mark.parametrize('bad,match', [
    (torch.randn(3, 32, 32), '3 dimensions'),
    (torch.randn(1, 1, 32, 32), '1 channels'),
    (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), 'dtype torch.uint8'),
    (torch.randn(1, 3, 31, 32), '31×32'),
    (torch.randn(1, 3, 1, 1), '1×1'),
])
def test_bad_input_is_named(bad, match):
    model = timm.create_model('sa_quadratic_cifar', **SMALL).eval()
    with pytest.raises(ValueError, match=match):
        model(bad)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match='one count per layer'):
        timm.create_model('sa_quadratic_cifar', num_heads=(1, 2, 3))
    with pytest.raises(ValueError, match='pos_encoding'):
        timm.create_model('sa_quadratic_cifar', pos_encoding='sinusoid')
    with pytest.raises(ValueError, match='attn_path'):
        timm.create_model('sa_quadratic_cifar', attn_path='fast')


# an evolving-attention chain convolves the logits: folding must keep their per-query part
@pytest.mark.parametrize('name', ['sa_quadratic_cifar', 'sa_quadratic_gen_cifar', 'sa_learned_content_cifar',
                                  'ea_sa_learned_content_cifar'])
def test_reparameterize_folds_projections(name):
    model = timm.create_model(name, **SMALL).eval()
    fused = timm.utils.reparameterize_model(model)  # timm.models exports it only from timm 1.0.31
    assert isinstance(fused.blocks[0].attn.proj, torch.nn.Identity)
    # a content layer's keys fold into its queries (with its q·r tables, which adds parameters at D=24)
    content = model.blocks[0].attn.content
    assert (fused.blocks[0].attn.query_offset is not None) == content and fused.blocks[0].attn.k is None
    assert content or num_params(fused) < num_params(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('name', ['sa_quadratic_tiny_cifar', 'ea_sa_learned_content_tiny_cifar'])
def test_attention_output_is_freed_before_the_mlp_runs(name):
    # holding it through the MLP raised the fast path's peak memory by one (B, H, W, D) tensor (BENCHMARK.md)
    model = timm.create_model(name, depth=2).eval()
    attn, mlp = model.blocks[-1].attn, model.blocks[-1].mlp
    outputs, alive = [], []
    attn.forward = recording(attn.forward, outputs)
    attn.forward_chain = recording(attn.forward_chain, outputs)  # the EA model's second layer evolves the first's
    mlp.register_forward_pre_hook(lambda module, args: alive.append(outputs[-1]() is not None))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert len(outputs) == 1 and alive == [False]


def test_bf16_autocast_keeps_predictions():
    model = timm.create_model('sa_quadratic_cifar', **SMALL).eval()
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            low = model(x)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_forward_intermediates_nhwc():
    model = timm.create_model('sa_quadratic_tiny_cifar').eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        nchw = model.forward_intermediates(x, indices=[2], intermediates_only=True)[0]
        nhwc = model.forward_intermediates(x, indices=[2], output_fmt='NHWC', intermediates_only=True)[0]
    torch.testing.assert_close(nhwc, nchw.permute(0, 2, 3, 1))


def _trained_like(model):
    # tables and keys at the scale a trained model has, so the test is not passed by near-zero logits
    for name, param in model.named_parameters():
        if '.attn.pos.' in name:
            torch.nn.init.normal_(param, std=1.0)
    return model


@pytest.mark.parametrize('rel_pos_score', ['query', 'head'])
def test_content_model_warm_started_from_positional_starts_as_it(rel_pos_score):
    torch.manual_seed(0)
    source = _trained_like(timm.create_model('sa_learned_cifar', **SMALL)).eval()
    model = timm.create_model('sa_learned_content_cifar', rel_pos_score=rel_pos_score, **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = source(x)
        assert (model(x) - expected).abs().max() > 1e-2  # a random content model differs
        exact = init_content_from_positional(model, source, content_init_std=0.)(x)
        assert torch.allclose(exact, expected, atol=1e-5)
        for layer, src in zip(model.blocks, source.blocks):
            assert torch.allclose(layer.attn.attention_logits(torch.randn(1, 16, 16, 24)).softmax(-1),
                                  src.attn.attention_probs(torch.zeros(1, 16, 16, 24)), atol=1e-5)
        model.init_from(source)  # the default small content init breaks symmetry and stays close
        assert torch.allclose(model(x), expected, atol=0.05 * expected.abs().max())
        assert model.blocks[0].attn.k.weight.abs().max() > 0


def test_warm_start_refuses_other_sources():
    content = timm.create_model('sa_learned_content_cifar', **SMALL)
    with pytest.raises(ValueError, match='learned-positional model without content'):
        init_content_from_positional(content, timm.create_model('sa_quadratic_cifar', **SMALL))
    with pytest.raises(ValueError, match='embed_dim=16'):
        init_content_from_positional(content, timm.create_model('sa_learned_cifar', **dict(SMALL, embed_dim=16)))
    with pytest.raises(ValueError, match='content=True'):
        init_content_from_positional(timm.create_model('sa_learned_cifar', **SMALL),
                                     timm.create_model('sa_learned_cifar', **SMALL))
    with pytest.raises(ValueError, match='another layout'):
        timm.create_model('sa_learned_cifar', **SMALL).init_from(timm.create_model('sa_quadratic_cifar', **SMALL))


def test_attn_kernel_is_a_model_option():
    model = timm.create_model('sa_learned_content_cifar', attn_kernel='sdpa', embed_dim=32, mlp_dim=48)
    layers = [m for m in model.modules() if isinstance(m, PositionalSelfAttention)]
    assert len(layers) == 6 and all(layer.attn_kernel == 'sdpa' for layer in layers)
    with pytest.raises(ValueError, match='attn_kernel must be one of'):
        timm.create_model('sa_learned_content_cifar', attn_kernel='fast', embed_dim=32, mlp_dim=48)
