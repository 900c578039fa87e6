"""Top-k labels for image files or folders with any registered model.

    python -m timm_attnconv.predict timm_attnconv/samples --model sa_quadratic_tiny_cifar --pretrained
    python -m timm_attnconv.predict photos/ --model aa_resnet50 --checkpoint my.safetensors --device cuda --amp bf16

Preprocessing comes from the model's pretrained cfg (``timm.data.resolve_model_data_config`` and
``create_transform``), as in timm's own scripts. Devices and dtypes follow ``--device`` / ``--amp``; nothing assumes a
CPU. An image that cannot be read is reported on stderr and the others are still classified; the exit status is then
1.
"""
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from tqdm import tqdm

from . import cli
from .constants import AMP_DTYPES as AMP

__all__ = ['image_files', 'read_image', 'predict', 'main']

IMAGE_SUFFIXES = ('.png', '.jpg', '.jpeg', '.bmp', '.webp', '.gif', '.tif', '.tiff')


def image_files(paths: Sequence[str]) -> List[str]:
    """Image files named in ``paths`` or inside the folders named there (sorted, recursive). A path that does not
    exist stays in the list, for :func:`predict` to report with the others' results, unless none exists."""
    if not any(os.path.exists(path) for path in paths):
        raise FileNotFoundError(f"no such image file or folder: {', '.join(map(repr, paths))}")
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(root, f) for root, _, names in os.walk(path) for f in names
                            if f.lower().endswith(IMAGE_SUFFIXES))
        else:
            files.append(path)
    if not files:
        raise FileNotFoundError(f'no images ({", ".join(IMAGE_SUFFIXES)}) in {list(paths)}')
    return files


def read_image(path: str):
    """The image file ``path`` as an RGB ``PIL.Image``; ``OSError`` naming the file and why it cannot be read."""
    from PIL import Image
    if not os.path.isfile(path):
        raise FileNotFoundError(f'{path}: no such image file')
    try:
        with Image.open(path) as image:
            return image.convert('RGB')
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # not an image, truncated, too large
        raise OSError(f'{path}: cannot read it as an image ({e})') from e


def _read_batch(files: Sequence[str], transform) -> List[Union[torch.Tensor, str]]:
    """Each file as a model input, or the reason it cannot be read."""
    items = []
    for file in files:
        try:
            items.append(transform(read_image(file)))
        except OSError as e:
            items.append(str(e))
    return items


@torch.no_grad()
def predict(model: torch.nn.Module, files: Sequence[str], topk: int = 5, batch_size: int = 64,
            amp: Optional[torch.dtype] = None, channels_last: bool = False) -> List[Dict[str, Any]]:
    """``[{file, labels, indices, probs}]`` with the ``topk`` classes of each image (labels from the cfg's
    ``label_names``), in the order of ``files``; ``{file, error}`` for a file that cannot be read."""
    import timm

    config = timm.data.resolve_model_data_config(model)
    transform = timm.data.create_transform(**config, is_training=False)
    names = model.pretrained_cfg.get('label_names')
    if names and len(names) != model.num_classes:  # another head (--num-classes): the cfg's names are not its
        names = None
    param = next(model.parameters())
    results = []
    for start in tqdm(range(0, len(files), batch_size), desc='predict', unit='batch', leave=False):
        batch_files = files[start:start + batch_size]
        items = _read_batch(batch_files, transform)
        inputs = [item for item in items if isinstance(item, torch.Tensor)]
        tops = iter(())
        if inputs:
            x = torch.stack(inputs).to(param.device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(param.device.type, dtype=amp, enabled=amp is not None):
                probs = model(x.to(param.dtype)).float().softmax(dim=-1)
            top = probs.topk(min(topk, probs.shape[-1]), dim=-1)
            tops = zip(top.values.tolist(), top.indices.tolist())
        for file, item in zip(batch_files, items):
            if isinstance(item, str):
                results.append(dict(file=file, error=item))
                continue
            p, index = next(tops)
            labels = [names[i] if names else str(i) for i in index]
            results.append(dict(file=file, labels=labels, indices=index, probs=p))
    return results


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('paths', nargs='+', help='image files or folders')
    cli.add_model_args(parser)
    parser.add_argument('--num-classes', type=cli.positive_int, default=None,
                        help='for a weights file with another head size')
    parser.add_argument('--topk', type=cli.positive_int, default=5)
    parser.add_argument('--batch-size', type=cli.positive_int, default=64)
    cli.add_device_arg(parser)
    parser.add_argument('--amp', choices=tuple(AMP), default='none', help='autocast dtype')
    parser.add_argument('--channels-last', action='store_true')
    parser.add_argument('--compile', action='store_true', help='torch.compile the model')
    parser.add_argument('--json', default=None, help='also write the predictions (and unreadable files) to this file')
    args = parser.parse_args(argv)

    files = image_files(args.paths)
    kwargs = {} if args.num_classes is None else dict(num_classes=args.num_classes)
    model = cli.load_model(args, **kwargs).eval().to(args.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    results = predict(model, files, args.topk, args.batch_size, AMP[args.amp], args.channels_last)
    for r in results:
        if 'error' in r:
            print(f"{parser.prog}: error: {r['error']}", file=sys.stderr)
        else:
            print(f"{r['file']}: " + ', '.join(f'{label} {p:.3f}' for label, p in zip(r['labels'], r['probs'])))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=2)
    unreadable = sum('error' in r for r in results)
    if unreadable:
        raise OSError(f'{unreadable} of {len(results)} images could not be read (named above); the others were '
                      f'classified')
    return results


if __name__ == '__main__':
    cli.run(main)
