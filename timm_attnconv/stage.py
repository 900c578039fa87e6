"""Stage a training run as a Hub model repo in ``weights/<arch>.<tag>/`` and record its sha256.

    python -m timm_attnconv.stage training/sa_quadratic_tiny_cifar --tag c10
    python -m timm_attnconv.stage ../shared/runs/sa_quadratic_cifar-h100 --tag c10 --hardware 'one NVIDIA H100 80GB'
    python -m timm_attnconv.stage --refresh-config weights/sa_quadratic_cifar.c10   # after registering its tag
    python -m timm_attnconv.stage --add-beside weights/aa_resnet20_cifar.c10 --beside attnconv_resnet20_cifar.c10

A run is the ``--output`` folder of ``python -m timm_attnconv.train``: either its training checkpoint
``last.pth.tar``, or, for a run whose optimizer state was not kept, its weights as ``model.safetensors`` and / or
``ema.safetensors`` beside the ``config.json`` the trainer recorded; ``log.jsonl`` in both cases.

Evaluates the run's weights (and its EMA, with ``--weights auto`` the better of the two on the test set) on every
CIFAR-10 test image of ``--data-dir`` (10,000 in the official split; ``--limit`` takes the first N) and picks the
stored dtype by measurement (``--dtype auto``: the first of float16 / bfloat16 whose rounded weights keep top-1 within
0.05 points and the top-1 prediction of at least 99.9% of the images, else float32; loads cast to the model's
dtype). Then writes with timm's ``save_for_hf``: ``config.json`` (with the run's model kwargs, so that it rebuilds the
model as trained) and ``model.safetensors``; and beside them a model card ``README.md`` with Hugging Face metadata
and the measured metrics, ``training_log.jsonl`` and ``training_curves.png``.
``--beside ARCH.TAG`` lists staged folders in the card's comparison with their test top-1, parameters and how their
training commands differ from this run's (an EA twin beside its base, AA beside its plain twin). ``--add-beside``
adds folders to the comparison of a card already staged, without its run: the card then reads as if staged with them.
The sha256 of every file of the folder goes to ``timm_attnconv/weights_sha256.json``, which loads check.
``config.json`` carries the tag's cfg from ``default_cfgs``; a tag staged before it is registered there gets its
arch's default cfg under the new tag, and ``--refresh-config`` rewrites the file once the tag is registered.
"""
import argparse
import copy
import json
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import cli
from .constants import CHECKPOINT, CIFAR10_CLASSES, CONFIG_FILE, LOG, MANIFEST, RUN_CONFIG, WEIGHTS_FILE, WEIGHTS_FILES
from .pretrained import SHA256_RECORD, record_folder, sha256_file

__all__ = ['stage', 'refresh_config', 'add_beside', 'training_command', 'plot_training_curves', 'main']

# a half-precision copy is stored when it changes top-1 by at most this many points and keeps this share of top-1s
MAX_TOP1_CHANGE = 0.05
MIN_AGREEMENT = 0.999
STORAGE_DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}
# Cordonnier et al. 2020, Table 1: CIFAR-10 test accuracy of the paper-size models (300 epochs, SGD, on GPUs), by the
# longest prefix of the architecture's name; None: not in Table 1 (the 16-head model is appendix F's)
PAPER_TOP1 = {
    'sa_quadratic': ('SA quadratic emb. (12.1M params)', 93.8),
    'sa_quadratic_gen': ('SA quadratic emb. generalized (12.1M params)', 93.4),
    'sa_quadratic_gen_pruned': ('SA quadratic emb. generalized, pruned (9.7M params)', 93.4),
    'sa_quadratic_16h': None,
    'sa_learned': ('SA learned emb. (12.3M params)', 91.8),
    'sa_learned_content': ('SA learned emb. + content-based att. (29.5M params)', 87.1),
}
# the models the paper itself fine-tuned from other weights (Cordonnier et al. 2020, §4.1: the trained generalized
# model, its degenerate heads pruned), by architecture: their cards do not call a warm start a departure from the paper
PAPER_WARM_STARTS = {'sa_quadratic_gen_pruned_cifar': 'the trained generalized model with its degenerate heads pruned'}
# by arXiv id, as the cfgs' ``paper_ids`` name them
PAPERS = {
    '1911.03584': ('On the Relationship between Self-Attention and Convolutional Layers',
                   """@inproceedings{Cordonnier2020On,
  title={On the Relationship between Self-Attention and Convolutional Layers},
  author={Jean-Baptiste Cordonnier and Andreas Loukas and Martin Jaggi},
  booktitle={International Conference on Learning Representations},
  year={2020}
}"""),
    '1904.09925': ('Attention Augmented Convolutional Networks', """@inproceedings{Bello2019Attention,
  title={Attention Augmented Convolutional Networks},
  author={Irwan Bello and Barret Zoph and Ashish Vaswani and Jonathon Shlens and Quoc V. Le},
  booktitle={Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
  pages={3286--3295},
  year={2019}
}"""),
    '2102.12895': ('Evolving Attention with Residual Convolutions', """@inproceedings{Wang2021Evolving,
  title={Evolving Attention with Residual Convolutions},
  author={Yujing Wang and Yaming Yang and Jiangang Bai and Mingliang Zhang and Jing Bai and Jing Yu and Ce Zhang
          and Gao Huang and Yunhai Tong},
  booktitle={Proceedings of the 38th International Conference on Machine Learning},
  pages={10971--10980},
  year={2021}
}"""),
}


def paper_top1(arch: str) -> Optional[Tuple[str, float]]:
    """Table 1's name and CIFAR-10 top-1 for ``arch`` (its paper-size model's, for a compact twin), or ``None``."""
    return next((PAPER_TOP1[k] for k in sorted(PAPER_TOP1, key=len, reverse=True) if arch.startswith(k + '_')), None)


def _papers(cfg: Dict[str, Any]) -> List[str]:
    return [p.strip().split(':', 1)[1] for p in cfg.get('paper_ids', '').split(',') if p.strip()]


def training_command(config: Dict[str, Any], output: str) -> str:
    """The ``python -m timm_attnconv.train`` command line that reproduces a run's configuration."""
    world = config.get('world_size') or 1
    launcher = f'torchrun --nproc_per_node {world} -m' if world > 1 else 'python -m'
    parts = [f'{launcher} timm_attnconv.train', f"--model {config['model']}", f'--output {output}']
    if config['model_kwargs']:
        parts.append(f"--model-kwargs '{json.dumps(config['model_kwargs'])}'")
    for key in ('epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'warmup_epochs', 'min_lr', 'smoothing',
                'clip_grad', 'seed', 'train_limit', 'eval_limit'):
        if config.get(key) is not None:
            parts.append(f"--{key.replace('_', '-')} {config[key]}")
    if config.get('amp', 'none') != 'none':
        parts.append(f"--amp {config['amp']}")
    if config['model_ema']:
        parts += ['--model-ema', f"--model-ema-decay {config['model_ema_decay']}"]
    if config.get('init_from'):
        parts.append(f"--init-from {config['init_from']}")
    return ' \\\n    '.join(parts)


def read_log(path: os.PathLike) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_training_curves(log: List[Dict[str, Any]], path: os.PathLike, title: str) -> None:
    """Test top-1 (weights and EMA) and train / test loss per epoch, as a two-panel PNG."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    def series(key):  # epochs without a test (--eval-every, EMA tested at the end only) have no such key
        return [e['epoch'] for e in log if key in e], [e[key] for e in log if key in e]

    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    acc.plot(*series('test_top1'), 'o-', label='weights')
    if any('ema_test_top1' in e for e in log):
        acc.plot(*series('ema_test_top1'), 's--', label='EMA')
    acc.set(xlabel='epoch', ylabel='CIFAR-10 test top-1 (%)', title='accuracy')
    loss.plot(*series('train_loss'), 'o-', label='train (label-smoothed)')
    loss.plot(*series('test_loss'), 's--', label='test (cross-entropy)')
    loss.set(xlabel='epoch', ylabel='loss', title='loss')
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def warm_start_sentence(arch: str, init_from: Optional[str], init_command: str = '') -> str:
    """The model card's sentence on ``train --init-from``: what the run started from, or nothing for a run from
    scratch. The same arch continues its weights; another arch went through the model's ``init_from`` (a content
    model built from a positional one, an EA twin from its base); a weights file is the output of ``init_command``
    when one is given."""
    if not init_from:
        return ''
    if init_from.endswith('.safetensors'):
        start = f'the weights in `{os.path.basename(init_from)}`' + (
            ', which the first command under Training writes' if init_command else ' (same layout)')
    elif init_from.split('.')[0] == arch:
        start = 'those weights, trained on with a fresh optimizer and schedule'
    elif arch.startswith('ea_'):  # EASelfAttentionNet.init_from
        start = "that model's weights and freshly initialised evolution convolutions, which change its attention maps"
    else:
        start = 'that model, up to a content term initialised near zero'
    paper = (f'as the paper did: it fine-tuned {PAPER_WARM_STARTS[arch]}' if arch in PAPER_WARM_STARTS else
             'not trained from scratch as in the paper')
    return f' Warm-started from `{init_from}` (it starts as {start}), {paper}.'


def model_type(arch: str, attention: bool) -> str:
    """The card's model type: the SA models and their EA twins have no convolution but the patch embedding."""
    if arch.startswith(('sa_', 'ea_sa_')):
        return 'attention-only network'
    return 'convolutional network with attention' if attention else 'convolutional network (baseline)'


# the training options (their names after the --) that change how a run is computed or tested, not what it trains:
# left out of a recipe comparison
RECIPE_NEUTRAL = ('model', 'output', 'data-dir', 'device', 'compile', 'channels-last', 'eval-every', 'eval-ema',
                  'eval-limit', 'log-interval', 'no-resume')


def training_options(command: str) -> Dict[str, str]:
    """The options of the ``timm_attnconv.train`` command in ``command`` (a card's Reproduce block, continuation
    lines and a preceding command included), ``{'--lr': '0.1', '--model-ema': '', ...}``."""
    tokens = shlex.split(command.replace('\\\n', ' '))
    if 'timm_attnconv.train' not in tokens:
        raise ValueError(f'no `timm_attnconv.train` command in {command[:80]!r}')
    tokens = tokens[tokens.index('timm_attnconv.train') + 1:]
    options: Dict[str, str] = {}
    for i, token in enumerate(tokens):
        if token.startswith('--'):
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith('--') else ''
            options[token] = value
    return options


def recipe_differences(theirs: Dict[str, str], ours: Dict[str, str]) -> List[str]:
    """``'`--amp bf16` there, no `--amp` here'`` for each recipe option that the training commands ``theirs`` and
    ``ours`` (:func:`training_options`) set differently; ``[]`` for the same recipe."""
    def shown(options, key):
        if key not in options:
            return f'no `{key}`'
        return f'`{key} {options[key]}`' if options[key] else f'`{key}`'
    keys = [k for k in (*theirs, *[k for k in ours if k not in theirs]) if k[2:] not in RECIPE_NEUTRAL]
    return [f'{shown(theirs, k)} there, {shown(ours, k)} here' for k in keys if theirs.get(k) != ours.get(k)]


def _card_training_command(card: str) -> Optional[str]:
    # the command of a card's Reproduce block (:func:`_model_card`), None for a card without one
    reproduce = re.search(r'Reproduce.*?```bash\n(.*?)```', card, re.S)
    return reproduce and reproduce.group(1)


def _beside_folders(out_dir: os.PathLike, names: Sequence[str]) -> List[Path]:
    # the staged folders --beside names, each checked before anything is evaluated or written
    folders = [Path(out_dir) / name for name in names]
    for folder in folders:
        if not (folder / 'README.md').is_file():
            raise FileNotFoundError(f'--beside {folder.name}: no staged folder {folder} with a model card; stage '
                                    f'that run first, or name a folder in --out')
    return folders


def _beside_row(folder: Path, command: str) -> str:
    """The card's comparison row of the staged ``folder`` (``<arch>.<tag>``, written by :func:`stage`): its test
    top-1 and parameters from its own card and config, and its recipe against this run's training ``command``."""
    import timm
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / 'README.md')
    top1 = next((r.metric_value for r in card.data.eval_results or [] if r.metric_name == 'top-1 accuracy'), None)
    if top1 is None:
        raise ValueError(f'--beside {folder.name}: its model card has no top-1 accuracy in its metadata; stage its '
                         f'run again with this version')
    config = json.loads((folder / CONFIG_FILE).read_text())
    model = timm.create_model(config['architecture'], **config.get('model_args', {}))
    params = sum(p.numel() for p in model.parameters())
    reproduce = _card_training_command(card.text)
    if reproduce is None:
        recipe = 'its card shows no training command'
    else:
        differences = recipe_differences(training_options(reproduce), training_options(command))
        recipe = ('the same training recipe' if not differences else
                  'its recipe differs: ' + '; '.join(differences))
    return f'| {folder.name} (staged; {recipe}) | {top1:.2f}% | {params / 1e6:.3f}M |\n'


def _model_card(arch_tag: str, cfg: Dict[str, Any], report: Dict[str, Any], metrics: Dict[str, Any],
                run: Dict[str, Any], likeness: str = '') -> str:
    from huggingface_hub import EvalResult, ModelCardData
    from timm.models._hub import generate_readme

    arch = arch_tag.split('.')[0]
    data = ModelCardData(
        library_name='timm', license='apache-2.0', pipeline_tag='image-classification',
        tags=['image-classification', 'timm', 'timm_attnconv'], datasets=['cifar10'], model_name=arch_tag,
        eval_results=[
            EvalResult(task_type='image-classification', dataset_type='cifar10', dataset_name='CIFAR-10',
                       dataset_split='test', metric_type='accuracy', metric_name=f'top-{k} accuracy',
                       metric_value=round(metrics[f'top{k}'], 2))
            for k in (1, 5)])
    family = paper_top1(arch)
    comparison = '| model | CIFAR-10 test top-1 | params |\n|---|---|---|\n'
    comparison += f"| {arch_tag} (this file, {run['epochs_done']} epochs{run['data']} on {run['hardware']}) | " \
                  f"{metrics['top1']:.2f}% | {report['params'] / 1e6:.3f}M |\n"
    comparison += ''.join(run.get('beside', ()))
    if family:
        comparison += f'| paper, Table 1 (300 epochs): {family[0]} | {family[1]:.1f}% | — |\n'
    storage = run['storage']
    card = dict(
        description=f"A `timm_attnconv` model trained on CIFAR-10 by this project on {run['hardware']} "
                    f"({run['note']}). None of the paper's authors released usable weights."
                    + warm_start_sentence(arch, run.get('init_from'), run.get('init_command', '')),
        details={
            'Model Type': 'Image classification / ' + model_type(arch, bool(likeness)),
            'Model Stats': {
                'Params (M)': f"{report['params'] / 1e6:.3f} ({report['params']:,})",
                'GMACs': f"{report['macs'] / 1e9:.3f} (fvcore, attention matmuls included)",
                'Image size': '32 x 32'},
            'Papers': {PAPERS[p][0]: f'https://arxiv.org/abs/{p}' for p in _papers(cfg)},
            'Dataset': 'CIFAR-10',
            'Weights': f"{metrics['weights']} of the training run after {run['epochs_done']} of "
                       f"{run['epochs_planned']} epochs{run['data']}, stored as {storage['dtype']}; "
                       f"sha256 {run['sha256']}",
        },
        usage=('```python\nimport timm\nimport timm_attnconv  # registers the models\n\n'
               f"model = timm.create_model('{arch_tag}', pretrained=True).eval()\n"
               'data_config = timm.data.resolve_model_data_config(model)\n'
               'transform = timm.data.create_transform(**data_config, is_training=False)\n```\n'),
        comparison=comparison,
        citation='\n\n'.join(PAPERS[p][1] for p in _papers(cfg)),
    )
    body = generate_readme(card, arch_tag).split('---\n', 2)[2]  # timm's sections; its front matter has no metrics
    body += (f"\n## Measured\n`python -m timm_attnconv.evaluate --model {arch_tag} --pretrained`: "
             f"top-1 {metrics['top1']:.2f}%, top-5 {metrics['top5']:.2f}%, loss {metrics['loss']:.4f} "
             f"on the {metrics['images']:,} CIFAR-10 test images.\n\n{_storage_note(storage)}\n"
             f"\n## Training\n![training curves](training_curves.png)\n\n"
             f"{run['schedule']}\n\n"
             f"Reproduce ({'resumable; ' if run['resumable'] else ''}the log of this run is `training_log.jsonl`):"
             f"\n\n```bash\n{run['command']}\n```\n"
             f"\nStaged with `{run['stage_command']}`.\n")
    if likeness:
        body += ('\n## Conv-likeness of the heads\n\nPer head, the relative offset (rows, columns; key − query) that '
                 'gets the most attention and the mean attention mass on it, over the first 64 CIFAR-10 test images '
                 '(`timm_attnconv.analysis.conv_likeness_table`). Mass 1 is a head that acts as one convolution tap '
                 f'(Cordonnier et al., Lemma 1); uniform attention would give 1/256.\n\n{likeness}\n')
    return f'---\n{data.to_yaml()}\n---\n{body}'


def _storage_note(storage: Dict[str, Any]) -> str:
    """The card's sentence on the stored dtype and what rounding to it changed on the test set."""
    if not storage['rounded']:
        return 'Stored as float32, the dtype it was trained in.'
    lines = [f"Stored as {storage['dtype']} (loads cast it to the model's dtype). Measured when staging, rounding the "
             f"float32 weights changed on the {storage['images']:,} test images:"]
    lines += [f"- {r['dtype']}: top-1 {r['top1']:.2f}% (float32: {storage['float32_top1']:.2f}%), the same top-1 "
              f"prediction for {r['agreement'] * 100:.2f}% of the images"
              f"{'' if r['acceptable'] else ' (rejected: over the limits)'}" for r in storage['rounded']]
    lines.append(f'\nLimits for a half-precision copy: top-1 within {MAX_TOP1_CHANGE} points, at least '
                 f'{MIN_AGREEMENT * 100:.1f}% identical top-1 predictions.')
    return '\n'.join(lines)


def _read_run(run_dir: str) -> Dict[str, Any]:
    """A run folder as ``{'config', 'model', 'ema', 'epochs_done', 'resumable', 'log'}``: from its training
    checkpoint, or from its safetensors weights and recorded ``config.json`` when no checkpoint was kept (weights
    brought back by ``transfer``, whose manifest says how far into an epoch they were taken)."""
    from safetensors.torch import load_file
    from .runs import epochs_done, logged_epochs, read_checkpoint

    log_path = os.path.join(run_dir, LOG)
    ckpt = os.path.join(run_dir, CHECKPOINT)
    if os.path.isfile(ckpt):
        state = read_checkpoint(ckpt)  # digest-checked
        return dict(config=state['config'], model=state.get('model'), ema=state.get('ema'), resumable=True,
                    log=logged_epochs(state, log_path), epochs_done=epochs_done(state))
    log = read_log(log_path) if os.path.isfile(log_path) else []
    weights = {key: os.path.join(run_dir, name) for key, name in WEIGHTS_FILES.items()
               if os.path.isfile(os.path.join(run_dir, name))}
    config_path = os.path.join(run_dir, RUN_CONFIG)
    if not weights or not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{run_dir!r} holds no training checkpoint ({CHECKPOINT}) and no weights "
            f"({' / '.join(WEIGHTS_FILES.values())}) beside a run's {RUN_CONFIG}: pass the --output folder of "
            f'a training run')
    if not log:
        raise FileNotFoundError(f'{run_dir!r} has weights but no {LOG}: its log says how many epochs they trained')
    with open(config_path) as f:
        config = json.load(f)
    missing = [k for k in ('model', 'model_kwargs', 'epochs', 'batch_size', 'model_ema', 'lr') if k not in config]
    if missing:
        raise ValueError(f"{config_path!r} lacks {', '.join(missing)}: it is not a run config of "
                         f'python -m timm_attnconv.train')
    done = log[-1]['epoch']
    if os.path.isfile(os.path.join(run_dir, MANIFEST)):  # the checkpoint the weights came from, maybe mid-epoch
        with open(os.path.join(run_dir, MANIFEST)) as f:
            done = epochs_done(json.load(f))
    return dict(config=config, resumable=False, log=log, epochs_done=done,
                **{key: load_file(weights[key]) if key in weights else None for key in WEIGHTS_FILES})


def _choose_weights(run: Dict[str, Any], which: str, images, labels, batch_size: int = 500) -> tuple:
    """``(logits, key, model)`` of the run's ``'model'`` or ``'ema'`` weights; ``'auto'``: the higher test top-1."""
    from .evaluate import predict_logits, scores
    from .runs import load_weights
    candidates = ['model', 'ema'] if which == 'auto' else [which]
    candidates = [c for c in candidates if run.get(c) is not None]
    if not candidates:
        raise ValueError(f'the run has no {which} weights' + (
            ' (EMA weights exist only for runs started with --model-ema); use --weights model' if which == 'ema'
            else ''))
    results = []
    for key in candidates:
        model = load_weights(run, key)
        results.append((predict_logits(model, images, batch_size), key, model))
    return max(results, key=lambda r: scores(r[0], labels)['top1'])


def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose floating-point parameters and buffers are rounded to ``dtype`` and back: the model
    a file stored in ``dtype`` loads as."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for tensor in rounded.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype))
    return rounded


def choose_storage_dtype(model: torch.nn.Module, logits: torch.Tensor, images, labels,
                         dtype: str = 'auto', batch_size: int = 500) -> Tuple[Dict[str, Any], torch.Tensor]:
    """The dtype to store ``model`` in, by measurement against its float32 ``logits`` on ``images``, and the logits
    of the model as loaded from a file of that dtype.

    ``'auto'``: float16, else bfloat16, if rounding to it keeps top-1 within ``MAX_TOP1_CHANGE`` points and the same
    top-1 prediction on at least ``MIN_AGREEMENT`` of the images; else float32. A named dtype is stored as asked,
    with its measurement recorded.
    """
    from .evaluate import predict_logits, scores
    reference = scores(logits, labels)['top1']
    storage = dict(dtype='float32', float32_top1=reference, images=int(labels.shape[0]), rounded=[])
    shipped_logits = logits
    for name in (() if dtype == 'float32' else ('float16', 'bfloat16') if dtype == 'auto' else (dtype,)):
        rounded_logits = predict_logits(round_weights(model, STORAGE_DTYPES[name]), images, batch_size)
        top1 = scores(rounded_logits, labels)['top1']
        agreement = (rounded_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
        acceptable = abs(top1 - reference) <= MAX_TOP1_CHANGE and agreement >= MIN_AGREEMENT
        storage['rounded'].append(dict(dtype=name, top1=top1, agreement=agreement, acceptable=acceptable))
        if acceptable or dtype != 'auto':
            storage['dtype'], shipped_logits = name, rounded_logits
            break
    return storage, shipped_logits


def stage(run_dir: str, tag: str, weights: str = 'auto', out_dir: str = 'weights',
          data_dir: Optional[str] = None, limit: Optional[int] = None,
          record: os.PathLike = SHA256_RECORD, dtype: str = 'auto', hardware: str = '2 CPU cores',
          extra_train_args: str = '', init_command: str = '', batch_size: int = 500,
          beside: Sequence[str] = ()) -> Dict[str, Any]:
    """Write ``<out_dir>/<arch>.<tag>/`` from the run in ``run_dir`` and add its sha256 to ``record``.

    ``hardware`` names what the run trained on, for the card; ``extra_train_args`` are training options the run used
    that its recorded config does not hold (e.g. ``--amp bf16 --clip-grad 1.0 --device cuda``), so that the card's
    command is the one that ran; ``init_command`` is the command that wrote the run's ``--init-from`` weights file
    (e.g. ``python training/gpu/prune.py ...``), which the card shows before the training command. ``batch_size``:
    images per forward pass of the evaluations. ``beside``: staged ``<arch>.<tag>`` folders in ``out_dir`` that the
    card's comparison lists (:func:`_beside_row`).
    """
    from timm.models import save_for_hf
    from .analysis import conv_likeness_table, has_attention
    from .data import load_cifar10, normalize
    from .evaluate import scores
    from .flops import model_report

    if dtype not in ('auto', *STORAGE_DTYPES):
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
    run = _read_run(run_dir)
    config, log = run['config'], run['log']
    beside_folders = _beside_folders(out_dir, beside)  # before the evaluations: a wrong name fails at once
    if init_command and not (config.get('init_from') or '').endswith('.safetensors'):
        raise ValueError(f"--init-command names the command that wrote the run's --init-from weights file, but "
                         f"{run_dir!r} started from {config.get('init_from')!r}: drop --init-command")
    arch_tag = f"{config['model']}.{tag}"
    images, labels = load_cifar10(data_dir, 'test')
    if limit:
        images, labels = images[:limit], labels[:limit]
    logits, key, model = _choose_weights(run, weights, images, labels, batch_size)
    storage, shipped_logits = choose_storage_dtype(model, logits, images, labels, dtype, batch_size)
    # the card states what `evaluate --pretrained` measures: the weights as stored
    metrics = dict(scores(shipped_logits, labels), weights='EMA weights' if key == 'ema' else 'weights')
    stored_dtype = STORAGE_DTYPES[storage['dtype']]

    model.pretrained_cfg = _pretrained_cfg(model, config['model'], tag)  # what config.json and the card carry
    folder = Path(out_dir) / arch_tag
    with tempfile.TemporaryDirectory(dir=out_dir if os.path.isdir(out_dir) else None) as tmp:
        save_for_hf(copy.deepcopy(model).to(stored_dtype), tmp, safe_serialization=True,
                    model_config=_hub_model_config(storage['dtype']),
                    model_args=dict(config['model_kwargs'], num_classes=model.num_classes))
        digest = sha256_file(Path(tmp) / WEIGHTS_FILE)
        if log:
            shutil.copy(os.path.join(run_dir, LOG), Path(tmp) / 'training_log.jsonl')
            plot_training_curves(log, Path(tmp) / 'training_curves.png', f'{arch_tag}: CIFAR-10, {hardware}')
        subset = config.get('train_limit')
        finished = run['epochs_done'] >= config['epochs']
        # a run without its checkpoint cannot be resumed: the command writes a new run folder, named after the
        # weights it makes so that it is never the folder of another run of the model (the trainer refuses those)
        output = run_dir if run['resumable'] else f'training/{arch_tag}'
        command = training_command(config, output) + (f' \\\n    {extra_train_args}' if extra_train_args else '')
        if init_command:
            command = f'{init_command}\n{command}'
        card_run = dict(
            epochs_done=f"{run['epochs_done']:.4g}", epochs_planned=config['epochs'], sha256=digest,
            data=f' over the first {subset:,} training images' if subset else '', hardware=hardware,
            command=command, init_from=config.get('init_from'), init_command=init_command, storage=storage,
            resumable=run['resumable'],
            note='finished run' if finished else (
                f"a snapshot of a run in progress, after {run['epochs_done']:.4g} of {config['epochs']} epochs"
                if run['resumable'] else
                f"stopped after {run['epochs_done']:.4g} of {config['epochs']} epochs; not resumable"),
            schedule=_schedule_note(config, log, run['epochs_done']),
            beside=[_beside_row(folder, command) for folder in beside_folders],
            stage_command=_stage_command(run_dir, tag, hardware, extra_train_args, init_command, weights, dtype,
                                          limit, batch_size, beside))
        shipped = round_weights(model, stored_dtype)  # the model as `pretrained=True` loads the stored file
        likeness = conv_likeness_table(shipped, normalize(images[:64], model.pretrained_cfg['mean'],
                                                          model.pretrained_cfg['std'])) if has_attention(model) else ''
        (Path(tmp) / 'README.md').write_text(
            _model_card(arch_tag, model.pretrained_cfg, model_report(config['model'], **config['model_kwargs']),
                        metrics, card_run, likeness))
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, folder)
    folder.chmod(0o755)  # the temporary folder and safetensors' file are private to the user
    for path in folder.iterdir():
        path.chmod(0o644)
    record_folder(folder, record)
    return dict(arch_tag=arch_tag, folder=str(folder), sha256=digest, stored_dtype=storage['dtype'],
                storage=storage, **metrics)


def refresh_config(folder: os.PathLike, record: os.PathLike = SHA256_RECORD) -> bool:
    """Rewrite ``config.json`` of the staged ``folder`` (``<arch>.<tag>``) from the cfg ``default_cfgs`` registers for
    it, and its sha256 in ``record``; the weights, card and log stay. For a tag staged before it was registered, whose
    ``config.json`` carries the arch's default cfg (its notes, for one): a ``hf-hub:`` load reads that file. Returns
    whether the file changed."""
    import timm
    from timm.models import save_for_hf

    folder = Path(folder)
    arch, _, tag = folder.name.partition('.')
    registered = _registered_cfg(folder.name) if tag else None
    if registered is None:
        raise ValueError(f'{folder.name} is not registered in default_cfgs: register it there first (notes, '
                         f"hf_hub_id=hub_id('{folder.name}')), then refresh its config")
    path = folder / CONFIG_FILE
    written = json.loads(path.read_text())
    model_args = written.get('model_args', {})
    model = timm.create_model(arch, pretrained=False, **model_args)
    model.pretrained_cfg = registered.to_dict()
    with tempfile.TemporaryDirectory() as tmp:  # stage's own writer; only its config.json is kept
        save_for_hf(model, tmp, safe_serialization=True, model_args=model_args,
                    model_config=_hub_model_config(written.get('weights_dtype', 'float32')))
        shutil.copyfile(Path(tmp) / CONFIG_FILE, path)
    record_folder(folder, record)
    return json.loads(path.read_text()) != written


def add_beside(folder: os.PathLike, names: Sequence[str], record: os.PathLike = SHA256_RECORD) -> List[str]:
    """Add the staged folders ``names`` (``<arch>.<tag>`` beside ``folder``) to the comparison of ``folder``'s card
    and rewrite its rows and its stage command, as staging its run again with them added to ``--beside`` would, but
    without the run or a new evaluation: the card's own training command and the folders' cards give the rows. Its
    sha256 goes to ``record``. Returns the card's ``--beside`` list as now written."""
    folder = Path(folder)
    card_path = folder / 'README.md'
    if not card_path.is_file():
        raise FileNotFoundError(f'--add-beside {folder}: no model card there; name a folder that stage wrote')
    card = card_path.read_text()
    staged_with = re.search(r'^Staged with `(python -m timm_attnconv\.stage .*)`\.$', card, re.M)
    reproduce = _card_training_command(card)
    if staged_with is None or reproduce is None:
        raise ValueError(f'--add-beside {folder}: its card shows no stage or training command; stage its run again '
                         f'with --beside')
    args = _parser().parse_args(shlex.split(staged_with.group(1))[3:])
    beside = [*args.beside, *[name for name in dict.fromkeys(names) if name not in args.beside]]
    if folder.name in beside:
        raise ValueError(f'--beside {folder.name}: a card does not list itself beside itself')
    # every row anew: a folder restaged since shows its top-1 as now staged
    rows = [_beside_row(path, reproduce) for path in _beside_folders(folder.parent, beside)]
    lines = card.splitlines(keepends=True)
    own = next(i for i, line in enumerate(lines) if line.startswith(f'| {folder.name} (this file'))
    end = own + 1
    while lines[end].startswith('| ') and not lines[end].startswith('| paper, '):  # the rows of --beside
        end += 1
    command = _stage_command(args.run, args.tag, args.hardware, args.extra_train_args, args.init_command,
                             args.weights, args.dtype, args.limit, args.batch_size, beside)
    card = ''.join(lines[:own + 1] + rows + lines[end:]).replace(staged_with.group(0), f'Staged with `{command}`.')
    card_path.write_text(card)
    record_folder(folder, record)
    return beside


def _hub_model_config(weights_dtype: str) -> Dict[str, Any]:
    # what config.json holds beside timm's own fields: the class names and the stored dtype
    return dict(label_names=list(CIFAR10_CLASSES), weights_dtype=weights_dtype)


def _registered_cfg(arch_tag: str):
    """The ``PretrainedCfg`` ``default_cfgs`` registers for ``arch_tag``, or None."""
    from timm.models import get_pretrained_cfg
    try:
        return get_pretrained_cfg(arch_tag)
    except RuntimeError:  # the arch has cfgs, not this tag
        return None


def _pretrained_cfg(model: torch.nn.Module, arch: str, tag: str) -> Dict[str, Any]:
    """The pretrained cfg of ``arch.tag`` as registered in ``default_cfgs``; for a tag not registered yet, the arch's
    default cfg under the new tag (so that the folder's ``config.json`` names its own tag) without the default tag's
    notes, which describe other weights, and a note to register it."""
    arch_tag = f'{arch}.{tag}'
    cfg = _registered_cfg(arch_tag)
    if cfg is None:
        print(f'note: {arch_tag} is not in default_cfgs yet: register it there (with hf_hub_id) so that '
              f"timm.create_model('{arch_tag}', pretrained=True) finds the folder, then refresh its config.json: "
              f'python -m timm_attnconv.stage --refresh-config <folder>')
        return {key: value for key, value in dict(model.pretrained_cfg, tag=tag).items() if key != 'notes'}
    return cfg.to_dict()


def _schedule_note(config: Dict[str, Any], log: List[Dict[str, Any]], epochs_done: float) -> str:
    if not log:
        return f"{epochs_done:.4g} of {config['epochs']} scheduled epochs."
    last = log[-1]
    return (f"{epochs_done:.4g} of {config['epochs']} scheduled epochs; at the last logged epoch ({last['epoch']}) the "
            f"learning rate was {last['lr']:.3g}, {100 * last['lr'] / config['lr']:.1f}% of its peak {config['lr']:g}.")


def _stage_command(run_dir: str, tag: str, hardware: str, extra_train_args: str, init_command: str, weights: str,
                   dtype: str, limit: Optional[int], batch_size: int, beside: Sequence[str] = ()) -> str:
    """The card's ``stage`` command: every option that changes what is shipped or how long staging takes."""
    parts = ['python -m timm_attnconv.stage', run_dir, f'--tag {tag}']
    parts += [f'--{name} {value}' for name, value, default in (
        ('weights', weights, 'auto'), ('dtype', dtype, 'auto'), ('limit', limit, None),
        ('batch-size', batch_size, 500)) if value != default]
    if hardware != '2 CPU cores':
        parts.append(f"--hardware '{hardware}'")
    if extra_train_args:
        parts.append(f"--extra-train-args '{extra_train_args}'")
    if init_command:
        parts.append(f"--init-command '{init_command}'")
    if beside:
        parts.append('--beside ' + ' '.join(beside))
    return ' '.join(parts)


def _tag(text: str) -> str:
    # the tag ends a folder name and a timm model name (<arch>.<tag>): no dots, slashes or spaces
    if not re.fullmatch(r'[A-Za-z0-9_-]+', text):
        raise argparse.ArgumentTypeError(f'expected letters, digits, _ or -, as in c10 or c10_2ep, got {text!r}')
    return text


def _parser() -> argparse.ArgumentParser:
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('run', nargs='?', help='output folder of `python -m timm_attnconv.train` (last.pth.tar, or '
                                               'model.safetensors / ema.safetensors with config.json; log.jsonl)')
    parser.add_argument('--tag', type=_tag, help='pretrained tag, e.g. c10 → weights/<arch>.c10/ (with a run)')
    parser.add_argument('--refresh-config', nargs='+', metavar='FOLDER', default=None,
                        help='instead: rewrite config.json of staged folders from the cfgs default_cfgs registers for '
                             'them (a tag staged before it was registered carries its arch\'s default cfg there)')
    parser.add_argument('--add-beside', metavar='FOLDER', default=None,
                        help="instead: add the folders of --beside to the comparison of this staged folder's card")
    parser.add_argument('--weights', choices=('auto', 'model', 'ema'), default='auto',
                        help='which weights to ship; auto: the better of the two on the test set')
    parser.add_argument('--dtype', choices=('auto', *STORAGE_DTYPES), default='auto',
                        help='stored dtype; auto: half precision where it measurably changes nothing (see above)')
    parser.add_argument('--hardware', default='2 CPU cores', help='what the run trained on, for the model card')
    parser.add_argument('--extra-train-args', default='',
                        help="training options the run used that its config does not record, for the card's command")
    parser.add_argument('--init-command', default='',
                        help="the command that wrote the run's --init-from weights file, for the card (e.g. "
                             "'python training/gpu/prune.py sa_quadratic_gen_cifar.c10 DIR --half')")
    parser.add_argument('--out', default='weights', help='folder of Hub-layout weight folders')
    parser.add_argument('--beside', nargs='+', default=(), metavar='ARCH.TAG',
                        help="staged folders in --out that the card's comparison lists with their test top-1, "
                             "parameters and the options in which their training commands differ from this run's "
                             "(e.g. an EA twin's base: aa_resnet20_cifar.c10)")
    cli.add_data_dir_arg(parser)
    parser.add_argument('--limit', type=cli.positive_int, default=None, help='evaluate on the first N test images only')
    parser.add_argument('--record', default=str(SHA256_RECORD), help='JSON file of sha256 records to update')
    parser.add_argument('--batch-size', type=cli.positive_int, default=500,
                        help='images per forward pass when evaluating (on 2 CPU cores sa_learned_content_cifar ran '
                             'at 3.8 img/s in batches of 50, 2.0 in batches of 200)')
    return parser


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.refresh_config:
        if args.run or args.tag:
            parser.error('--refresh-config takes staged folders, not a run or --tag')
        changed = {folder: refresh_config(folder, args.record) for folder in args.refresh_config}
        print(json.dumps(dict(changed=changed), indent=2))
        return changed
    if args.add_beside:
        if args.run or args.tag or not args.beside:
            parser.error('--add-beside takes a staged folder and the folders to add with --beside, not a run or --tag')
        result = dict(folder=args.add_beside, beside=add_beside(args.add_beside, args.beside, args.record))
        print(json.dumps(result, indent=2))
        return result
    if not args.run or not args.tag:
        parser.error('stage a run: python -m timm_attnconv.stage RUN --tag TAG')
    result = stage(args.run, args.tag, args.weights, args.out, args.data_dir, args.limit, args.record, args.dtype,
                   args.hardware, args.extra_train_args, args.init_command, args.batch_size, args.beside)
    print(json.dumps(result, indent=2))
    return result


if __name__ == '__main__':
    cli.keep_freed_memory()  # this process is the command's: see there
    cli.run(main)
