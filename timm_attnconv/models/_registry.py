"""Registration through timm's registry, refusing names timm already owns.

timm silently replaces an entrypoint registered twice and drops its pretrained tags (timm-plugin spec §0 A3), so a
name collision with one of timm's models would break that model for every user who imports this package.
"""
from typing import Callable, TypeVar

from timm.models import is_model, list_models
from timm.models import register_model as _timm_register_model

__all__ = ['register_model']

_Fn = TypeVar('_Fn', bound=Callable)


def register_model(fn: _Fn) -> _Fn:
    """``timm.models.register_model`` that raises if ``fn.__name__`` belongs to a model outside this package."""
    name = fn.__name__
    module = fn.__module__.split('.')[-1]
    if is_model(name) and name not in list_models(module=module):
        raise RuntimeError(
            f'model name {name!r} is already registered outside timm_attnconv; '
            f'registering it again would replace that model: rename the entrypoint')
    return _timm_register_model(fn)
