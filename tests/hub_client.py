"""Run by ``test_pretrained.py`` in a fresh interpreter, after it set ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` (and, for the
offline mode, ``HF_HUB_OFFLINE=1``) to a loopback hub: huggingface_hub reads them at import, so this cannot run
inside the pytest process, and offline mode is set the way a user sets it, not by patching the library's constants.

    python hub_client.py online <arch.tag> <reference weights file> <tampered revision> <tampered config revision>
        <revision whose config names another architecture> → one JSON line of results
    python hub_client.py offline <arch.tag> <reference weights file> <arch.tag of another model, not in the cache>
        → one JSON line of results
"""
import json
import sys

import torch


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # reported to the test, which checks the kind and the message
        return f'{type(e).__name__}: {e}'


def _max_diff_to(reference_arch: str, reference_file: str):
    """A function of a model name: the largest logit difference of its pretrained model to the reference weights."""
    import timm
    from safetensors.torch import load_file

    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reference = timm.create_model(reference_arch)
    reference.load_state_dict(load_file(reference_file))
    expected = reference.eval()(x)

    def max_diff(name):
        model = timm.create_model(name, pretrained=True).eval()
        return (model(x) - expected).abs().max().item()
    return max_diff


def online(arch_tag: str, reference_file: str, tampered_revision: str, tampered_config_revision: str,
           other_arch_revision: str) -> dict:
    import timm_attnconv

    arch = arch_tag.split('.')[0]
    repo = timm_attnconv.pretrained.hub_id(arch_tag)
    max_diff = _max_diff_to(arch, reference_file)
    return dict(
        registry=_outcome(lambda: max_diff(arch)),
        hf_hub=_outcome(lambda: max_diff(f'hf-hub:{repo}')),
        tampered=_outcome(lambda: max_diff(f'hf-hub:{repo}@{tampered_revision}')),
        tampered_config=_outcome(lambda: max_diff(f'hf-hub:{repo}@{tampered_config_revision}')),
        other_arch=_outcome(lambda: max_diff(f'hf-hub:{repo}@{other_arch_revision}')),
    )


def offline(arch_tag: str, reference_file: str, uncached_arch_tag: str) -> dict:
    import timm
    import timm_attnconv  # noqa: F401  (registers the models)

    max_diff = _max_diff_to(arch_tag.split('.')[0], reference_file)
    return dict(cached=_outcome(lambda: max_diff(arch_tag)),
                uncached=_outcome(lambda: timm.create_model(uncached_arch_tag, pretrained=True) and 'loaded'))


if __name__ == '__main__':
    mode, *args = sys.argv[1:]
    print(json.dumps(dict(online=online, offline=offline)[mode](*args)))
