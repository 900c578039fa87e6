"""timm's model-test contract (mirroring the checks of timm's ``tests/test_models.py``) for every registered model.

Checks that only need the structure run on small versions (``tests/families.py``: narrower or shallower, at a small
input); checks of the default cfg run on the paper-size model.
"""
import fnmatch
import math

import pytest
import timm
import torch
from timm.layers import set_scriptable
from timm.optim import create_optimizer_v2
from timm.models import get_notrace_functions, get_notrace_modules

import timm_attnconv

from .families import FAMILY, small_kwargs, test_size

MODELS = timm_attnconv.list_models()
# full-size forward passes that take tens of seconds on 2 cores: run with -m slow
HEAVY = {'aa_resnet101', 'aa_resnet152', 'ea_aa_resnet101', 'ea_aa_resnet152', 'deit_ea_small_patch16_224'}


def _input(model, batch=2):
    return torch.randn(batch, *model.pretrained_cfg['input_size'])


def _small(name, **kwargs):
    """The small version of ``name`` and an input for it."""
    model = timm.create_model(name, **small_kwargs(name), **kwargs)
    size = test_size(name)
    return model, torch.randn(2, model.pretrained_cfg['input_size'][0] if 'in_chans' not in kwargs else
                              kwargs['in_chans'], size, size)


def test_every_model_has_a_family():
    assert set(MODELS) == set(FAMILY)


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in MODELS])
def test_default_cfg_consistent(name):
    model = timm.create_model(name).eval()
    cfg = model.pretrained_cfg
    state_dict = model.state_dict()
    x = _input(model, 1)
    # token models (ViT) have no pool_size: their features are (B, tokens, C)
    spatial = tuple(cfg['pool_size']) if cfg.get('pool_size') else None
    with torch.no_grad():
        features = model.forward_features(x)
        if spatial:
            assert features.shape[1] == model.num_features and tuple(features.shape[-2:]) == spatial
        else:
            assert features.shape[-1] == model.num_features
        assert model.forward_head(features, pre_logits=True).shape == (1, model.head_hidden_size)
        assert model(x).shape == (1, cfg['num_classes'])
        model.reset_classifier(0)
        assert model.num_classes == 0 and model(x).shape == (1, model.head_hidden_size)
        if spatial:
            model.reset_classifier(0, '')
            assert tuple(model(x).shape) == (1, model.num_features, *spatial)
    if spatial:
        unpooled = timm.create_model(name, num_classes=0, global_pool='', **small_kwargs(name)).eval()
        with torch.no_grad():
            assert tuple(unpooled(x).shape) == (1, unpooled.num_features, *spatial)
    for key in ('classifier', 'first_conv'):
        assert cfg[key] + '.weight' in state_dict
    for key in ('num_classes', 'input_size', 'crop_pct', 'interpolation', 'mean', 'std', 'license',
                'paper_ids', 'origin_url'):
        assert cfg.get(key) is not None, key


@pytest.mark.parametrize('name', MODELS)
def test_builds_on_the_meta_device(name):
    # as timm and accelerate build large models before loading weights: no tensor is read while building
    with torch.device('meta'):
        model = timm.create_model(name, **small_kwargs(name))
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize('name', MODELS)
def test_forward_backward_and_grad_checkpointing(name):
    model, x = _small(name, num_classes=42)
    out = model.train()(x)
    assert out.shape == (2, 42) and torch.isfinite(out).all()
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f'no gradient for {missing}'
    model.eval()
    with torch.no_grad():
        ref = model(x)
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', MODELS)
def test_forward_intermediates(name):
    model, x = _small(name)
    model.eval()
    size = x.shape[-1]
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert len(intermediates) == len(model.feature_info)
        for info, feat in zip(model.feature_info, intermediates):
            side = math.ceil(size / info['reduction'])
            assert feat.shape == (2, info['num_chs'], side, side)
        last = model.forward_intermediates(x, indices=[1], intermediates_only=True, stop_early=True)
        torch.testing.assert_close(last[0], intermediates[1])
        with pytest.raises(ValueError, match='got dtype torch.uint8'):  # the input check of forward
            model.forward_intermediates(x.to(torch.uint8), intermediates_only=True)
        model.set_grad_checkpointing()
        torch.testing.assert_close(model.forward_intermediates(x)[0], final)
        kept = model.prune_intermediate_layers([0, 1])
        assert list(kept) == [0, 1] and model.num_classes == 0
        pruned = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        for before, after in zip(intermediates[:2], pruned):
            torch.testing.assert_close(after, before)


@pytest.mark.parametrize('name', MODELS)
def test_features_only(name):
    model, x = _small(name, features_only=True, out_indices=(0, 2))
    with torch.no_grad():
        outs = model.eval()(x)
    info = model.feature_info
    assert len(outs) == 2
    for out, chs, reduction in zip(outs, info.channels(), info.reduction()):
        side = math.ceil(x.shape[-1] / reduction)
        assert tuple(out.shape) == (2, chs, side, side)
    # the wrappers run forward_intermediates, or (timm's FeatureListNet of the AA-ResNets) the modules, the stem first
    with pytest.raises(ValueError, match='got dtype torch.uint8'):
        model(x.to(torch.uint8))


def test_user_feature_cfg_merges():
    model = timm.create_model('sa_quadratic_cifar', features_only=True, feature_cfg=dict(out_indices=(1,)),
                              **small_kwargs('sa_quadratic_cifar'))
    assert len(model(torch.randn(1, 3, 32, 32))) == 1


@pytest.mark.parametrize('name', MODELS)
def test_torchscript(name):
    with set_scriptable(True):
        model, x = _small(name)
    scripted = torch.jit.script(model.eval())
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.parametrize('name', MODELS)
def test_fx_trace(name):
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names
    model, x = _small(name)
    model.eval()
    tracer_kwargs = dict(leaf_modules=list(get_notrace_modules()), autowrap_functions=list(get_notrace_functions()))
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    fx_model = create_feature_extractor(model, eval_return_nodes=[eval_nodes[-1]], train_return_nodes=[eval_nodes[-1]],
                                        tracer_kwargs=tracer_kwargs)
    with torch.no_grad():
        out = tuple(fx_model(x).values())[0]
        assert torch.equal(out, model(x))
        torch.testing.assert_close(tuple(torch.jit.script(fx_model)(x).values())[0], out)  # timm's FX → TorchScript
        with pytest.raises(ValueError, match='got dtype torch.uint8'):  # the input check survives FX's dead-code pass
            fx_model(x.to(torch.uint8))


@pytest.mark.parametrize('name', MODELS)
def test_channels_last_and_factory_kwargs(name):
    model, x = _small(name)
    model.eval()
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            model.to(memory_format=torch.channels_last)(x), ref, rtol=1e-5, atol=1e-5)
    double = timm.create_model(name, dtype=torch.float64, **small_kwargs(name)).eval()
    assert all(p.dtype == torch.float64 for p in double.parameters())
    assert double(x.double()).dtype == torch.float64
    meta = timm.create_model(name, device='meta', **small_kwargs(name))
    assert all(p.device.type == 'meta' for p in meta.parameters())


@pytest.mark.parametrize('name', MODELS)
def test_pretrained_adaptation_in_chans_and_num_classes(name, tmp_path):
    source = timm.create_model(name, **small_kwargs(name))
    path = tmp_path / 'weights.pth'
    torch.save(source.state_dict(), path)
    model, x = _small(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), in_chans=1,
                      num_classes=100)
    first_conv, classifier = model.pretrained_cfg['first_conv'], model.pretrained_cfg['classifier']
    torch.testing.assert_close(
        model.get_submodule(first_conv).weight, source.get_submodule(first_conv).weight.sum(dim=1, keepdim=True))
    source_state = source.state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith((first_conv + '.', classifier + '.')):
            torch.testing.assert_close(value, source_state[key], msg=key)
    assert model.eval()(x).shape == (2, 100)


@pytest.mark.parametrize('name', MODELS)
@pytest.mark.parametrize('layer_decay', [None, 0.7])
def test_optimizer_groups(name, layer_decay):
    model = timm.create_model(name, **small_kwargs(name))
    groups = create_optimizer_v2(model, 'sgd', lr=0.1, weight_decay=1e-4, layer_decay=layer_decay).param_groups
    decay = {id(p): g['weight_decay'] for g in groups for p in g['params']}
    no_decay = model.no_weight_decay()
    for param_name, param in model.named_parameters():
        exempt = param.ndim <= 1 or any(fnmatch.fnmatch(param_name, pattern) for pattern in no_decay)
        assert (decay[id(param)] == 0) == exempt, param_name
    if layer_decay:
        assert len({g['lr_scale'] for g in groups}) > 2  # stem, the layers, head


# a model of each kind of attention: positional SA (quadratic, learned), content SA, AA in a ResNet-50 and in a CIFAR
# ResNet, and the evolving chains of AA and SA
ONE_GRAPH = ['sa_quadratic_cifar', 'sa_learned_cifar', 'sa_learned_content_cifar', 'aa_resnet50', 'aa_resnet20_cifar',
             'ea_aa_resnet20_cifar', 'ea_sa_learned_content_cifar']


@pytest.mark.parametrize('name', ONE_GRAPH)
def test_compiles_to_one_graph_for_inference_and_training(name):
    # a graph break costs a compiled model its speed on a GPU (and fails fullgraph=True): dynamo traces only here
    model, x = _small(name)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model.eval(), backend='eager', fullgraph=True)(x), model(x))
    model.train()
    torch.compile(model, backend='aot_eager', fullgraph=True)(x).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize('name', ['sa_quadratic_cifar', 'sa_learned_content_cifar', 'aa_resnet50'])
def test_torch_compile_needs_no_changes(name):
    model, x = _small(name)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=1e-4, atol=1e-4)
