"""Top-k labels for image files or folders with any registered model.

    python -m timm_attnconv.predict timm_attnconv/samples --model sa_quadratic_tiny_cifar --pretrained
    python -m timm_attnconv.predict photos/ --model aa_resnet50 --checkpoint my.safetensors --device cuda --amp bf16

Preprocessing comes from the model's pretrained cfg (``timm.data.resolve_model_data_config`` and
``create_transform``), as in timm's own scripts. Devices and dtypes follow ``--device`` / ``--amp``; nothing assumes a
CPU.
"""
import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from .constants import AMP_DTYPES as AMP

__all__ = ['image_files', 'predict', 'main']

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp', '.gif', '.tif', '.tiff')


def image_files(paths: Sequence[str]) -> List[str]:
    """Image files named in ``paths`` or inside the folders named there (sorted, recursive)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                            if f.lower().endswith(IMAGE_SUFFIXES))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f'no such image file or folder: {path!r}')
    if not files:
        raise FileNotFoundError(f'no images ({", ".join(IMAGE_SUFFIXES)}) in {list(paths)}')
    return files


@torch.no_grad()
def predict(model: torch.nn.Module, files: Sequence[str], topk: int = 5, batch_size: int = 64,
            amp: Optional[torch.dtype] = None, channels_last: bool = False) -> List[Dict[str, Any]]:
    """``[{file, labels, probs}]`` with the ``topk`` classes of each image (labels from the cfg's ``label_names``)."""
    import timm
    from PIL import Image

    config = timm.data.resolve_model_data_config(model)
    transform = timm.data.create_transform(**config, is_training=False)
    names = model.pretrained_cfg.get('label_names')
    param = next(model.parameters())
    results = []
    for start in tqdm(range(0, len(files), batch_size), desc='predict', unit='batch', leave=False):
        batch_files = files[start:start + batch_size]
        x = torch.stack([transform(Image.open(f).convert('RGB')) for f in batch_files]).to(param.device)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(param.device.type, dtype=amp, enabled=amp is not None):
            probs = model(x.to(param.dtype)).float().softmax(dim=-1)
        top = probs.topk(min(topk, probs.shape[-1]), dim=-1)
        for file, p, index in zip(batch_files, top.values.tolist(), top.indices.tolist()):
            labels = [names[i] if names else str(i) for i in index]
            results.append(dict(file=file, labels=labels, indices=index, probs=p))
    return results


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    import timm
    import timm_attnconv  # noqa: F401

    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('paths', nargs='+', help='image files or folders')
    parser.add_argument('--model', required=True)
    parser.add_argument('--pretrained', action='store_true', help='the registered pretrained weights')
    parser.add_argument('--checkpoint', default=None, help='weights file (.safetensors or a torch state dict)')
    parser.add_argument('--num-classes', type=int, default=None, help='for --checkpoint with another head size')
    parser.add_argument('--topk', type=int, default=5)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--amp', choices=tuple(AMP), default='none', help='autocast dtype')
    parser.add_argument('--channels-last', action='store_true')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    parser.add_argument('--json', default=None, help='also write the predictions to this file')
    args = parser.parse_args(argv)

    kwargs = {} if args.num_classes is None else dict(num_classes=args.num_classes)
    if args.checkpoint:
        kwargs.update(pretrained_cfg_overlay=dict(file=args.checkpoint))
    model = timm.create_model(args.model, pretrained=args.pretrained or bool(args.checkpoint), **kwargs)
    model = model.eval().to(args.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    results = predict(model, image_files(args.paths), args.topk, args.batch_size, AMP[args.amp], args.channels_last)
    for r in results:
        print(f"{r['file']}: " + ', '.join(f'{label} {p:.3f}' for label, p in zip(r['labels'], r['probs'])))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == '__main__':
    main()
