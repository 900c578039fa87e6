"""pytest plugin: timm's own ``tests/test_models.py``, unmodified, over this package's models only.

    PYTHONPATH=.ci python -m pytest -p timm_suite path/to/pytorch-image-models/tests/test_models.py

timm's test module builds its parameter lists at import, from ``timm.list_models`` and ``timm.list_pretrained``: this
plugin loads first, registers the models and narrows those two functions to them; timm's filters (exclusions, name
patterns, ``name_matches_cfg``) apply unchanged. Tests of timm's own models are deselected.
"""
import timm

import timm_attnconv

MODELS = set(timm_attnconv.list_models())


def _ours(list_fn):
    def narrowed(*args, **kwargs):
        return [name for name in list_fn(*args, **kwargs) if name.split('.')[0] in MODELS]
    return narrowed


timm.list_models = _ours(timm.list_models)
timm.list_pretrained = _ours(timm.list_pretrained)


def _model_name(item) -> str:
    name = getattr(getattr(item, 'callspec', None), 'params', {}).get('model_name')
    return name.split('.')[0] if isinstance(name, str) else ''


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if _model_name(item) in MODELS]
    config.hook.pytest_deselected(items=[item for item in items if _model_name(item) not in MODELS])
    items[:] = ours
