"""A training run's checkpoint as a file: its digest, reading it back, and the model inside it.

``python -m timm_attnconv.train`` writes the checkpoint; this module is what every other tool (evaluate, stage, viz,
transfer) needs to read one, so that none of them depends on the trainer.
"""
import hashlib
import os
import pickle
import warnings
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

__all__ = ['checkpoint_digest', 'build_model', 'read_checkpoint', 'load_weights', 'architecture_mismatch',
           'load_training_checkpoint']


def _hash_into(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f'tensor {t.dtype} {list(t.shape)};'.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f'dict {len(obj)};'.encode())
        for key, value in obj.items():
            _hash_into(h, key)
            _hash_into(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(f'{type(obj).__name__} {len(obj)};'.encode())
        for value in obj:
            _hash_into(h, value)
    else:
        h.update(f'{type(obj).__name__} {obj!r};'.encode())


def checkpoint_digest(state: Dict[str, Any]) -> str:
    """sha256 of a checkpoint's contents but its ``'sha256'``: tensors by dtype, shape and bytes, other values by type
    and repr, in order. It hashes what was saved, not torch's file format, so a torch upgrade does not change it."""
    h = hashlib.sha256()
    _hash_into(h, {k: v for k, v in state.items() if k != 'sha256'})
    return h.hexdigest()


def build_model(config: Dict[str, Any]) -> nn.Module:
    """The model a run config names, freshly initialised: CIFAR-10's 10 classes, the run's model kwargs."""
    import timm
    return timm.create_model(config['model'], num_classes=10, **config['model_kwargs'])


def read_checkpoint(path: str) -> Dict[str, Any]:
    """A training checkpoint, loaded on the CPU and checked against the sha256 digest it carries (one from before
    checkpoints carried a digest loads with a warning)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no training checkpoint at {path!r}')
    try:
        state = torch.load(path, map_location='cpu', weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f'cannot read {path!r} as a training checkpoint ({type(e).__name__}: {e}): the file is '
                         f'truncated or corrupt. Restore it from a copy, or start over with another --output') from e
    if not isinstance(state, dict) or 'config' not in state:
        raise ValueError(f'{path!r} is not a training checkpoint of `python -m timm_attnconv.train` (it holds no run '
                         f'config; a weights file? the tools read those as .safetensors files)')
    if 'sha256' not in state:
        warnings.warn(f'{path!r} was written before training checkpoints carried a sha256 digest: its contents are '
                      f'not verified')
    elif checkpoint_digest(state) != state['sha256']:
        raise ValueError(f'{path!r} does not match the sha256 digest written into it: it was altered or corrupted '
                         f'after training saved it. Restore it from a copy, or start over with another --output')
    return state


def load_weights(state: Dict[str, Any], key: str = 'model') -> nn.Module:
    """The model of a loaded training checkpoint with its ``'model'`` or ``'ema'`` weights, in eval mode."""
    if state.get(key) is None:
        raise ValueError(f'the checkpoint has no {key} weights (was the run started with --model-ema?)')
    model = build_model(state['config'])
    weights = {k.removeprefix('module.'): v for k, v in state[key].items()}
    model.load_state_dict(weights)
    return model.eval()


def architecture_mismatch(path: str, trained: str, expected: Optional[str]) -> Optional[str]:
    """The error for a checkpoint of ``trained`` given where ``expected`` (an architecture, tag optional) is wanted;
    None when they match or nothing is expected."""
    if expected is None or trained.split('.')[0] == expected.split('.')[0]:
        return None
    return f'{path!r} is a checkpoint of {trained}, not of {expected}: pass --model {trained}'


def load_training_checkpoint(path: str, use_ema: bool = False, model_name: Optional[str] = None) -> nn.Module:
    """The model of a training checkpoint file (its EMA weights with ``use_ema``), in eval mode. ``model_name``: the
    architecture the caller expects; a checkpoint of another one is refused."""
    state = read_checkpoint(path)
    mismatch = architecture_mismatch(path, state['config']['model'], model_name)
    if mismatch:
        raise ValueError(mismatch)
    try:
        return load_weights(state, 'ema' if use_ema else 'model')
    except ValueError as e:
        raise ValueError(f'{path!r}: {e}') from e
