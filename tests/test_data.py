"""CIFAR-10 loading, batch augmentation and the reproducible batch order."""
import gc
import os
import warnings

import numpy as np
import pytest
import torch

from timm_attnconv.data import CIFAR10_DIR_ENV, EpochBatches, default_data_dir, load_cifar10, normalize, \
    random_crop_flip

from .conftest import SYNTHETIC_TEST_IMAGES, SYNTHETIC_TRAIN_IMAGES

# the real files, for the checks of them alone (their order, their counts): opt-in with `-m cifar10` (setup.cfg), so
# the default suite runs whole on any clone and a missing copy fails that run by name; the rest use synthetic_cifar10
REAL_DATA_DIR = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'cifar10')


@pytest.mark.cifar10
def test_loads_the_official_test_split():
    images, labels = load_cifar10(REAL_DATA_DIR, 'test')
    assert images.shape == (10000, 3, 32, 32) and images.dtype == torch.uint8
    assert labels[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]  # published first test labels
    assert torch.bincount(labels).tolist() == [1000] * 10


def test_missing_and_corrupt_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='test.npz'):
        load_cifar10(str(tmp_path), 'test')
    (tmp_path / 'test.npz').write_bytes(b'not a zip file')
    with pytest.raises(ValueError, match='test.npz'):
        load_cifar10(str(tmp_path), 'test')
    for images in (np.zeros((10, 32, 32), np.uint8), np.zeros((10, 32, 32, 3), np.float32),
                   np.zeros((0, 32, 32, 3), np.uint8)):  # no channels, not bytes, no images
        np.savez(tmp_path / 'test.npz', x=images, y=np.zeros(len(images), np.int64))
        with pytest.raises(ValueError, match='truncated or not CIFAR-10'):
            load_cifar10(str(tmp_path), 'test')
    for labels in (np.zeros(9, np.int64), np.full(10, 10)):  # one short, a class beyond 9
        np.savez(tmp_path / 'test.npz', x=np.zeros((10, 32, 32, 3), np.uint8), y=labels)
        with pytest.raises(ValueError, match='not 10 classes in 0..9'):
            load_cifar10(str(tmp_path), 'test')
    with pytest.raises(FileNotFoundError, match=CIFAR10_DIR_ENV):  # the error names both ways to point at the data
        load_cifar10(str(tmp_path / 'elsewhere'), 'train')


def test_a_split_of_any_size_loads_from_the_folder_of_the_environment_variable(synthetic_cifar10, monkeypatch):
    monkeypatch.setenv(CIFAR10_DIR_ENV, synthetic_cifar10)
    assert default_data_dir() == synthetic_cifar10
    for split, count in (('train', SYNTHETIC_TRAIN_IMAGES), ('test', SYNTHETIC_TEST_IMAGES)):
        images, labels = load_cifar10(split=split)
        assert images.shape == (count, 3, 32, 32) and images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert torch.bincount(labels, minlength=10).min() >= count // 10  # every class, balanced
    monkeypatch.delenv(CIFAR10_DIR_ENV)  # unset: the documented folder beside the checkout
    assert os.path.normpath(default_data_dir()) == os.path.normpath(REAL_DATA_DIR)


def test_truncated_or_bit_flipped_npz_is_named(tmp_path):
    np.savez(tmp_path / 'whole.npz', x=np.zeros((10, 32, 32, 3), np.uint8), y=np.zeros(10, np.int64))
    data = (tmp_path / 'whole.npz').read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xff  # inside the x array: the zip's CRC-32 check fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', ResourceWarning)
        for damaged in (data[:len(data) // 2], bytes(flipped)):
            (tmp_path / 'test.npz').write_bytes(damaged)
            with pytest.raises(ValueError, match=f"cannot read '{tmp_path / 'test.npz'}' as a CIFAR-10 npz"):
                load_cifar10(str(tmp_path), 'test')
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], 'the damaged file was left open'


def test_crop_flip_matches_per_image_transforms():
    images = torch.randint(0, 256, (6, 3, 8, 10), dtype=torch.uint8)
    out = random_crop_flip(images, torch.Generator().manual_seed(3), padding=2)
    draws = torch.Generator().manual_seed(3)
    top = torch.randint(0, 5, (6,), generator=draws)
    left = torch.randint(0, 5, (6,), generator=draws)
    flip = torch.rand(6, generator=draws) < 0.5
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for b in range(6):
        crop = padded[b, :, top[b]:top[b] + 8, left[b]:left[b] + 10]
        assert torch.equal(out[b], crop.flip(-1) if flip[b] else crop)


def test_batches_are_fixed_by_seed_epoch_and_step():
    images = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(50)
    full = list(EpochBatches(images, labels, 8, seed=1, epoch=2).iterate())
    resumed = list(EpochBatches(images, labels, 8, seed=1, epoch=2).iterate(start_step=3))
    assert len(full) == 6 and len(resumed) == 3
    for (xa, ya), (xb, yb) in zip(full[3:], resumed):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other_epoch = next(EpochBatches(images, labels, 8, seed=1, epoch=3).iterate())
    assert not torch.equal(other_epoch[1], full[0][1])


def test_batches_are_drawn_as_one_generator_per_step_would():
    # the order and draws that every run so far trained with: a permutation per epoch, a crop/flip generator per step
    images, labels = torch.randint(0, 256, (45, 3, 8, 8), dtype=torch.uint8), torch.arange(45)
    order = torch.randperm(45, generator=torch.Generator().manual_seed(1 * 100_003 + 2))
    for drop_last, start in [(True, 0), (True, 3), (False, 5)]:
        batches = list(EpochBatches(images, labels, 8, seed=1, epoch=2, drop_last=drop_last).iterate(start))
        assert len(batches) == (5 if drop_last else 6) - start
        for step, (x, y) in enumerate(batches, start):
            idx = order[step * 8:(step + 1) * 8]
            draws = torch.Generator().manual_seed((1 * 100_003 + 2) * 1_000_003 + step)
            assert torch.equal(x, random_crop_flip(images[idx], draws)) and torch.equal(y, labels[idx])


def test_processes_share_every_batch():
    images, labels = torch.randint(0, 256, (50, 3, 8, 8), dtype=torch.uint8), torch.arange(50)
    whole = list(EpochBatches(images, labels, 12, seed=1, epoch=0).iterate(1))
    shares = [list(EpochBatches(images, labels, 12, seed=1, epoch=0, rank=r, world_size=3).iterate(1))
              for r in range(3)]
    for step, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([share[step][0] for share in shares]), x)
        assert torch.equal(torch.cat([share[step][1] for share in shares]), y)
    with pytest.raises(ValueError, match='a batch of 12 does not split evenly over 5 processes'):
        EpochBatches(images, labels, 12, seed=1, epoch=0, rank=0, world_size=5)


def test_normalize():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    torch.testing.assert_close(normalize(x, (0.5, 0.5, 0.5), (0.5, 0.25, 1.0))[0, :, 0, 0], torch.tensor([1., 2., .5]))


def test_image_folder_is_what_timm_datasets_read(tmp_path, synthetic_cifar10):
    from timm.data import create_dataset
    from timm_attnconv.imagefolder import main
    main([str(tmp_path), '--split', 'train', '--classes', 'dog', 'cat', '--per-class', '3',
          '--data-dir', synthetic_cifar10])
    dataset = create_dataset('', root=str(tmp_path), split='train')
    images, labels = load_cifar10(synthetic_cifar10, 'train')
    # cat (3) sorts before dog (5) whatever order was asked: timm's labels follow CIFAR-10's order
    assert [dataset[i][1] for i in range(len(dataset))] == [0, 0, 0, 1, 1, 1]
    first_cat = int(torch.nonzero(labels == 3)[0, 0])
    assert np.array_equal(np.asarray(dataset[0][0]), images[first_cat].permute(1, 2, 0).numpy())  # lossless
    with pytest.raises(ValueError, match='unknown CIFAR-10 classes'):
        main([str(tmp_path), '--classes', 'kitten'])
    one_class = tmp_path / 'frogs'  # a data folder without the classes asked for
    one_class.mkdir()
    for split in ('train', 'test'):
        np.savez_compressed(one_class / f'{split}.npz', x=np.zeros((4, 32, 32, 3), np.uint8), y=np.full(4, 6))
    with pytest.raises(ValueError, match='the test split of this CIFAR-10 folder .4 images. has no image of cat'):
        main([str(tmp_path / 'out'), '--classes', 'cat', '--data-dir', str(one_class)])
