"""torch.hub from a local clone: one documented entrypoint per registered model."""
from pathlib import Path

import torch

import timm_attnconv

REPO = Path(__file__).resolve().parents[1]


def test_hub_load_local_with_timm_kwargs():
    model = torch.hub.load(str(REPO), 'sa_learned_cifar', source='local', pretrained=False,
                           num_classes=7, embed_dim=16, depth=1)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 7)


def test_entrypoints_follow_the_registry():
    import hubconf
    entrypoints = {n for n in dir(hubconf) if callable(getattr(hubconf, n)) and not n.startswith('_')}
    assert entrypoints == set(timm_attnconv.list_models())
    assert all('timm.create_model' in getattr(hubconf, n).__doc__ for n in entrypoints)
    assert set(hubconf.dependencies) >= {'torch', 'timm'}
