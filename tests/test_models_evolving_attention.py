"""EA-AA-ResNets: released-code parameter counts, the chain through the model, and equivalence to the base model."""
import zlib

import pytest
import timm
import torch

from timm.layers import set_scriptable
from timm.models.resnet import Bottleneck
from timm.models.vision_transformer import Block

import timm_attnconv
from timm_attnconv.layers import AAConv2d, AttentionEvolution, ChainedAAConv2d, ChainedAttention
from timm_attnconv.models.evolving_attention import EABlock, EABottleneck

COUNTS = {'ea_aa_resnet50': (24_967_712, 11), 'ea_aa_resnet101': (43_440_728, 28),
          'ea_aa_resnet152': (58_659_248, 45)}  # the released TF layout, 1000 classes


@pytest.mark.parametrize('name', sorted(COUNTS))
def test_parameter_counts_and_evolved_layers(name):
    model = timm.create_model(name, device='meta')
    assert (sum(p.numel() for p in model.parameters()), model.num_evolved) == COUNTS[name]


def test_stage2_pooling_continues_the_chain_into_stage3():
    model = timm.create_model('ea_aa_resnet50', device='meta')
    evolving = [b.conv2.evolve is not None for s in (2, 3, 4) for b in getattr(model, f'layer{s}')]
    # stage 2 (pooled to 14²): a new chain, then evolved; stage 3 (14²) continues; stage 4 (7²) restarts
    assert evolving == [False, True, True, True] + [True] * 6 + [False, True, True]


def load_without_evolution(base, ea_model):
    """Load an EA model's weights into its base: everything must fit except the evolution convolutions."""
    missing, unexpected = base.load_state_dict(ea_model.state_dict(), strict=False)
    assert not missing and unexpected and all('.evolve.' in k for k in unexpected)


def twins_without_evolution(ea_name, base_name, **kwargs):
    """An EA model with its evolution off (r = c = 0) and its base holding the same weights, both in eval mode."""
    ea = timm.create_model(ea_name, evolve_residual=0., evolve_conv_weight=0., **kwargs).eval()
    base = timm.create_model(base_name, **kwargs).eval()
    load_without_evolution(base, ea)
    return ea, base


def _base_with_same_weights(ea_model):
    base = timm.create_model('aa_resnet50', kappa=0.25, upsilon=0.125, min_dim_head_qk=1, qkv_bias=True,
                             proj_bias=True, layers=(2, 2, 2, 2), zero_init_last=False).eval()
    load_without_evolution(base, ea_model)
    return base


def test_without_residual_and_conv_an_ea_model_is_its_base_model():
    # zero_init_last=False: timm zero-initialises each block's last BN, which would make every block an identity
    ea = timm.create_model('ea_aa_resnet50', layers=(2, 2, 2, 2), evolve_residual=0., evolve_conv_weight=0.,
                           zero_init_last=False).eval()
    base = _base_with_same_weights(ea)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
    released = timm.create_model('ea_aa_resnet50', layers=(2, 2, 2, 2), zero_init_last=False).eval()
    released.load_state_dict(ea.state_dict())
    with torch.no_grad():
        assert (released(x) - base(x)).abs().max() > 1e-3  # with the released r, c the chain changes the output


def test_chain_state_is_threaded_not_stored():
    model = timm.create_model('ea_aa_resnet50', layers=(1, 2, 2, 1), num_classes=4, zero_init_last=False)
    x = torch.randn(2, 3, 64, 64)
    model.train()(x).sum().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    model.eval()
    with torch.no_grad():
        ref = model(x)
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), ref)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(model.forward_head(final), ref)
        assert len(inter) == 5
    assert not any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values())
    assert all(isinstance(m.evolve, torch.nn.Module) or m.evolve is None
               for m in model.modules() if isinstance(m, AAConv2d))


def test_any_input_size_keeps_the_chain_shapes():
    model = timm.create_model('ea_aa_resnet50', layers=(1, 1, 2, 2), num_classes=3).eval()
    with torch.no_grad():
        for size in ((97, 131), (40, 40)):
            assert model(torch.randn(1, 3, *size)).shape == (1, 3)


def test_evolve_false_is_the_base_model_for_benchmarks():
    plain = timm.create_model('ea_aa_resnet50', layers=(1, 1, 1, 1), evolve=False, zero_init_last=False).eval()
    assert plain.num_evolved == 0 and not any(m.evolve for m in plain.modules() if isinstance(m, AAConv2d))
    aa = timm.create_model('aa_resnet50', kappa=0.25, upsilon=0.125, min_dim_head_qk=1, qkv_bias=True,
                           proj_bias=True, layers=(1, 1, 1, 1)).eval()
    aa.load_state_dict(plain.state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), aa(x))


def test_ea_on_the_sa_content_model():
    assert _count_params('ea_sa_learned_content_cifar') == 29_484_282 + 5 * (9 * 9 * 9 + 9)  # base + 5 EA convs
    kwargs = dict(embed_dim=32, mlp_dim=48, depth=3)
    ea, base = twins_without_evolution('ea_sa_learned_content_cifar', 'sa_learned_content_cifar', **kwargs)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
        released = timm.create_model('ea_sa_learned_content_cifar', **kwargs).eval()
        released.load_state_dict(ea.state_dict())
        assert (released(x) - base(x)).abs().max() > 1e-4
        ref = released(x)
        released.set_grad_checkpointing()
        torch.testing.assert_close(released(x), ref)
        torch.testing.assert_close(released.forward_head(released.forward_intermediates(x)[0]), ref)
    with pytest.raises(ValueError, match='9 and 8 heads'):
        timm.create_model('ea_sa_learned_content_cifar', num_heads=(9, 8, 9, 9, 9, 9), device='meta')


def test_the_sa_twin_warm_starts_from_its_base_keeping_its_evolution_init():
    kwargs = dict(embed_dim=32, mlp_dim=48, depth=3)
    base = timm.create_model('sa_learned_content_cifar', **kwargs).eval()
    ea = timm.create_model('ea_sa_learned_content_cifar', evolve_residual=0., evolve_conv_weight=0., **kwargs).eval()
    evolution = {k: v.clone() for k, v in ea.state_dict().items() if '.evolve.' in k}
    assert ea.init_from(base) is ea
    assert all(torch.equal(ea.state_dict()[k], v) for k, v in evolution.items())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # with r = c = 0 the twin is its base: every weight the base uses was carried over
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
        positional = timm.create_model('sa_learned_cifar', **kwargs).eval()
        torch.manual_seed(0)
        base.init_from(positional)  # the base's own warm start, with its content weights drawn near zero
        torch.manual_seed(0)
        ea.init_from(positional)
        assert all(torch.equal(ea.state_dict()[k], v) for k, v in evolution.items())
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match='learned-positional model without content'):
        ea.init_from(timm.create_model('sa_quadratic_cifar', **kwargs))
    with pytest.raises(ValueError, match='embed_dim=16.*use a source of the same size'):
        ea.init_from(timm.create_model('sa_learned_content_cifar', **dict(kwargs, embed_dim=16)))
    other_scores = timm.create_model('sa_learned_content_cifar', rel_pos_score='head', **kwargs)
    with pytest.raises(ValueError, match=r"not the base of this twin.*keys only it has: \['blocks.0.attn.pos.col_keys"):
        ea.init_from(other_scores)


def _count_params(name, **kwargs):
    return sum(p.numel() for p in timm.create_model(name, device='meta', **kwargs).parameters())


def test_ea_cifar_twin_chains_within_each_stage():
    ea, base = twins_without_evolution('ea_aa_resnet20_cifar', 'aa_resnet20_cifar')
    assert ea.num_evolved == 4 and _count_params('ea_aa_resnet20_cifar') == 263_178 + 4 * (4 * 4 * 9 + 4)
    assert [b.conv1.evolve is not None for s in ea.stages[1:] for b in s] == [False, True, True] * 2
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name,base,convs', [('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', 3 * 3 * 9 + 3),
                                            ('deit_ea_small_patch16_224', 'deit_small_patch16_224', 6 * 6 * 9 + 6)])
def test_ea_deit_is_timm_deit_plus_eleven_evolution_convs(name, base, convs):
    assert _count_params(name) == _count_params(base) + 11 * convs


def test_ea_deit_without_residual_and_conv_is_timm_deit():
    kwargs = dict(depth=3)
    ea, base = twins_without_evolution('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', **kwargs)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
        final, inter = ea.forward_intermediates(x, indices=[0, 2])
        assert [t.shape for t in inter] == [(1, 192, 14, 14)] * 2
        torch.testing.assert_close(ea.forward_head(final), ea(x))


@pytest.mark.parametrize('kwargs', [dict(class_token=False, global_pool='avg'), dict(reg_tokens=4),
                                    dict(no_embed_class=True), dict(qk_norm=True), dict(fc_norm=True),
                                    dict(pos_embed='none')])
def test_ea_deit_takes_timm_vit_options_as_timm_deit_does(kwargs):
    # EA-DeiT builds on timm's VisionTransformer: its token and norm options must reach the evolved blocks unchanged
    kwargs = dict(depth=2, img_size=64, **kwargs)
    ea, base = twins_without_evolution('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', **kwargs)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('kwargs', [dict(norm=True), dict(output_fmt='NLC'), dict(return_prefix_tokens=True),
                                    dict(output_dict=True, return_prefix_tokens=True, indices=[1]),
                                    dict(output_dict=True, intermediates_only=True, stop_early=True, indices=1),
                                    dict(output_dict=True, return_prefix_tokens=True, model=dict(class_token=False,
                                                                                                 global_pool='avg'))])
def test_ea_deit_intermediates_are_timm_deits_in_every_output_form(kwargs):
    """Without residual and convolution EA-DeiT is DeiT (above), so every form of timm's ``forward_intermediates``
    must come back the same: tuples, prefix tokens, ``output_dict``'s keys, a model without class token."""
    kwargs = dict(kwargs)
    model_kwargs = dict(depth=2, img_size=64, **kwargs.pop('model', {}))
    ea, base = twins_without_evolution('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', **model_kwargs)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        got, expected = ea.forward_intermediates(x, **kwargs), base.forward_intermediates(x, **kwargs)
    if kwargs.get('output_dict'):
        assert got.keys() == expected.keys()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if kwargs == dict(norm=True):
        assert all(y.is_contiguous() for y in got[1])  # NCHW copies, as timm's


def test_ea_deit_refuses_attention_masks_naming_why():
    # timm's ViT forward, forward_features and forward_intermediates take them; the EA DeiT names why it cannot
    ea = timm.create_model('deit_ea_tiny_patch16_224', depth=2, img_size=32).eval()
    x = torch.randn(1, 3, 32, 32)
    for kwargs in (dict(attn_mask=torch.zeros(5, 5, dtype=torch.bool)), dict(is_causal=True)):
        for method in (ea, ea.forward_features, ea.forward_intermediates):
            with pytest.raises(ValueError, match="takes no attn_mask or is_causal: each layer's convolution runs over "
                                                 "the previous layer's full maps"):
                method(x, **kwargs)


def test_ea_deit_with_dynamic_img_size_runs_at_other_sizes_like_timm_deit():
    """timm's ``dynamic_img_size=True`` resamples the position embedding per input; the evolution convolutions act on
    maps of any size, so the EA DeiT follows timm's DeiT to 160 and 96 px (14², 10², 6² patches)."""
    ea, base = twins_without_evolution('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', depth=2,
                                       dynamic_img_size=True)
    with torch.no_grad():
        for size in (224, 160, 96):
            x = torch.randn(1, 3, size, size)
            torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
            assert [t.shape for t in ea.forward_intermediates(x, intermediates_only=True)] == \
                [(1, 192, size // 16, size // 16)] * 2

    with pytest.raises(ValueError, match='H and W multiples of 16; got a batch of 1 images of 96×100'):
        ea(torch.randn(1, 3, 96, 100))


def test_ea_deit_with_dynamic_img_size_traces_with_fx_and_scripts_like_timm_deit():
    # timm's FX tracer leaves its position-embedding resampling untraced in the modules of the traced forward: timm's
    # own, which the EA DeiT inherits for that
    from timm.models import create_feature_extractor
    with set_scriptable(True):
        ea = timm.create_model('deit_ea_tiny_patch16_224', depth=2, dynamic_img_size=True, num_classes=5).eval()
    traced = create_feature_extractor(ea, return_nodes=['head'])
    scripted = torch.jit.script(ea)
    with torch.no_grad():
        for height, width in ((224, 224), (96, 64)):
            x = torch.randn(2, 3, height, width)
            torch.testing.assert_close(traced(x)['head'], ea(x))
            torch.testing.assert_close(scripted(x), ea(x))
        with pytest.raises(ValueError, match='takes no attn_mask or is_causal'):
            traced(x, is_causal=True)
        assert scripted(torch.zeros(0, 3, 96, 64)).shape == (0, 5)


def test_ea_deit_with_dynamic_img_pad_follows_timm_deit_at_any_size():
    # timm pads the image to whole patches; the maps follow the padded grid (7×6 patches for 100×90 images)
    kwargs = dict(depth=2, dynamic_img_size=True, dynamic_img_pad=True)
    ea, base = twins_without_evolution('deit_ea_tiny_patch16_224', 'deit_tiny_patch16_224', **kwargs)
    with torch.no_grad():
        for height, width in ((100, 90), (33, 17)):
            x = torch.randn(1, 3, height, width)
            torch.testing.assert_close(ea(x), base(x), rtol=1e-4, atol=1e-5)
            assert ea.forward_intermediates(x, intermediates_only=True)[0].shape == \
                (1, 192, -(-height // 16), -(-width // 16))


def test_ea_deit_with_dynamic_img_size_takes_an_empty_batch():
    # timm's DeiT with dynamic_img_size fails here (timm 1.0.31: its _pos_embed cannot view no tokens as (0, -1, C))
    ea = timm.create_model('deit_ea_tiny_patch16_224', depth=2, dynamic_img_size=True, num_classes=5)
    x = torch.zeros(0, 3, 96, 64)
    with torch.no_grad():
        assert ea.eval()(x).shape == (0, 5)
        assert [t.shape for t in ea.forward_intermediates(x, intermediates_only=True)] == [(0, 192, 6, 4)] * 2
    ea.train()(x).sum().backward()


def test_ea_deit_of_one_size_refuses_others_naming_dynamic_img_size():
    # timm's PatchEmbed would assert; the model refuses first, with the fix (and, compiled, from outside the graph)
    ea = timm.create_model('deit_ea_tiny_patch16_224', depth=1, img_size=64).eval()
    with torch.no_grad():
        assert ea(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
        for height, width in ((32, 32), (64, 48), (64, 60)):
            with pytest.raises(ValueError, match=f'got {height}×{width} images, but this model takes 64×64 only '
                                                 r'\(create it with dynamic_img_size=True'):
                ea(torch.randn(1, 3, height, width))


# eval logits (3 classes, batch 2) on the weights of _seeded_state, recorded at commit 17b4fdd, whose EA models ran
# their own copies of timm's Bottleneck and ViT Block forwards: any later construction of them must give the same
REFERENCE_LOGITS = [
    ('ea_aa_resnet50', dict(layers=(1, 2, 2, 2)), 64,
     [[-22.96192, 34.61473, -47.21085], [-20.67424, 36.89874, -45.31371]]),
    ('ea_aa_resnet50', dict(layers=(1, 2, 2, 2), aa_stages=(3, 4)), 64,
     [[-19.69171, 39.22279, -40.33131], [-19.85934, 38.26518, -38.60604]]),
    ('ea_aa_resnet20_cifar', dict(depths=(1, 2, 2)), 32,
     [[0.3201031, 0.4122942, -0.6197783], [0.3195645, 0.4226675, -0.6090268]]),
    ('deit_ea_tiny_patch16_224', dict(depth=3, img_size=64), 64,
     [[-1.277141, -0.5891056, 1.400911], [-1.261765, -0.5516307, 1.161041]]),
    ('ea_sa_learned_content_cifar', dict(embed_dim=32, mlp_dim=48, depth=3), 32,
     [[0.2162621, 0.1617506, -0.1161231], [0.2146587, 0.1624294, -0.1142329]]),
]


def _seeded_state(model):
    """Weights that depend on each state-dict key alone, not on how (or in which order) the model was built."""
    state = {}
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            value = torch.randn(value.shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode()))) * 0.2
            value = value.abs() + 0.5 if key.endswith('running_var') else value
        state[key] = value
    return state


@pytest.mark.parametrize('name,kwargs,size,expected', REFERENCE_LOGITS)
def test_logits_equal_the_recorded_reference(name, kwargs, size, expected):
    model = timm.create_model(name, num_classes=3, **kwargs).eval()
    model.load_state_dict(_seeded_state(model))
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.tensor(expected), rtol=1e-4, atol=1e-4)


def test_ea_blocks_at_a_chain_start_are_timms_blocks():
    # the EA blocks run timm's own forward around the chained layer: evolution off, they are timm's blocks exactly
    block = EABlock(16, num_heads=2, attn_layer=ChainedAttention).eval()
    ref = Block(16, num_heads=2).eval()
    ref.attn.fused_attn = False
    ref.load_state_dict(block.state_dict())
    bottleneck, ref_bottleneck = EABottleneck(32, 8).eval(), Bottleneck(32, 8).eval()
    bottleneck.conv2 = ChainedAAConv2d(8, 8, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 4))
    # the chain forms its maps: the reference takes the explicit kernel too ('auto' takes SDPA on CPU, one rounding off)
    ref_bottleneck.conv2 = AAConv2d(8, 8, num_heads=2, kappa=0.5, upsilon=0.5, min_dim_head_qk=2, attn_grid=(4, 4),
                                    attn_kernel='explicit')
    ref_bottleneck.load_state_dict(bottleneck.state_dict())
    cases = ((block, ref, torch.randn(2, 5, 16)), (bottleneck, ref_bottleneck, torch.randn(2, 32, 4, 4)))
    with torch.no_grad():
        for ea, timm_block, x in cases:
            out, logits = ea.forward_chain(x, None)
            assert torch.equal(out, timm_block(x)) and logits.ndim == 4
            assert not any(isinstance(v, torch.Tensor) for m in ea.modules() for v in vars(m).values())


def test_a_timm_block_forward_that_skips_the_attention_fails_loudly():
    class Drifted(EABottleneck):
        def forward(self, x):  # a timm release whose Bottleneck no longer calls conv2
            return x

    block = Drifted(8, 2)
    block.conv2 = ChainedAAConv2d(2, 2, num_heads=1, kappa=1., upsilon=1., min_dim_head_qk=1, attn_grid=(2, 2))
    with pytest.raises(RuntimeError, match='did not call its attention layer'):
        block.forward_chain(torch.randn(1, 8, 2, 2), None)


def test_features_only_threads_the_chain():
    kwargs = dict(layers=(1, 2, 2, 2), zero_init_last=False)
    features = timm.create_model('ea_aa_resnet50', features_only=True, **kwargs).eval()
    model = timm.create_model('ea_aa_resnet50', **kwargs).eval()
    model.load_state_dict(features.model.state_dict(), strict=False)  # all but the classifier
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for feature, expected in zip(features(x), model.forward_intermediates(x, intermediates_only=True)):
            torch.testing.assert_close(feature, expected)


@pytest.mark.parametrize('old,new', [('ea_deit_tiny_patch16_224', 'deit_ea_tiny_patch16_224'),
                                     ('ea_deit_small_patch16_224', 'deit_ea_small_patch16_224')])
def test_first_deit_names_still_build_with_a_deprecation_warning(old, new):
    with pytest.warns(UserWarning, match=f'deprecated model name {old} to current {new}'):
        model = timm.create_model(old, depth=2, device='meta')
    assert model.pretrained_cfg['architecture'] == new and model.num_evolved == 1
    assert old not in timm_attnconv.list_models()
    assert timm.models.get_deprecated_models('evolving_attention')[old] == new


@pytest.mark.parametrize('name,kwargs', [
    ('ea_aa_resnet20_cifar', dict(depths=(1, 2, 2))),
    ('ea_sa_learned_content_tiny_cifar', dict(embed_dim=32, mlp_dim=48, depth=3)),
    ('ea_sa_learned_content_tiny_cifar', dict(embed_dim=32, mlp_dim=48, depth=3, content=False,
                                              pos_encoding='quadratic', evolve_conv_weight=0.6)),
])
def test_bf16_autocast_keeps_the_maps_dtype_through_the_chain(name, kwargs):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, 32, 32)
    seen = []
    for module in model.modules():
        if isinstance(module, AttentionEvolution):
            module.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, args[1].dtype, out.dtype)))
    with torch.no_grad():
        reference = model(x)
        seen.clear()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            low = model(x)
    # q·k maps are bf16 under autocast and stay bf16; fp32 maps (position-only quadratic scores) stay fp32
    maps_dtype = torch.float32 if kwargs.get('pos_encoding') == 'quadratic' else torch.bfloat16
    assert seen and all(dtypes == (maps_dtype,) * 3 for dtypes in seen)
    torch.testing.assert_close(low.float(), reference, rtol=0.05, atol=0.05)


def test_an_ea_model_compiles_as_one_graph():
    model = timm.create_model('deit_ea_tiny_patch16_224', depth=2, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend='eager', fullgraph=True)(x), model(x))


@pytest.mark.slow
def test_an_ea_model_trains_compiled_as_one_graph():
    model = timm.create_model('ea_aa_resnet20_cifar', depths=(1, 2, 2)).train()
    x = torch.randn(2, 3, 32, 32)
    compiled = torch.compile(model, backend='aot_eager', fullgraph=True)
    compiled(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
