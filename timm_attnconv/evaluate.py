"""Top-1 / top-5 accuracy and loss on the CIFAR-10 test set.

    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --checkpoint runs/x/last.pth.tar
    python -m timm_attnconv.evaluate --model sa_quadratic_tiny_cifar --pretrained --json result.json
"""
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from . import cli
from .data import normalize

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


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    parser = cli.parser(__spec__.name, 'CIFAR-10 test accuracy of a timm_attnconv model.')
    cli.add_test_set_args(parser)
    args = parser.parse_args(argv)

    model = cli.load_model(args).to(args.device)
    images, labels = cli.load_test_split(args)
    result = dict(model=args.model, **evaluate(model, images, labels, args.batch_size))
    cli.print_result(result, args.json)
    return result


if __name__ == '__main__':
    cli.keep_freed_memory()  # this process is the command's: see there
    cli.run(main)
