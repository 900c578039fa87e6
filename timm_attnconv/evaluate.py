"""Top-1 / top-5 accuracy and loss on the CIFAR-10 test set.

    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --checkpoint runs/x/last.pth.tar
    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --pretrained --json result.json
"""
import argparse
import json
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from .data import load_cifar10, normalize

__all__ = ['evaluate', 'main']


@torch.no_grad()
def evaluate(
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int = 500,
        amp_dtype: Optional[torch.dtype] = None,
        progress: bool = True,
) -> Dict[str, float]:
    """Top-1 / top-5 accuracy (%) and mean cross-entropy of ``model`` on uint8 ``images``, normalised with the model's
    pretrained cfg mean / std. The model's mode is restored afterwards."""
    cfg = model.pretrained_cfg
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct1 = correct5 = 0
    loss_sum = 0.
    for start in tqdm(range(0, labels.shape[0], batch_size), desc='eval', unit='batch', disable=not progress,
                      leave=False):
        x = normalize(images[start:start + batch_size].to(device), cfg['mean'], cfg['std'])
        y = labels[start:start + batch_size].to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x).float()
        loss_sum += F.cross_entropy(logits, y, reduction='sum').item()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct1 += (top5[:, 0] == y).sum().item()
        correct5 += (top5 == y[:, None]).any(dim=1).sum().item()
    model.train(was_training)
    n = labels.shape[0]
    return dict(top1=100. * correct1 / n, top5=100. * correct5 / n, loss=loss_sum / n, images=n)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    import timm
    from .train import load_training_checkpoint

    parser = argparse.ArgumentParser(description='CIFAR-10 test accuracy of a timm_attnconv model.')
    parser.add_argument('--model', required=True)
    parser.add_argument('--pretrained', action='store_true', help='load the registered pretrained weights')
    parser.add_argument('--checkpoint', default=None, help='a training checkpoint of `python -m timm_attnconv.train`')
    parser.add_argument('--ema', action='store_true', help='evaluate the EMA weights of --checkpoint')
    parser.add_argument('--data-dir', default=None, help='folder with test.npz or cifar-10-batches-py')
    parser.add_argument('--limit', type=int, default=None, help='first N test images only')
    parser.add_argument('--batch-size', type=int, default=500)
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--json', default=None, help='also write the result to this file')
    args = parser.parse_args(argv)

    images, labels = load_cifar10(args.data_dir, 'test')
    if args.limit:
        images, labels = images[:args.limit], labels[:args.limit]
    if args.checkpoint:
        model = load_training_checkpoint(args.checkpoint, use_ema=args.ema)
    else:
        model = timm.create_model(args.model, pretrained=args.pretrained)
    result = dict(model=args.model, **evaluate(model.to(args.device), images, labels, args.batch_size))
    print(json.dumps(result))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == '__main__':
    main()
