"""Property-based checks over batch sizes, image sizes, channels and dtypes for every family: a correct output
shape with finite values, or a ValueError that names the problem; eval is deterministic. An empty batch gives an
empty output on every path, as timm's models do, also once compiled for dynamic batch sizes."""
import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from timm_attnconv.layers import ATTN_KERNELS, ATTN_PATHS, EVOLUTION_LAYOUTS, set_evolution_layout

# one compact model per family (the paper-size ones share their code)
FAMILIES = {'sa_quadratic_tiny_cifar': 2, 'sa_learned_content_tiny_cifar': 2, 'aa_resnet20_cifar': 1,
            'ea_aa_resnet20_cifar': 1}
_MODELS = {}


def _model(name, in_chans):
    key = (name, in_chans)
    if key not in _MODELS:
        _MODELS[key] = timm.create_model(name, in_chans=in_chans, num_classes=5).eval()
    return _MODELS[key]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FAMILIES)), batch=st.integers(0, 3), height=st.integers(1, 40),
       width=st.integers(1, 40), in_chans=st.sampled_from([1, 3]), given_chans=st.sampled_from([1, 3, 4]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.uint8]))
def test_output_is_correct_and_finite_or_the_error_is_clear(name, batch, height, width, in_chans, given_chans,
                                                            dtype):
    model = _model(name, in_chans).to(torch.float64 if dtype == torch.float64 else torch.float32)
    x = (torch.rand(batch, given_chans, height, width) * 255).to(dtype)
    multiple = FAMILIES[name]
    valid = given_chans == in_chans and dtype.is_floating_point and height % multiple == 0 \
        and width % multiple == 0 and height >= multiple and width >= multiple
    with torch.no_grad():
        if not valid:
            with pytest.raises(ValueError, match='expected a float tensor of shape'):
                model(x)
            return
        out = model(x)
        assert out.shape == (batch, 5) and out.dtype == x.dtype and torch.isfinite(out).all()
        assert torch.equal(model(x), out)  # eval is deterministic


def _evolution_cases(name, **kwargs):
    return [(name, dict(kwargs, layout=layout)) for layout in EVOLUTION_LAYOUTS]


# every named path and kernel of each family, with its model's forward options
EMPTY_BATCH_CASES = (
    [('sa_quadratic_tiny_cifar', dict(attn_path=path)) for path in ATTN_PATHS]
    + [('sa_learned_content_tiny_cifar', dict(attn_kernel=kernel)) for kernel in ATTN_KERNELS]
    + [('aa_resnet20_cifar', dict(attn_kernel=kernel)) for kernel in ATTN_KERNELS]
    + _evolution_cases('ea_aa_resnet20_cifar') + _evolution_cases('deit_ea_tiny_patch16_224', img_size=32))


@pytest.mark.parametrize('name,kwargs', EMPTY_BATCH_CASES, ids=str)
def test_an_empty_batch_gives_an_empty_output(name, kwargs, eager_flex):
    kwargs = dict(kwargs)
    layout = kwargs.pop('layout', None)
    model = timm.create_model(name, num_classes=5, **kwargs)
    if layout is not None:
        set_evolution_layout(model, layout)
    x = torch.zeros(0, 3, 32, 32)
    with torch.no_grad():
        assert model.eval()(x).shape == (0, 5)
        assert [y.shape[0] for y in model.forward_intermediates(x, intermediates_only=True)] == [0] * len(
            model.feature_info)
    if kwargs.get('attn_kernel') != 'flex':  # FlexAttention has no CPU backward
        model.train()(x).sum().backward()


@pytest.mark.slow  # up to a minute of tracing per model here
@pytest.mark.parametrize('name,kwargs', [(name, {}) for name in FAMILIES]
                         + [('deit_ea_tiny_patch16_224', {'img_size': 32})], ids=str)
def test_a_model_compiled_for_dynamic_batches_takes_an_empty_batch(name, kwargs):
    # dynamo specialises batch sizes 0 and 1, so the empty batch is a second graph traced after the symbolic one
    model = timm.create_model(name, num_classes=5, **kwargs).eval()
    compiled = torch.compile(model, dynamic=True, backend='aot_eager')
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        assert compiled(x[:0]).shape == (0, 5)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_sharp_quadratic_heads_stay_finite_in_half_precision(dtype):
    model = timm.create_model('sa_quadratic_tiny_cifar').eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pos.spreads.fill_((2 * 1e4) ** 0.5)  # α = σ²/2 = 1e4
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), torch.autocast('cpu', dtype=dtype):
        out = model(x)
    assert torch.isfinite(out).all()
    with torch.no_grad():
        assert torch.isfinite(model.to(dtype)(x.to(dtype))).all()
