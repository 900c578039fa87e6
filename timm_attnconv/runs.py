"""A training run's folder as files: the checkpoint (its digest, writing it atomically, reading it back, the model
inside it) and the log.

``python -m timm_attnconv.train`` writes them through this module, and every other tool (evaluate, stage, viz,
transfer) reads them through it, so that none of them depends on the trainer.
"""
import hashlib
import io
import json
import os
import pickle
import re
import warnings
from typing import IO, Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .constants import CHECKPOINT, CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, LOG

__all__ = ['checkpoint_digest', 'atomic_write', 'save_checkpoint', 'write_log', 'logged_epochs', 'steps_per_epoch',
           'epochs_done', 'cifar10_cfg_overlay', 'build_model', 'read_checkpoint', 'load_weights',
           'architecture_mismatch', 'load_training_checkpoint']


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


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through a temporary file, synced to disk, then renamed over it: a reader, or a run killed at any
    moment, sees the old file or the new one, never a part of either."""
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str, state: Dict[str, Any]) -> None:
    """Write ``state`` with its sha256 digest as the checkpoint of ``run_dir``, atomically, then the log it holds
    (``state['log']``) as ``log.jsonl``: after the checkpoint, so that a kill in between loses no line (resuming
    rewrites the log from the checkpoint)."""
    state = dict(state, sha256=checkpoint_digest(state))
    atomic_write(os.path.join(run_dir, CHECKPOINT), lambda f: torch.save(state, f))
    write_log(state['log'], os.path.join(run_dir, LOG))


def write_log(entries: List[Dict[str, Any]], path: str) -> None:
    """``log.jsonl`` as the checkpoint records it: one strict-JSON line (no NaN) per finished epoch."""
    text = ''.join(json.dumps(entry, allow_nan=False) + '\n' for entry in entries)
    atomic_write(path, lambda f: f.write(text.encode()))


def logged_epochs(state: Dict[str, Any], log_path: str) -> List[Dict[str, Any]]:
    """The log entries of the epochs a checkpoint has finished: its own record or, for a checkpoint written before it
    carried one, those lines of ``log.jsonl``."""
    if 'log' in state:
        return state['log']
    if not os.path.isfile(log_path):
        return []
    with open(log_path) as f:
        return [entry for entry in map(json.loads, filter(str.strip, f)) if entry['epoch'] <= state['epoch']]


def steps_per_epoch(state: Dict[str, Any]) -> int:
    """The steps of one epoch of a checkpoint's run, as the checkpoint records them. Checkpoints from before that
    record: finished epochs tell it; one stopped in its first epoch falls back to ``--train-limit`` or the 50,000
    images of the full training split."""
    if state.get('steps_per_epoch'):
        return state['steps_per_epoch']
    if state['epoch'] > 0:
        return (state['global_step'] - state['step_in_epoch']) // state['epoch']
    config = state['config']
    return (config.get('train_limit') or 50_000) // config['batch_size']  # EpochBatches drops the last batch


def epochs_done(state: Dict[str, Any]) -> float:
    """How far a checkpoint's run had trained, in epochs, mid-epoch steps included: of the checkpoint itself, or of
    the manifest ``transfer`` wrote for weights taken from one."""
    return state['epoch'] + state['step_in_epoch'] / max(1, steps_per_epoch(state))


def cifar10_cfg_overlay(model_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The ``pretrained_cfg_overlay`` that makes any registered model the CIFAR-10 model a run trains: CIFAR-10's
    statistics (which the trainer and every tool normalise with), class count and names, whatever dataset the name's
    own cfg is for (``aa_wide_resnet28_10_cifar``'s is CIFAR-100; an ImageNet model's ImageNet). An overlay in
    ``model_kwargs`` wins where it names the same field."""
    return {**dict(mean=CIFAR10_MEAN, std=CIFAR10_STD, num_classes=10, label_names=CIFAR10_CLASSES),
            **(model_kwargs.get('pretrained_cfg_overlay') or {})}


def build_model(config: Dict[str, Any]) -> nn.Module:
    """The model a run config names, freshly initialised: 10 classes, the run's model kwargs and a cfg that says it
    is a CIFAR-10 model (:func:`cifar10_cfg_overlay`)."""
    import timm
    kwargs = config['model_kwargs']
    return timm.create_model(config['model'], **dict(kwargs, num_classes=10,
                                                     pretrained_cfg_overlay=cifar10_cfg_overlay(kwargs)))


def read_checkpoint(path: str, data: Optional[bytes] = None) -> Dict[str, Any]:
    """A training checkpoint, loaded on the CPU and checked against the sha256 digest it carries (one from before
    checkpoints carried a digest loads with a warning). ``data``: the file's bytes, read once by a caller that also
    passes them on (a running training may replace the file at any time); ``path`` then only names it."""
    if data is None and not os.path.isfile(path):
        raise FileNotFoundError(f'no training checkpoint at {path!r}')
    try:
        state = torch.load(path if data is None else io.BytesIO(data), map_location='cpu', weights_only=True)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:
        # weights_only refuses any class but tensors and plain containers; timm's train.py saves its argparse options
        foreign = re.search(r'Unsupported global: GLOBAL ([\w.]+)', str(e))
        if foreign:
            raise ValueError(
                f'{path!r} holds {foreign.group(1)} objects, which no training checkpoint of `python -m '
                f'timm_attnconv.train` does (timm\'s train.py saves its options so): the tools read other weights as '
                f".safetensors files. If you trust the file, save its 'state_dict' (or 'state_dict_ema') with "
                f'safetensors.torch.save_file and pass that') from e
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
