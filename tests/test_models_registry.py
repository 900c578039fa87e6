"""The family registry: one builder every family goes through (so every pretrained file is sha256-checked), the
package's model list, and names that timm already owns refused."""
import ast
from pathlib import Path

import pytest
import timm

import timm_attnconv
from timm_attnconv.models import _registry

from .families import small_kwargs

MODELS_DIR = Path(_registry.__file__).parent


def _called_names(path: Path) -> set:
    calls = [node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]
    return {getattr(f, 'id', getattr(f, 'attr', None)) for f in calls}


def test_only_the_family_builder_builds_models():
    # a family that called timm's builder itself could skip the sha256 check of its pretrained files
    for path in MODELS_DIR.glob('*.py'):
        if path.name != '_registry.py':
            assert not _called_names(path) & {'build_model_with_cfg', 'resolve_pretrained_kwargs'}, path.name


@pytest.mark.parametrize('name', ['sa_quadratic_tiny_cifar', 'ea_sa_learned_content_tiny_cifar', 'aa_resnet50',
                                  'aa_resnet20_cifar', 'ea_aa_resnet50', 'deit_ea_tiny_patch16_224'])
def test_every_create_function_resolves_pretrained_files(name, monkeypatch):
    resolved, resolve = [], _registry.resolve_pretrained_kwargs

    def recording(variant, pretrained, kwargs):
        resolved.append(variant)
        return resolve(variant, pretrained, kwargs)

    monkeypatch.setattr(_registry, 'resolve_pretrained_kwargs', recording)
    timm.create_model(name, **small_kwargs(name))
    assert resolved == [name]


def test_list_models_is_every_family_module():
    assert set(timm_attnconv.list_models()) == {
        name for module in _registry.MODEL_MODULES for name in timm.list_models(module=module)}


def test_registration_refuses_a_timm_name():
    def resnet50(pretrained=False, **kwargs):
        raise AssertionError('never built')

    resnet50.__module__ = 'timm_attnconv.models.not_timm'
    timms = timm.models.model_entrypoint('resnet50')
    with pytest.raises(RuntimeError, match='already registered'):
        _registry.register_model(resnet50)
    assert timm.models.model_entrypoint('resnet50') is timms and timm.list_models('resnet50') == ['resnet50']
