"""Every family traces with torch.export and the exported program matches eager outputs."""
import pytest
import timm
import torch

CASES = [('sa_quadratic_tiny_cifar', {}, 32), ('sa_learned_content_tiny_cifar', dict(depth=2), 32),
         ('aa_resnet20_cifar', {}, 32), ('ea_aa_resnet20_cifar', {}, 32),
         ('ea_deit_tiny_patch16_224', dict(depth=2), 224)]


@pytest.mark.parametrize('name,kwargs,size', CASES)
def test_torch_export_matches_eager(name, kwargs, size):
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))
