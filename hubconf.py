"""torch.hub entrypoints: one per registered timm_attnconv model, generated from timm's registry.

    torch.hub.load('<path to a clone>', 'sa_quadratic_cifar', source='local', pretrained=False, num_classes=10)
"""
import timm as _timm
import timm_attnconv as _timm_attnconv

dependencies = ['torch', 'timm', 'huggingface_hub', 'safetensors']


def _make_entrypoint(name: str):
    def entrypoint(pretrained: bool = False, **kwargs):
        return _timm.create_model(name, pretrained=pretrained, **kwargs)
    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__doc__ = (
        f"{_timm.models.model_entrypoint(name).__doc__}\n\n"
        f"Calls ``timm.create_model('{name}', pretrained=pretrained, **kwargs)``; any timm keyword works.")
    return entrypoint


for _name in _timm_attnconv.list_models():
    globals()[_name] = _make_entrypoint(_name)
