"""Stage a training run as a Hub model repo in ``weights/<arch>.<tag>/`` and record its sha256.

    python -m timm_attnconv.stage training/sa_quadratic_tiny_cifar --tag c10

Evaluates the run's weights (and its EMA, with ``--weights auto`` the better of the two on the test set) on the 10,000
CIFAR-10 test images, then writes with timm's ``save_for_hf``: ``config.json`` and ``model.safetensors``; and beside
them a model card ``README.md`` with Hugging Face metadata and the measured metrics, ``training_log.jsonl`` and
``training_curves.png``. The file's sha256 goes to ``timm_attnconv/weights_sha256.json``, which every load checks.
"""
import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .pretrained import SHA256_RECORD, WEIGHTS_FILE, hub_id, recorded_sha256, sha256_file

__all__ = ['stage', 'training_command', 'plot_training_curves', 'main']

CHECKPOINT = 'last.pth.tar'
LOG = 'log.jsonl'
# Cordonnier et al. 2020, Table 1: CIFAR-10 test accuracy of the paper-size models (300 epochs, SGD, on GPUs)
PAPER_TOP1 = {
    'sa_quadratic': ('SA quadratic emb. (12.1M params)', 93.8),
    'sa_learned': ('SA learned emb. (12.3M params)', 91.8),
    'sa_learned_content': ('SA learned emb. + content-based att. (29.5M params)', 87.1),
}
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


def _papers(cfg: Dict[str, Any]) -> List[str]:
    return [p.strip().split(':', 1)[1] for p in cfg.get('paper_ids', '').split(',') if p.strip()]


def training_command(config: Dict[str, Any], output: str) -> str:
    """The ``python -m timm_attnconv.train`` command line that reproduces a run's configuration."""
    parts = ['python -m timm_attnconv.train', f"--model {config['model']}", f'--output {output}']
    if config['model_kwargs']:
        parts.append(f"--model-kwargs '{json.dumps(config['model_kwargs'])}'")
    for key in ('epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'warmup_epochs', 'min_lr', 'smoothing',
                'seed', 'train_limit'):
        if config.get(key) is not None:
            parts.append(f"--{key.replace('_', '-')} {config[key]}")
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

    epochs = [e['epoch'] for e in log]
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    acc.plot(epochs, [e['test_top1'] for e in log], 'o-', label='weights')
    if all('ema_test_top1' in e for e in log):
        acc.plot(epochs, [e['ema_test_top1'] for e in log], 's--', label='EMA')
    acc.set(xlabel='epoch', ylabel='CIFAR-10 test top-1 (%)', title='accuracy')
    loss.plot(epochs, [e['train_loss'] for e in log], 'o-', label='train (label-smoothed)')
    loss.plot(epochs, [e['test_loss'] for e in log], 's--', label='test (cross-entropy)')
    loss.set(xlabel='epoch', ylabel='loss', title='loss')
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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
    family = next((PAPER_TOP1[k] for k in sorted(PAPER_TOP1, key=len, reverse=True) if arch.startswith(k)), None)
    comparison = '| model | CIFAR-10 test top-1 | params |\n|---|---|---|\n'
    comparison += f"| {arch_tag} (this file, {run['epochs_done']} epochs{run['data']} on 2 CPU cores) | " \
                  f"{metrics['top1']:.2f}% | {report['params'] / 1e6:.3f}M |\n"
    if family:
        comparison += f'| paper, Table 1: {family[0]} | {family[1]:.1f}% | — |\n'
    card = dict(
        description=f"A `timm_attnconv` model trained on CIFAR-10 by this project on CPU ({run['note']}). "
                    f"None of the paper's authors released usable weights." + (
                        f" Warm-started from `{run['init_from']}` (it starts as that model, up to a content term "
                        f"initialised near zero), not trained from scratch as in the paper."
                        if run.get('init_from') else ''),
        details={
            'Model Type': 'Image classification / ' + (
                'attention-only network' if arch.startswith('sa_') else
                'convolutional network with attention' if likeness else 'convolutional network (baseline)'),
            'Model Stats': {
                'Params (M)': f"{report['params'] / 1e6:.3f} ({report['params']:,})",
                'GMACs': f"{report['macs'] / 1e9:.3f} (fvcore, attention matmuls included)",
                'Image size': '32 x 32'},
            'Papers': {PAPERS[p][0]: f'https://arxiv.org/abs/{p}' for p in _papers(cfg)},
            'Dataset': 'CIFAR-10',
            'Weights': f"{metrics['weights']} of the training run after {run['epochs_done']} of "
                       f"{run['epochs_planned']} epochs{run['data']}; sha256 {run['sha256']}",
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
             f"on the {metrics['images']:,} CIFAR-10 test images.\n"
             f"\n## Training\n![training curves](training_curves.png)\n\n"
             f"Reproduce (resumable; the log of this run is `training_log.jsonl`):\n\n```bash\n{run['command']}\n```\n"
             f"\nStaged with `python -m timm_attnconv.stage {run['folder']} --tag {arch_tag.split('.', 1)[1]}`.\n")
    if likeness:
        body += ('\n## Conv-likeness of the heads\n\nPer head, the relative offset (rows, columns; key − query) that '
                 'gets the most attention and the mean attention mass on it, over the first 64 CIFAR-10 test images '
                 '(`timm_attnconv.analysis.conv_likeness_table`). Mass 1 is a head that acts as one convolution tap '
                 f'(Cordonnier et al., Lemma 1); uniform attention would give 1/256.\n\n{likeness}\n')
    return f'---\n{data.to_yaml()}\n---\n{body}'


def _choose_weights(state: Dict[str, Any], which: str, images, labels) -> tuple:
    from .evaluate import evaluate
    from .train import load_weights
    candidates = ['model', 'ema'] if which == 'auto' else [which]
    if state.get('ema') is None:
        candidates = [c for c in candidates if c != 'ema']
        if not candidates:
            raise ValueError('the run has no EMA weights (it was not started with --model-ema); use --weights model')
    results = []
    for key in candidates:
        model = load_weights(state, key)
        results.append((evaluate(model, images, labels), key, model))
    return max(results, key=lambda r: r[0]['top1'])


def stage(run_dir: str, tag: str, weights: str = 'auto', out_dir: str = 'weights',
          data_dir: Optional[str] = None, limit: Optional[int] = None,
          record: os.PathLike = SHA256_RECORD) -> Dict[str, Any]:
    """Write ``<out_dir>/<arch>.<tag>/`` from the run in ``run_dir`` and add its sha256 to ``record``."""
    from timm.models import save_for_hf
    from .analysis import conv_likeness_table, has_attention
    from .data import CIFAR10_CLASSES, load_cifar10, normalize
    from .flops import model_report

    ckpt = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isfile(ckpt):
        raise FileNotFoundError(f'no training checkpoint {ckpt!r}: pass the --output folder of a training run')
    state = torch.load(ckpt, map_location='cpu', weights_only=True)
    config = state['config']
    arch_tag = f"{config['model']}.{tag}"
    images, labels = load_cifar10(data_dir, 'test')
    if limit:
        images, labels = images[:limit], labels[:limit]
    metrics, key, model = _choose_weights(state, weights, images, labels)
    metrics['weights'] = 'EMA weights' if key == 'ema' else 'weights'
    log = read_log(os.path.join(run_dir, LOG)) if os.path.isfile(os.path.join(run_dir, LOG)) else []
    steps_per_epoch = (config.get('train_limit') or 50_000) // config['batch_size']  # EpochBatches drops the last
    epochs_done = state['epoch'] + state['step_in_epoch'] / max(1, steps_per_epoch)

    folder = Path(out_dir) / arch_tag
    with tempfile.TemporaryDirectory(dir=out_dir if os.path.isdir(out_dir) else None) as tmp:
        save_for_hf(model, tmp, model_config=dict(label_names=list(CIFAR10_CLASSES)), safe_serialization=True)
        digest = sha256_file(Path(tmp) / WEIGHTS_FILE)
        if log:
            shutil.copy(os.path.join(run_dir, LOG), Path(tmp) / 'training_log.jsonl')
            plot_training_curves(log, Path(tmp) / 'training_curves.png', f'{arch_tag}: CIFAR-10, 2 CPU cores')
        subset = config.get('train_limit')
        run = dict(epochs_done=f'{epochs_done:.4g}', epochs_planned=config['epochs'], sha256=digest, folder=run_dir,
                   data=f' over the first {subset:,} training images' if subset else '',
                   command=training_command(config, run_dir), init_from=config.get('init_from'),
                   note='training in progress' if state['epoch'] < config['epochs'] else 'finished run')
        likeness = conv_likeness_table(model, normalize(images[:64], model.pretrained_cfg['mean'],
                                                        model.pretrained_cfg['std'])) if has_attention(model) else ''
        (Path(tmp) / 'README.md').write_text(
            _model_card(arch_tag, model.pretrained_cfg, model_report(config['model'], **config['model_kwargs']),
                        metrics, run, likeness))
        if folder.exists():
            shutil.rmtree(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, folder)
    folder.chmod(0o755)  # the temporary folder and safetensors' file are private to the user
    for path in folder.iterdir():
        path.chmod(0o644)
    digests = dict(recorded_sha256(record), **{hub_id(arch_tag): digest})
    Path(record).write_text(json.dumps(dict(sorted(digests.items())), indent=2) + '\n')
    return dict(arch_tag=arch_tag, folder=str(folder), sha256=digest, **metrics)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('run', help='output folder of `python -m timm_attnconv.train` (last.pth.tar, log.jsonl)')
    parser.add_argument('--tag', required=True, help='pretrained tag, e.g. c10 → weights/<arch>.c10/')
    parser.add_argument('--weights', choices=('auto', 'model', 'ema'), default='auto',
                        help='which weights to ship; auto: the better of the two on the test set')
    parser.add_argument('--out', default='weights', help='folder of Hub-layout weight folders')
    parser.add_argument('--data-dir', default=None, help='folder with test.npz or cifar-10-batches-py')
    parser.add_argument('--limit', type=int, default=None, help='evaluate on the first N test images only')
    parser.add_argument('--record', default=str(SHA256_RECORD), help='JSON file of sha256 records to update')
    args = parser.parse_args(argv)
    result = stage(args.run, args.tag, args.weights, args.out, args.data_dir, args.limit, args.record)
    print(json.dumps(result, indent=2))
    return result


if __name__ == '__main__':
    main()
