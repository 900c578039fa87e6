"""Top-1 / top-5 accuracy and loss on the CIFAR-10 test set.

    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --checkpoint runs/x/last.pth.tar
    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --pretrained --json result.json
"""
import argparse
import json
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from .data import load_cifar10, normalize
from .runs import load_training_checkpoint

__all__ = ['evaluate', 'predict_logits', 'scores', 'main']


@torch.no_grad()
def predict_logits(
        model: nn.Module,
        images: torch.Tensor,
        batch_size: int = 500,
        amp_dtype: Optional[torch.dtype] = None,
        progress: bool = True,
) -> torch.Tensor:
    """fp32 logits ``(N, classes)`` of ``model`` on uint8 ``images``, normalised with the model's pretrained cfg mean /
    std, in eval mode (the model's mode is restored afterwards)."""
    cfg = model.pretrained_cfg
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    logits = []
    for start in tqdm(range(0, images.shape[0], batch_size), desc='eval', unit='batch', disable=not progress,
                      leave=False):
        x = normalize(images[start:start + batch_size].to(device), cfg['mean'], cfg['std'])
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits.append(model(x).float().cpu())
    model.train(was_training)
    return torch.cat(logits)


def scores(logits: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy of ``logits`` against ``labels``."""
    top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
    n = labels.shape[0]
    return dict(top1=100. * (top5[:, 0] == labels).sum().item() / n,
                top5=100. * (top5 == labels[:, None]).any(dim=1).sum().item() / n,
                loss=F.cross_entropy(logits, labels).item(), images=n)


def evaluate(
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int = 500,
        amp_dtype: Optional[torch.dtype] = None,
        progress: bool = True,
) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy of ``model`` on uint8 ``images`` (:func:`predict_logits`)."""
    return scores(predict_logits(model, images, batch_size, amp_dtype, progress), labels.cpu())


def model_from_args(args: argparse.Namespace) -> nn.Module:
    """The model named by ``--model`` with ``--pretrained`` weights or a ``--checkpoint``: a training checkpoint of
    that architecture (``--ema``: its EMA weights) or a ``.safetensors`` weights file."""
    import timm
    weights_file = bool(args.checkpoint) and args.checkpoint.endswith('.safetensors')
    if args.checkpoint and not weights_file:
        return load_training_checkpoint(args.checkpoint, use_ema=args.ema, model_name=args.model)
    if args.ema:
        raise ValueError('--ema needs a training checkpoint (last.pth.tar of a run with --model-ema) as --checkpoint')
    overlay = dict(pretrained_cfg_overlay=dict(file=args.checkpoint)) if weights_file else {}
    return timm.create_model(args.model, pretrained=args.pretrained or weights_file, **overlay)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--model', required=True)
    parser.add_argument('--pretrained', action='store_true', help='load the registered pretrained weights')
    parser.add_argument('--checkpoint', default=None,
                        help='a training checkpoint of `python -m timm_attnconv.train` or a .safetensors weights file')
    parser.add_argument('--ema', action='store_true', help='evaluate the EMA weights of --checkpoint')
    parser.add_argument('--data-dir', default=None, help='folder with test.npz or cifar-10-batches-py')
    parser.add_argument('--limit', type=int, default=None, help='first N test images only')
    parser.add_argument('--batch-size', type=int, default=500)
    parser.add_argument('--device', default='cpu')


def load_test_split(args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    images, labels = load_cifar10(args.data_dir, 'test')
    return images[:args.limit], labels[:args.limit]


def print_result(result: Dict[str, Any], json_path: Optional[str] = None, indent: Optional[int] = None) -> None:
    """Print ``result`` as JSON and, given ``json_path``, write it there too."""
    print(json.dumps(result, indent=indent))
    if json_path:
        with open(json_path, 'w') as f:
            json.dump(result, f, indent=2)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description='CIFAR-10 test accuracy of a timm_attnconv model.')
    add_model_args(parser)
    parser.add_argument('--json', default=None, help='also write the result to this file')
    args = parser.parse_args(argv)

    images, labels = load_test_split(args)
    model = model_from_args(args).to(args.device)
    result = dict(model=args.model, **evaluate(model, images, labels, args.batch_size))
    print_result(result, args.json)
    return result


if __name__ == '__main__':
    main()
