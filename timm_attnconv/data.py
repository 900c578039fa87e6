"""CIFAR-10 as tensors: decoded once, augmented in batch, in an order that a seed and a step number reproduce.

Two on-disk forms are read:

* the project's ``train.npz`` / ``test.npz`` (arrays ``x`` uint8 NHWC RGB and ``y`` int64, no pickles), and
* torchvision's ``cifar-10-batches-py`` folder (read by ``torchvision.datasets.CIFAR10``, which checks its MD5s).

A 2-core machine cannot afford per-image Python transforms: the whole split lives in one uint8 tensor and each batch
is cropped (zero padding 4, as ``RandomCrop(32, padding=4)``) and flipped with tensor indexing.
"""
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .constants import CIFAR10_CLASSES

__all__ = ['CIFAR10_CLASSES', 'CIFAR10_DIR_ENV', 'SAMPLES_DIR', 'default_data_dir', 'load_cifar10', 'write_samples',
           'write_image_folder', 'load_samples', 'normalize', 'crop_flip_draws', 'crop_flip', 'random_crop_flip',
           'EpochBatches']

SPLITS = ('train', 'test')
# the folder every tool reads when no --data-dir is given; unset, ../shared/data/cifar10 beside the source checkout
CIFAR10_DIR_ENV = 'TIMM_ATTNCONV_CIFAR10'
SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'samples')


def default_data_dir() -> str:
    """``$TIMM_ATTNCONV_CIFAR10`` when set, else ``../shared/data/cifar10`` beside the source checkout."""
    if os.environ.get(CIFAR10_DIR_ENV):
        return os.environ[CIFAR10_DIR_ENV]
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), '..', 'shared', 'data', 'cifar10')


def load_cifar10(data_dir: Optional[str] = None, split: str = 'train') -> Tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: uint8 ``(N, 3, 32, 32)`` RGB and int64 ``(N,)`` in the official order.

    ``data_dir`` holds ``train.npz`` / ``test.npz``, or is (or contains) torchvision's ``cifar-10-batches-py``.
    Defaults to :func:`default_data_dir`. A split may hold any number of images, so a subset (or the small synthetic
    set the tests write) loads as the full 50,000 / 10,000 do. Missing or malformed files raise
    ``FileNotFoundError`` / ``ValueError`` naming the file and what was expected.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    data_dir = os.path.normpath(data_dir or default_data_dir())
    npz = os.path.join(data_dir, f'{split}.npz')
    if os.path.isfile(npz):
        images, labels = _read_npz(npz)
    elif _torchvision_root(data_dir) is not None:
        images, labels = _read_torchvision(_torchvision_root(data_dir), split)
    else:
        raise FileNotFoundError(
            f'no CIFAR-10 {split} data in {data_dir!r}: expected {split}.npz (arrays x uint8 (N,32,32,3), y int64) '
            f'or torchvision\'s cifar-10-batches-py folder; pass --data-dir pointing at one of them, or set '
            f'{CIFAR10_DIR_ENV} to it')
    if images.ndim != 4 or images.shape[0] == 0 or images.shape[1:] != (32, 32, 3) or images.dtype != np.uint8:
        raise ValueError(f'{split} images in {data_dir!r} have shape {images.shape} dtype {images.dtype}; '
                         f'expected (N, 32, 32, 3) uint8 with N > 0: the file is truncated or not CIFAR-10')
    count = images.shape[0]
    if labels.shape != (count,) or labels.min() < 0 or labels.max() > 9:
        raise ValueError(f'{split} labels in {data_dir!r} are not {count} classes in 0..9 (one per image, shape '
                         f'{labels.shape}): the file is corrupt')
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels.astype(np.int64))


def _read_npz(path: str) -> Tuple[np.ndarray, np.ndarray]:
    try:
        # the file opened here, not by np.load: numpy leaves its own handle open when the zip is unreadable
        with open(path, 'rb') as f, np.load(f, allow_pickle=False) as data:
            return data['x'], data['y']
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:  # truncated, bit rot
        raise ValueError(f'cannot read {path!r} as a CIFAR-10 npz (arrays x and y): {e}; re-copy the file') from e


def _torchvision_root(data_dir: str) -> Optional[str]:
    if os.path.basename(data_dir) == 'cifar-10-batches-py':
        return os.path.dirname(data_dir)
    if os.path.isdir(os.path.join(data_dir, 'cifar-10-batches-py')):
        return data_dir
    return None


def _read_torchvision(root: str, split: str) -> Tuple[np.ndarray, np.ndarray]:
    from torchvision.datasets import CIFAR10
    try:
        dataset = CIFAR10(root, train=split == 'train', download=False)
    except RuntimeError as e:  # torchvision's message for missing or corrupt files
        raise ValueError(f'torchvision CIFAR-10 in {root!r}: {e}') from e
    return dataset.data, np.asarray(dataset.targets)


def write_samples(out_dir: str = SAMPLES_DIR, per_class: int = 2, data_dir: Optional[str] = None) -> List[str]:
    """Save the first ``per_class`` test images of each class as ``<test index>_<class>.png`` (lossless)."""
    images, labels = load_cifar10(data_dir, 'test')
    return _write_pngs(images, labels, CIFAR10_CLASSES, per_class,
                       lambda index, name: os.path.join(out_dir, f'{index:05d}_{name}.png'))


def write_image_folder(out_dir: str, split: str = 'test', classes: Optional[Sequence[str]] = None,
                       per_class: Optional[int] = None, data_dir: Optional[str] = None) -> List[str]:
    """Write a CIFAR-10 split as the ImageFolder tree that timm's ``train.py`` / ``validate.py`` read.

    ``<out_dir>/<train|validation>/<label>_<class>/<index>.png``, lossless and byte-identical to the npz; the label
    prefix keeps timm's sorted class order equal to CIFAR-10's (and, for a subset, the subset in CIFAR-10's order).
    ``classes`` picks a subset by name (e.g. a 2-class fine-tuning task), ``per_class`` the first N of each.
    """
    unknown = sorted(set(classes or ()) - set(CIFAR10_CLASSES))
    if unknown:
        raise ValueError(f'unknown CIFAR-10 classes {unknown}; choose from {list(CIFAR10_CLASSES)}')
    images, labels = load_cifar10(data_dir, split)
    if not {CIFAR10_CLASSES[i] for i in labels.unique().tolist()} & set(classes or CIFAR10_CLASSES):
        raise ValueError(f'the {split} split of this CIFAR-10 folder ({labels.numel()} images) has no image of '
                         f"{', '.join(classes or CIFAR10_CLASSES)}: pass other --classes or the full data set")
    split_dir = os.path.join(out_dir, 'train' if split == 'train' else 'validation')
    return _write_pngs(images, labels, classes or CIFAR10_CLASSES, per_class, lambda index, name: os.path.join(
        split_dir, f'{CIFAR10_CLASSES.index(name)}_{name}', f'{index:05d}.png'))


def _write_pngs(images: torch.Tensor, labels: torch.Tensor, classes: Sequence[str], per_class: Optional[int],
                path_of: Callable[[int, str], str]) -> List[str]:
    from PIL import Image
    paths = []
    for name in classes:
        for index in torch.nonzero(labels == CIFAR10_CLASSES.index(name))[:per_class, 0].tolist():
            paths.append(path_of(index, name))
            os.makedirs(os.path.dirname(paths[-1]), exist_ok=True)
            Image.fromarray(images[index].permute(1, 2, 0).numpy()).save(paths[-1], optimize=True)
    return sorted(paths)


def load_samples(sample_dir: str = SAMPLES_DIR) -> Tuple[torch.Tensor, torch.Tensor, List[str]]:
    """The bundled sample images: uint8 ``(N, 3, 32, 32)``, labels from the file names, and the file names."""
    from PIL import Image
    names = sorted(f for f in os.listdir(sample_dir) if f.endswith('.png'))
    if not names:
        raise FileNotFoundError(f'no sample images (*.png) in {sample_dir!r}; recreate them with '
                                f'`python -c "from timm_attnconv.data import write_samples; write_samples()"`')
    images = torch.stack([
        torch.from_numpy(np.array(Image.open(os.path.join(sample_dir, n)).convert('RGB'))).permute(2, 0, 1)
        for n in names])
    labels = torch.tensor([CIFAR10_CLASSES.index(n[:-4].split('_', 1)[1]) for n in names])
    return images, labels, names


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 ``(B, 3, H, W)`` → float32, scaled to [0, 1] then standardised per channel. ``mean`` / ``std`` may be
    tensors on the images' device: a training loop passes those, since building them from Python numbers copies them
    to the device, which on a GPU waits for all queued work."""
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    return (images.float().div_(255) - mean_t) / std_t


def crop_flip_draws(batch: int, generator: torch.Generator,
                    padding: int = 4) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random draws of :func:`random_crop_flip` for ``batch`` images: crop offsets ``top``, ``left``; ``flip``."""
    top = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (batch,), generator=generator)
    flip = torch.rand(batch, generator=generator) < 0.5
    return top, left, flip


def crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor,
              padding: int = 4) -> torch.Tensor:
    """Crop uint8 ``(B, C, H, W)`` images, zero-padded by ``padding``, at the given offsets and mirror those with
    ``flip``: pure indexing on the images' device, so the result does not depend on where it runs."""
    batch, channels, height, width = images.shape
    device = images.device
    padded = torch.nn.functional.pad(images, (padding,) * 4)
    rows = top[:, None] + torch.arange(height, device=device)  # (B, H)
    cols = left[:, None] + torch.arange(width, device=device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    index_b = torch.arange(batch, device=device)[:, None, None, None]
    index_c = torch.arange(channels, device=device)[None, :, None, None]
    return padded[index_b, index_c, rows[:, None, :, None], cols[:, None, None, :]]


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Batch ``RandomCrop(size, padding)`` with zero padding + ``RandomHorizontalFlip()`` on uint8 ``(B, C, H, W)``."""
    draws = crop_flip_draws(images.shape[0], generator, padding)
    return crop_flip(images, *(d.to(images.device) for d in draws), padding)


@dataclass
class EpochBatches:
    """Shuffled mini-batches of one epoch, fixed by ``(seed, epoch)``, resumable at any step.

    The permutation and the augmentation draws come from CPU generators seeded with ``seed`` and ``epoch``, so batch
    ``k`` of epoch ``e`` is the same whether the run started at step 0 or resumed at step ``k``, and on any device.
    Images and labels may live on a GPU: the epoch's draws go there in one copy, and selecting, cropping and flipping
    a batch then run there without the host waiting for the device.

    ``rank`` / ``world_size``: yield only this process's equal share of every batch (``batch_size`` is the global
    batch, which ``world_size`` must divide), augmented as in the whole batch: ``world_size`` processes together see
    exactly the batches of one.
    """
    images: torch.Tensor
    labels: torch.Tensor
    batch_size: int
    seed: int
    epoch: int
    augment: bool = True
    drop_last: bool = True
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        if self.batch_size % self.world_size:
            raise ValueError(f'a batch of {self.batch_size} does not split evenly over {self.world_size} processes: '
                             f'pass a --batch-size that is a multiple of {self.world_size}')

    def __len__(self) -> int:
        n = self.labels.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def iterate(self, start_step: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        steps = range(start_step, len(self))
        if not steps:
            return
        n, device = self.labels.shape[0], self.images.device
        epoch_seed = self.seed * 100_003 + self.epoch
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed))
        order = order[start_step * self.batch_size:len(self) * self.batch_size].to(device)
        if self.augment:  # each step's draws for its whole batch, concatenated as the batches are in ``order``
            draws = [crop_flip_draws(min(self.batch_size, n - step * self.batch_size),
                                     torch.Generator().manual_seed(epoch_seed * 1_000_003 + step)) for step in steps]
            top, left, flip = (torch.cat(d).to(device) for d in zip(*draws))
        share = self.batch_size // self.world_size
        for start in range(0, order.shape[0], self.batch_size):
            part = slice(start + self.rank * share, start + (self.rank + 1) * share)
            images = self.images[order[part]]
            if self.augment:
                images = crop_flip(images, top[part], left[part], flip[part])
            yield images, self.labels[order[part]]
