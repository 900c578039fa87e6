"""How a model family joins the package: its module, its entrypoints, and the one builder every ``_create_*`` calls.

A family is a module of this package named in :data:`MODEL_MODULES` (imported by ``models/__init__``) whose
entrypoints use this module's :func:`register_model` and whose ``_create_*`` is one call of
:func:`build_family_model`, which verifies pretrained files before timm loads them.
"""
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union

import timm
import torch.nn as nn
from timm.models import build_model_with_cfg, is_model
from timm.models import register_model as _timm_register_model

from ..pretrained import resolve_pretrained_kwargs

__all__ = ['MODEL_MODULES', 'list_models', 'register_model', 'build_family_model']

# timm keys its registry by the last component of each model's module name
MODEL_MODULES = ('sa_cordonnier', 'attn_augment', 'evolving_attention')

_Fn = TypeVar('_Fn', bound=Callable)


def list_models(filter: Union[str, List[str]] = '', pretrained: bool = False) -> List[str]:
    """Names of the models this package registers (timm's ``list_models`` restricted to its modules)."""
    return timm.list_models(filter=filter, module=list(MODEL_MODULES), pretrained=pretrained)


def register_model(fn: _Fn) -> _Fn:
    """``timm.models.register_model`` that raises if ``fn.__name__`` belongs to a model outside this package.

    timm replaces an entrypoint registered twice and drops its pretrained tags (``timm/models/_registry.py``,
    ``register_model``), so a name collision would break one of timm's models for every user of this package.
    """
    name = fn.__name__
    module = fn.__module__.split('.')[-1]
    if is_model(name) and name not in timm.list_models(module=module):
        raise RuntimeError(
            f'model name {name!r} is already registered outside timm_attnconv; '
            f'registering it again would replace that model: rename the entrypoint')
    return _timm_register_model(fn)


def build_family_model(
        model_cls: Callable[..., nn.Module],
        variant: str,
        pretrained: bool,
        pretrained_filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, Any]],
        feature_defaults: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
) -> nn.Module:
    """timm's ``build_model_with_cfg`` for a family's model, with its pretrained files found and sha256-checked
    (:func:`~timm_attnconv.pretrained.resolve_pretrained_kwargs`) before timm reads them.

    ``feature_defaults``: the family's ``feature_cfg`` for ``features_only``; the caller's ``out_indices`` and
    ``feature_cfg`` override its entries (passing both to timm would be a ``TypeError``).
    """
    kwargs = resolve_pretrained_kwargs(variant, pretrained, kwargs)
    if feature_defaults is not None:
        feature_cfg = dict(feature_defaults)
        if 'out_indices' in kwargs:
            feature_cfg['out_indices'] = kwargs.pop('out_indices')
        feature_cfg.update(kwargs.pop('feature_cfg', None) or {})
        kwargs['feature_cfg'] = feature_cfg
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=pretrained_filter_fn, **kwargs)
