"""Property-based checks over batch sizes, image sizes, channels and dtypes for every family: a correct output
shape with finite values, or a ValueError that names the problem; eval is deterministic."""
import pytest
import timm
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

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
@given(name=st.sampled_from(sorted(FAMILIES)), batch=st.integers(1, 3), height=st.integers(1, 40),
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
