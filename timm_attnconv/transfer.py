"""Bring a training run back from a machine that returns files in limited sizes, as a run folder ``stage`` reads.

    python -m timm_attnconv.transfer export RUN OUT [--start N] [--weights ema | --checkpoint]  # there: next parts
    python -m timm_attnconv.transfer join FOLDER PARTS [PARTS ...]  # here: the parts of every call into FOLDER

``export`` reads the run's training checkpoint (digest-checked) and writes its weights, and its EMA weights when the
run kept them (``--weights model`` or ``ema``: only those, in half the calls), as float32 safetensors with the model's
own keys (``model.safetensors``, ``ema.safetensors``), cut into parts of at most 15 MiB (``model.safetensors.part00``,
...). ``--checkpoint`` writes the checkpoint file itself instead (``last.pth.tar``: weights, EMA, optimizer,
scheduler and random states), for a run that a later session resumes (``training/gpu/README.md``). One call returns
at most 8 files and 64 MiB, so each call writes the parts that fit beside three small files: ``manifest.json`` (size
and sha256 of each file and of each of its parts; the checkpoint's epoch and step), ``config.json`` (the run config
as the checkpoint records it) and ``log.jsonl``. It prints the ``--start`` of the next call until every part is out.

``join`` concatenates the parts found in the given folders (one per call), checks every sha256 against the manifest,
and writes ``model.safetensors`` / ``ema.safetensors`` (or ``last.pth.tar``) byte for byte as exported, beside
``config.json``, ``log.jsonl`` and the manifest: the folder ``python -m timm_attnconv.stage`` stages (a card says
after how many epochs the weights were taken, mid-epoch too).
"""
import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence

from . import cli
from .constants import CHECKPOINT, LOG, MANIFEST, RUN_CONFIG, WEIGHTS_FILES
from .runs import atomic_write, logged_epochs, read_checkpoint, steps_per_epoch

__all__ = ['export', 'join', 'main']

MiB = 1 << 20
PART_BYTES = 15 * MiB
# what one call of the device tool brings back
CALL_FILES, CALL_BYTES = 8, 64 * MiB


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _part_name(name: str, index: int) -> str:
    return f'{name}.part{index:02d}'


def _weights_bytes(state: Dict[str, Any], keys: Sequence[str]) -> Dict[str, bytes]:
    """The run's float32 safetensors files of ``keys`` (``'model'``, ``'ema'``) that it has, as bytes (the EMA's keys
    without ModelEmaV3's ``module.`` prefix)."""
    from safetensors.torch import save
    return {WEIGHTS_FILES[key]: save({k.removeprefix('module.'): v.contiguous() for k, v in state[key].items()})
            for key in keys if state.get(key) is not None}


def export(run_dir: str, out_dir: str, start: int = 0, part_bytes: int = PART_BYTES, max_files: int = CALL_FILES,
           max_bytes: int = CALL_BYTES, weights: str = 'both', checkpoint: bool = False) -> Dict[str, Any]:
    """Write the small files and the parts from number ``start`` on that fit one call into ``out_dir``; ``weights``:
    ``'both'`` (the weights and, if kept, the EMA), ``'model'`` or ``'ema'``; ``checkpoint``: the checkpoint file
    instead, byte for byte. Returns ``{'parts': count of all parts, 'written': names written, 'next': the next call's
    start or None}``."""
    path = os.path.join(run_dir, CHECKPOINT)
    if checkpoint:
        if weights != 'both':
            raise ValueError(f'--checkpoint exports the whole training state, weights and EMA included: drop '
                             f'--weights {weights}')
        if not os.path.isfile(path):
            raise FileNotFoundError(f'no training checkpoint at {path!r}')
        with open(path, 'rb') as f:  # read once: the run may write its next checkpoint meanwhile
            data = f.read()
        state, files = read_checkpoint(path, data), {CHECKPOINT: data}
    else:
        state = read_checkpoint(path)
        if weights == 'ema' and state.get('ema') is None:
            raise ValueError(f'{run_dir!r} kept no EMA weights (it was trained without --model-ema): export '
                             f'--weights model')
        files = _weights_bytes(state, list(WEIGHTS_FILES) if weights == 'both' else [weights])
    parts = [(name, i, data[offset:offset + part_bytes])
             for name, data in files.items() for i, offset in enumerate(range(0, len(data), part_bytes))]
    if not 0 <= start < len(parts):
        raise ValueError(f'--start {start} is past the last part: {run_dir!r} exports {len(parts)} parts, 0 to '
                         f'{len(parts) - 1}')
    records = {name: dict(size=len(data), sha256=_sha256(data),
                          parts=[_sha256(part) for n, _, part in parts if n == name]) for name, data in files.items()}
    manifest = dict(epoch=state['epoch'], step_in_epoch=state['step_in_epoch'], steps_per_epoch=steps_per_epoch(state),
                    files=records)
    small = {MANIFEST: json.dumps(manifest, indent=1), RUN_CONFIG: json.dumps(state['config'], indent=1),
             LOG: ''.join(json.dumps(entry, allow_nan=False) + '\n'
                          for entry in logged_epochs(state, os.path.join(run_dir, LOG)))}
    os.makedirs(out_dir, exist_ok=True)
    files_left, bytes_left = max_files - len(small), max_bytes - sum(len(text.encode()) for text in small.values())
    written = []
    for name, text in small.items():
        with open(os.path.join(out_dir, name), 'w') as f:
            f.write(text)
        written.append(name)
    index = start
    while index < len(parts) and files_left > 0 and len(parts[index][2]) <= bytes_left:
        name, i, data = parts[index]
        with open(os.path.join(out_dir, _part_name(name, i)), 'wb') as f:
            f.write(data)
        written.append(_part_name(name, i))
        files_left, bytes_left, index = files_left - 1, bytes_left - len(data), index + 1
    if index == start:
        raise ValueError(f'no part of {part_bytes} bytes fits this call beside the small files (--max-files '
                         f'{max_files}, --max-bytes {max_bytes}): collect in a call that returns nothing else')
    return dict(parts=len(parts), written=written, next=index if index < len(parts) else None)


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _find(name: str, sources: Sequence[str]) -> List[str]:
    return [os.path.join(s, name) for s in sources if os.path.isfile(os.path.join(s, name))]


def join(run_dir: str, sources: Sequence[str]) -> Dict[str, str]:
    """Join the exported parts in ``sources`` into ``run_dir``; returns the sha256 of each weights file written."""
    manifests = _find(MANIFEST, sources)
    if not manifests:
        raise FileNotFoundError(f'no {MANIFEST} in {list(sources)}: pass the folders that `python -m '
                                f'timm_attnconv.transfer export` wrote (one per call)')
    manifest = _read_json(manifests[0])
    if any(_read_json(path) != manifest for path in manifests[1:]):
        raise ValueError(f'the manifests in {manifests} differ: the parts come from different checkpoints of the run '
                         f'(it went on training between the calls) or from exports of different --weights. Export '
                         f'all parts again from one checkpoint, with one --weights')
    joined, missing = {}, []
    for name, record in manifest['files'].items():
        chunks = []
        for i, digest in enumerate(record['parts']):
            found = _find(_part_name(name, i), sources)
            if not found:
                missing.append(_part_name(name, i))
                continue
            with open(found[0], 'rb') as f:
                chunks.append(f.read())
            if _sha256(chunks[-1]) != digest:
                raise ValueError(f'{found[0]!r} does not match the sha256 in {MANIFEST}: it was damaged on the way. '
                                 f'Export it again')
        joined[name] = b''.join(chunks)
    if missing:
        raise FileNotFoundError(f"parts missing from {list(sources)}: {', '.join(missing)}; export the calls that "
                                f'write them (export prints each call\'s --start) and pass all their folders')
    if CHECKPOINT not in joined and os.path.isfile(os.path.join(run_dir, CHECKPOINT)):
        raise ValueError(f'{run_dir!r} holds a training checkpoint ({CHECKPOINT}, an earlier session\'s?), which '
                         f'stage would read instead of these weights: join them into another folder')
    for name, data in joined.items():
        if _sha256(data) != manifest['files'][name]['sha256'] or len(data) != manifest['files'][name]['size']:
            raise ValueError(f'the joined {name} does not match the sha256 in {MANIFEST}; export it again')
    for name in (RUN_CONFIG, LOG, MANIFEST):  # the manifest tells stage the epoch and step the weights were taken at
        found = _find(name, sources)
        if not found:
            raise FileNotFoundError(f'no {name} in {list(sources)}: every export call writes one beside its parts; '
                                    f'pass the folders as the calls wrote them')
        with open(found[0], 'rb') as f:
            joined[name] = f.read()
    os.makedirs(run_dir, exist_ok=True)
    for name, data in joined.items():
        atomic_write(os.path.join(run_dir, name), lambda f: f.write(data))
    return {name: record['sha256'] for name, record in manifest['files'].items()}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    commands = parser.add_subparsers(dest='command', required=True)
    out = commands.add_parser('export', help='write the next parts of a run (run on the machine that trained it)')
    out.add_argument('run', help='--output folder of the training run (last.pth.tar)')
    out.add_argument('out', help='folder to write into, e.g. $OUT/<run name>')
    out.add_argument('--start', type=cli.non_negative_int, default=0,
                     help='first part to write (the previous call prints it)')
    out.add_argument('--max-files', type=cli.positive_int, default=CALL_FILES,
                     help=f'files this call may still return (default {CALL_FILES}: less what else it returns)')
    out.add_argument('--max-bytes', type=cli.positive_int, default=CALL_BYTES,
                     help=f'bytes this call may still return (default {CALL_BYTES})')
    out.add_argument('--weights', choices=('both', 'model', 'ema'), default='both',
                     help='which weights to export; model or ema take half the calls (the last test in the run\'s '
                          'log says which scored higher); every call of one export passes the same')
    out.add_argument('--checkpoint', action='store_true',
                     help='export the training checkpoint itself (weights, EMA, optimizer and random states), for a '
                          'run that a later session resumes; every call of one export passes it')
    back = commands.add_parser('join', help='join the parts of every call into a run folder')
    back.add_argument('run', help='run folder to write (model.safetensors / ema.safetensors or last.pth.tar, '
                                  'config.json, log.jsonl)')
    back.add_argument('parts', nargs='+', help='the folders the export calls wrote, one per call')
    args = parser.parse_args(argv)
    if args.command == 'export':
        result = export(args.run, args.out, args.start, max_files=args.max_files, max_bytes=args.max_bytes,
                        weights=args.weights, checkpoint=args.checkpoint)
        print(f"wrote {', '.join(result['written'])} ({result['parts']} parts in all); " + (
            'every part is out' if result['next'] is None else f"next call: --start {result['next']}"))
    else:
        result = join(args.run, args.parts)
        print(f"joined into {args.run}: " + ', '.join(f'{name} sha256 {digest}' for name, digest in result.items()))
    return result


if __name__ == '__main__':
    cli.run(main)
