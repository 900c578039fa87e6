"""Figures like the Cordonnier et al. (2020) paper's, for any model of the zoo, as PNG files.

    python -m timm_attnconv.viz centers --model sa_quadratic_tiny_cifar --pretrained --out centers.png
    python -m timm_attnconv.viz attention --model sa_quadratic_tiny_cifar --pretrained \\
        --image timm_attnconv/samples/00000_cat.png --query 16 16 --out attention.png
    python -m timm_attnconv.viz attention --model aa_resnet20_cifar --average 64 --query 8 8 --out mean.png
    python -m timm_attnconv.viz centers --model sa_quadratic_tiny_cifar --checkpoints run/a.pth.tar run/b.pth.tar ...

``centers``: each quadratic head's Gaussian centre (relative to the query pixel at the origin) with its 50% and 90%
attention-mass contours, one panel per layer (paper figs. 3, 4, 12, 14; ellipses for the generalized encoding);
with ``--checkpoints``, one row per checkpoint (the training-time view of fig. 4). ``attention``: every head's
attention probabilities for one query pixel, one row per layer (figs. 5–10), for one image or averaged over the first
N CIFAR-10 test images.
"""
import argparse
import json
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import cli
from .analysis import attention_maps, square_grid
from .layers import PositionalSelfAttention, QuadraticScores

__all__ = ['plot_centers', 'plot_attention', 'main']


def _pyplot():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def _quadratic_layers(model: nn.Module) -> List[QuadraticScores]:
    layers = [m.pos for m in model.modules() if isinstance(m, PositionalSelfAttention)
              and isinstance(m.pos, QuadraticScores)]
    if not layers:
        raise ValueError(f'{type(model).__name__} has no quadratic-encoding attention heads: centre plots need '
                         f'sa_quadratic* models (use the "attention" figure for the others)')
    return layers


def _mass_ellipse(scores: QuadraticScores, head: int, mass: float) -> Tuple[float, float, float]:
    """(width, height, angle°) of the ellipse holding ``mass`` of head ``head``'s attention (x: columns, y: rows)."""
    covariance = torch.linalg.inv(scores.inverse_covariance()[head].detach().double())
    eigvals, eigvecs = torch.linalg.eigh(covariance)  # in (row, col) coordinates
    radius = math.sqrt(-2. * math.log(1. - mass))  # Mahalanobis radius of a 2-D Gaussian's mass
    widths = 2 * radius * eigvals.clamp_min(0).sqrt()
    row, col = eigvecs[:, 1].tolist()  # direction of the largest axis
    return float(widths[1]), float(widths[0]), math.degrees(math.atan2(row, col))


def plot_centers(models: Sequence[nn.Module], path: str, titles: Optional[Sequence[str]] = None,
                 extent: float = 8.) -> int:
    """One row per model, one panel per layer; returns the number of panels drawn."""
    from matplotlib.patches import Ellipse
    plt = _pyplot()
    rows = [_quadratic_layers(m) for m in models]
    cols = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), cols, figsize=(2.4 * cols, 2.5 * len(rows)), squeeze=False)
    colors = plt.get_cmap('tab10')
    for r, layers in enumerate(rows):
        for c, scores in enumerate(layers):
            ax = axes[r][c]
            centers = scores.centers.detach().cpu()
            for h in range(scores.num_heads):
                for mass, alpha in ((0.5, 0.5), (0.9, 0.2)):
                    width, height, angle = _mass_ellipse(scores, h, mass)
                    ax.add_patch(Ellipse((float(centers[h, 1]), float(centers[h, 0])), width, height, angle=angle,
                                         color=colors(h % 10), alpha=alpha, lw=0))
                ax.plot(float(centers[h, 1]), float(centers[h, 0]), '.', color=colors(h % 10), ms=4)
            ax.plot(0, 0, 'k+', ms=8)  # the query pixel
            ax.set(xlim=(-extent, extent), ylim=(extent, -extent), aspect='equal',
                   title=(f'{titles[r]}: ' if titles and c == 0 else '') + f'layer {c + 1}')
            ax.set_xlabel('column offset (tokens)', fontsize=7)
            ax.set_ylabel('row offset (tokens)', fontsize=7)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
        for c in range(len(layers), cols):
            axes[r][c].axis('off')
    fig.suptitle('Quadratic heads: centres and 50% / 90% attention mass (query pixel at +)')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return sum(len(r) for r in rows)


def _spatial(probs: torch.Tensor, query_fraction: Tuple[float, float],
             model: nn.Module) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """(heads, h, w) attention of the query token nearest to ``query_fraction`` of the image, prefix tokens dropped."""
    prefix, side = square_grid(model, probs.shape[-1])  # a class token (ViT) is not on the grid
    grid = probs[..., prefix:, prefix:]
    qi = min(int(query_fraction[0] * side), side - 1)
    qj = min(int(query_fraction[1] * side), side - 1)
    return grid[:, qi * side + qj].reshape(-1, side, side), (qi, qj)


def plot_attention(model: nn.Module, images: torch.Tensor, query: Tuple[int, int], path: str,
                   title: str = '') -> int:
    """Attention of every head of every layer for the query pixel ``query`` (row, col in input pixels), averaged
    over ``images`` (uint8 or float NCHW, normalised with the model's cfg). Returns the number of panels drawn."""
    from .data import normalize
    plt = _pyplot()
    cfg = model.pretrained_cfg
    x = normalize(images, cfg['mean'], cfg['std']) if images.dtype == torch.uint8 else images
    maps = attention_maps(model, x)
    fraction = (query[0] / x.shape[-2], query[1] / x.shape[-1])
    heads = max(p.shape[1] for p in maps.values())
    fig, axes = plt.subplots(len(maps), heads + 1, figsize=(1.3 * (heads + 1), 1.4 * len(maps)), squeeze=False)
    shown = images[0].permute(1, 2, 0).float()
    shown = (shown - shown.min()) / (shown.max() - shown.min() + 1e-12)
    panels = 0
    for r, (name, probs) in enumerate(maps.items()):
        per_head, (qi, qj) = _spatial(probs.mean(0), fraction, model)
        axes[r][0].imshow(shown.numpy())
        axes[r][0].plot(query[1], query[0], 'r+', ms=8)
        axes[r][0].set_title(name, fontsize=6)
        for h in range(heads):
            ax = axes[r][h + 1]
            if h < per_head.shape[0]:
                ax.imshow(per_head[h].numpy(), cmap='viridis')
                ax.plot(qj, qi, 'r+', ms=5)
                ax.set_title(f'head {h + 1}', fontsize=6)
                panels += 1
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    n = images.shape[0]
    fig.suptitle(f'{title} attention of query pixel {tuple(query)} ' + (f'(mean of {n} images)' if n > 1 else ''),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return panels


def _training_snapshots(paths: Sequence[str], model_name: Optional[str] = None,
                        ema: bool = False) -> Tuple[List[nn.Module], List[str]]:
    """Models and row titles (``epoch 7 + 47 steps``) of training checkpoints, their EMA weights with ``ema``;
    ``'init'`` rebuilds the run's start. ``model_name``: the architecture the caller expects; a checkpoint of another
    one is refused."""
    from .runs import architecture_mismatch, load_weights, read_checkpoint
    from .train_config import START_KEYS, initial_model
    states = {p: read_checkpoint(p) for p in paths if p != 'init'}
    if not states:
        raise ValueError('"init" needs at least one checkpoint of the run (its seed and model settings)')
    for path, state in states.items():
        mismatch = architecture_mismatch(path, state['config']['model'], model_name)
        if mismatch:
            raise cli.UsageError(mismatch)
    starts = {json.dumps({k: s['config'].get(k) for k in START_KEYS}, sort_keys=True) for s in states.values()}
    if 'init' in paths and len(starts) > 1:
        raise ValueError('"init" is ambiguous: the checkpoints come from runs that start differently (another model, '
                         'model kwargs, seed or --init-from); pass checkpoints of one run')
    models, titles = [], []
    for path in paths:
        if path == 'init':
            models.append(initial_model(next(iter(states.values()))['config']).eval())
            titles.append('initialisation')
            continue
        state = states[path]
        models.append(load_weights(state, 'ema' if ema else 'model'))
        steps = state['step_in_epoch']
        titles.append(f"epoch {state['epoch']}" + (f' + {steps} steps' if steps else '') + (', EMA' if ema else ''))
    return models, titles


def _images(args: argparse.Namespace, model: nn.Module) -> torch.Tensor:
    """uint8 ``(N, 3, H, W)``: ``--image`` at the model's input size, else the first ``--average`` test images."""
    from .data import load_cifar10
    if args.image is None:
        return load_cifar10(args.data_dir, 'test')[0][:args.average or 1]
    import numpy as np
    from .predict import read_image
    size = model.pretrained_cfg['input_size'][1:]
    image = read_image(args.image).resize((size[1], size[0]))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]


def _check_query(query: Tuple[int, int], images: torch.Tensor) -> None:
    height, width = images.shape[-2:]
    if query[0] >= height or query[1] >= width:
        raise cli.UsageError(f'--query {query[0]} {query[1]} is outside the {height}×{width} input: pass ROW in '
                             f'0..{height - 1} and COL in 0..{width - 1}')


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('figure', choices=('centers', 'attention'))
    cli.add_model_args(parser)
    parser.add_argument('--checkpoints', nargs='+', default=None,
                        help='training checkpoints (last.pth.tar) of --model to compare, one row each (centers); '
                             '"init" is the initialisation of the run of the other checkpoints')
    picture = parser.add_mutually_exclusive_group()
    picture.add_argument('--image', default=None, help='an image file (attention); default: the first test image')
    picture.add_argument('--average', type=cli.positive_int, default=None,
                         help='average over the first N CIFAR-10 test images (attention)')
    cli.add_data_dir_arg(parser)
    parser.add_argument('--query', type=cli.non_negative_int, nargs=2, default=(16, 16), metavar=('ROW', 'COL'),
                        help='query pixel (attention), inside the input image')
    parser.add_argument('--out', required=True, help='PNG file to write')
    args = parser.parse_args(argv)

    if args.checkpoints is not None:
        if args.figure != 'centers' or args.pretrained or args.checkpoint or args.model_kwargs:
            raise cli.UsageError('--checkpoints draws the centers of a run\'s checkpoints, which record their model: '
                                 'use it with the centers figure and without --pretrained / --checkpoint / '
                                 '--model-kwargs')
        models, titles = _training_snapshots(args.checkpoints, args.model, ema=args.ema)
        return plot_centers(models, args.out, titles=titles)
    model = cli.load_model(args).eval()
    if args.figure == 'centers':
        return plot_centers([model], args.out)
    images = _images(args, model)
    _check_query(tuple(args.query), images)
    return plot_attention(model, images, tuple(args.query), args.out, args.model)


if __name__ == '__main__':
    cli.run(main)
