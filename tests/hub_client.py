"""Run by ``test_pretrained.py`` in a fresh interpreter, after it set ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` to a loopback
hub: huggingface_hub reads them at import, so this cannot run inside the pytest process.

    python hub_client.py <arch.tag> <reference weights file> <tampered revision> <tampered config revision>
        <revision whose config names another architecture> → one JSON line of results
"""
import json
import sys
import tempfile

import torch


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # reported to the test, which checks the kind and the message
        return f'{type(e).__name__}: {e}'


def main(arch_tag: str, reference_file: str, tampered_revision: str, tampered_config_revision: str,
         other_arch_revision: str) -> None:
    import huggingface_hub.constants as hub_constants
    import timm
    import timm_attnconv
    from safetensors.torch import load_file

    arch = arch_tag.split('.')[0]
    repo = timm_attnconv.pretrained.hub_id(arch_tag)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reference = timm.create_model(arch)
    reference.load_state_dict(load_file(reference_file))
    expected = reference.eval()(x)

    def max_diff(name):
        model = timm.create_model(name, pretrained=True).eval()
        return (model(x) - expected).abs().max().item()

    result = dict(
        registry=_outcome(lambda: max_diff(arch)),
        hf_hub=_outcome(lambda: max_diff(f'hf-hub:{repo}')),
        tampered=_outcome(lambda: max_diff(f'hf-hub:{repo}@{tampered_revision}')),
        tampered_config=_outcome(lambda: max_diff(f'hf-hub:{repo}@{tampered_config_revision}')),
        other_arch=_outcome(lambda: max_diff(f'hf-hub:{repo}@{other_arch_revision}')),
    )
    hub_constants.HF_HUB_OFFLINE = True  # what HF_HUB_OFFLINE=1 sets at import
    result['offline_cached'] = _outcome(lambda: max_diff(arch))
    hub_constants.HF_HUB_CACHE = tempfile.mkdtemp()
    result['offline_uncached'] = _outcome(lambda: max_diff(arch))
    print(json.dumps(result))


if __name__ == '__main__':
    main(*sys.argv[1:])
