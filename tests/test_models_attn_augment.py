"""AA-ResNets: the paper's parameter counts, any input size, and timm's interface on a ResNet subclass."""
import weakref

import pytest
import timm
import torch
from timm.models import get_notrace_modules

import timm_attnconv
from timm_attnconv.layers import AAConv2d
from timm_attnconv.models.attn_augment import CheckedStemConv2d

from .families import small_kwargs

# the counts of the layouts that reproduce the paper's (Bello et al. 2019, Table 3 / Table 6 in brackets)
COUNTS = {'aa_resnet34': 20_745_072, 'aa_resnet50': 25_809_392, 'aa_resnet101': 45_386_728,
          'aa_resnet152': 61_613_536, 'aa_resnet50_fa': 19_383_560}
SPEC_M = {'aa_resnet34': 20.745, 'aa_resnet50': 25.809, 'aa_resnet101': 45.387, 'aa_resnet152': 61.614,
          'aa_resnet50_fa': 19.384}


@pytest.mark.parametrize('name', sorted(COUNTS))
def test_parameter_counts_match_the_paper(name):
    model = timm.create_model(name, device='meta')
    params = sum(p.numel() for p in model.parameters())
    assert params == COUNTS[name]
    assert abs(params / 1e6 - SPEC_M[name]) < 0.0005
    with_biases = timm.create_model(name, qkv_bias=True, proj_bias=True, device='meta')
    assert abs(sum(p.numel() for p in with_biases.parameters()) / 1e6 - SPEC_M[name]) < 0.05


def test_placement_and_dims_of_aa_resnet50():
    model = timm.create_model('aa_resnet50', device='meta')
    assert not any(isinstance(m, AAConv2d) for m in model.layer1.modules())
    for stage, (dim_k, dim_v, grid, pooled) in {2: (160, 8, 14, True), 3: (160, 24, 14, False),
                                                4: (160, 48, 7, False)}.items():
        for block in getattr(model, f'layer{stage}'):
            assert isinstance(block.conv2, AAConv2d) and not isinstance(block.conv1, AAConv2d)
            aa = block.conv2
            assert (aa.dim_k, aa.dim_v, aa.rel_rows.shape[0]) == (dim_k, dim_v, 2 * grid - 1)
            assert aa.num_pools == int(pooled) + int(aa.stride == 2)
    basic = timm.create_model('aa_resnet34', device='meta')
    assert all(isinstance(b.conv1, AAConv2d) and isinstance(b.conv2, torch.nn.Conv2d) for b in basic.layer3)


@pytest.mark.parametrize('name,sizes', [('aa_resnet34', [(33, 47), (97, 131)]), ('aa_resnet50_fa', [(40, 72)])])
def test_any_input_size_runs(name, sizes):
    model = timm.create_model(name, num_classes=7).eval()
    for size in sizes:
        with torch.no_grad():
            out = model(torch.randn(1, 3, *size))
        assert out.shape == (1, 7) and torch.isfinite(out).all()


def test_default_cfg_consistent():
    model = timm.create_model('aa_resnet50').eval()
    cfg = model.pretrained_cfg
    x = torch.randn(1, *cfg['input_size'])
    with torch.no_grad():
        features = model.forward_features(x)
    assert features.shape == (1, model.num_features, *cfg['pool_size'])
    state = model.state_dict()
    assert cfg['first_conv'] + '.weight' in state and cfg['classifier'] + '.weight' in state
    assert 'Table 3' in cfg['notes'][0] and cfg['paper_ids'] == 'arXiv:1904.09925'


def test_timm_interface_on_a_small_input():
    model = timm.create_model('aa_resnet50', num_classes=5).train()
    x = torch.randn(2, 3, 64, 64)
    model(x).mean().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    assert {'layer4.0.conv2.rel_rows', 'layer2.1.conv2.rel_cols'} <= model.no_weight_decay()
    model.eval()
    with torch.no_grad():
        ref = model(x)
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), ref)
        model.set_grad_checkpointing(False)
        final, inter = model.forward_intermediates(x)
        assert [f.shape[1] for f in inter] == [info['num_chs'] for info in model.feature_info]
        torch.testing.assert_close(model.forward_head(final), ref)
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), ref,
                                   rtol=1e-4, atol=1e-5)
    features = timm.create_model('aa_resnet34', features_only=True, out_indices=(1, 2, 3, 4)).eval()
    with torch.no_grad():
        maps = features(x)
    assert [m.shape[1] for m in maps] == [64, 128, 256, 512] and [m.shape[-1] for m in maps] == [16, 8, 4, 2]
    assert AAConv2d in get_notrace_modules()
    model.reset_classifier(0)
    assert model(x).shape == (2, 2048)


def test_torchscript_and_fx():
    from timm.models import create_feature_extractor
    model = timm.create_model('aa_resnet34', num_classes=3).eval()
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(torch.jit.script(model)(x), ref)
        fx = create_feature_extractor(model, return_nodes=['layer3', 'fc'])
        torch.testing.assert_close(fx(x)['fc'], ref)


def test_bad_configurations_are_named():
    with pytest.raises(ValueError, match='output_stride=32'):
        timm.create_model('aa_resnet50', output_stride=16, device='meta')
    with pytest.raises(ValueError, match='upsilon=0.01'):
        timm.create_model('aa_resnet50', upsilon=0.01, device='meta')
    with pytest.raises(RuntimeError, match='no pretrained weights yet'):
        timm.create_model('aa_resnet50', pretrained=True)
    assert 'aa_resnet50' in timm_attnconv.list_models('aa_*')


def _count(name, **kwargs):
    return sum(p.numel() for p in timm.create_model(name, device='meta', **kwargs).parameters())


def test_cifar_models():
    assert _count('aa_wide_resnet28_10_cifar') == 36_053_716             # paper Table 1: 36.2M
    assert _count('aa_wide_resnet28_10_cifar', aa_stages=()) == 36_278_324  # the paper's 36.3M WRN-28-10 baseline
    assert _count('attnconv_resnet20_cifar') == 269_722                 # He et al. 2016: 0.27M
    aa20 = timm.create_model('aa_resnet20_cifar').eval()
    assert not any(isinstance(m, AAConv2d) for m in aa20.stages[0].modules())
    assert all(isinstance(b.conv1, AAConv2d) for stage in aa20.stages[1:] for b in stage)
    with torch.no_grad():
        for size in ((32, 32), (27, 41)):
            assert aa20(torch.randn(1, 3, *size)).shape == (1, 10)
    with pytest.raises(ValueError, match='aa_stages must be stages 1..3'):
        timm.create_model('aa_resnet20_cifar', aa_stages=(4,))


@pytest.mark.parametrize('name', ['aa_wide_resnet28_10_cifar', 'aa_resnet20_cifar'])  # pre- and post-activation
def test_first_convolution_output_is_freed_before_the_second_runs(name):
    model = timm.create_model(name, **small_kwargs(name)).eval()
    block = model.stages[1][0]  # an augmented block: its conv1 is an AAConv2d
    outputs, alive = [], []
    block.conv1.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    block.conv2.register_forward_pre_hook(lambda module, args: alive.append(outputs[-1]() is not None))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert isinstance(block.conv1, AAConv2d) and alive == [False]


@pytest.mark.parametrize('name', ['aa_resnet20_cifar', 'aa_resnet50', 'ea_aa_resnet20_cifar'])
def test_attn_kernel_is_a_model_option(name):
    # what set_attn_kernel does to a built model, as a create_model keyword (so a run's --model-kwargs can pick it)
    model = timm.create_model(name, attn_kernel='sdpa', **small_kwargs(name))
    layers = [m for m in model.modules() if isinstance(m, AAConv2d)]
    assert layers and all(layer.attn_kernel == 'sdpa' for layer in layers)
    with pytest.raises(ValueError, match='attn_kernel must be one of'):
        timm.create_model(name, attn_kernel='fast', **small_kwargs(name))


@pytest.mark.parametrize('name', ['aa_resnet20_cifar', 'aa_wide_resnet28_10_cifar', 'ea_aa_resnet20_cifar'])
def test_cifar_resnets_take_timms_drop_path_and_reset_their_head_in_place(name):
    # timm's train.py --drop-path; stochastic depth rises over the blocks to the rate given, the first block keeps all
    model = timm.create_model(name, drop_path_rate=0.2, **small_kwargs(name))
    rates = [block.drop_path.drop_prob if hasattr(block.drop_path, 'drop_prob') else 0.
             for stage in model.stages for block in stage]
    assert rates[0] == 0. and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)
    plain = timm.create_model(name, **small_kwargs(name))
    assert plain.state_dict().keys() == model.state_dict().keys()  # stochastic depth adds no weights
    x = torch.randn(2, 3, 32, 32)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), plain.eval()(x))  # nothing is dropped at inference
        # a new head in the model's dtype, the pooling kept unless given
        model = model.to(torch.bfloat16)
        model.reset_classifier(5)
        assert model(x.bfloat16()).shape == (2, 5) and model.fc.weight.dtype == torch.bfloat16
        unpooled = timm.create_model(name, num_classes=0, global_pool='', **small_kwargs(name)).eval()
        unpooled.reset_classifier(0)
        assert unpooled(x).dim() == 4


@pytest.mark.parametrize('name', ['aa_resnet50', 'ea_aa_resnet50'])
def test_aa_resnets_take_timms_deep_stems(name):
    model = timm.create_model(name, stem_type='deep', **small_kwargs(name)).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape[0] == 1
    for way_in in (model, model.forward_features, model.forward_intermediates):  # the stem's first conv checks
        with pytest.raises(ValueError, match='channels'):
            way_in(torch.randn(1, 4, 64, 64))


def test_the_checked_stem_keeps_timms_initialisation_and_keys():
    torch.manual_seed(0)
    model = timm.create_model('aa_resnet50')
    torch.manual_seed(0)
    plain = timm.create_model('resnet50')
    assert isinstance(model.conv1, CheckedStemConv2d)
    torch.testing.assert_close(model.conv1.weight, plain.conv1.weight, rtol=0, atol=0)  # same draws, same order
    assert {k for k in model.state_dict() if k.startswith(('conv1', 'bn1'))} == {
        k for k in plain.state_dict() if k.startswith(('conv1', 'bn1'))}
