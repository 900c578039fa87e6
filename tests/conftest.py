import os
import warnings

# keep any accidental hub access local and quick; set before timm / huggingface_hub are imported
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_HUB_DISABLE_TELEMETRY', '1')

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402

import timm_attnconv  # noqa: E402,F401  (registers the models before collection)
from timm_attnconv.data import CIFAR10_DIR_ENV  # noqa: E402
from timm_attnconv.layers import attention_kernels  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_report_header(config):
    """The versions a run checked, at the top of its log (``.ci/run --oldest`` pins every lower bound of setup.cfg)."""
    from importlib import metadata
    others = []
    for name in ('torchvision', 'huggingface-hub', 'safetensors', 'numpy', 'matplotlib', 'fvcore', 'onnxscript',
                 'onnx-ir', 'onnxruntime', 'hypothesis'):
        try:
            others.append(f'{name} {metadata.version(name)}')
        except metadata.PackageNotFoundError:
            others.append(f'{name} not installed')
    return [f'torch {torch.__version__}, timm {timm.__version__}', ', '.join(others)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def eager_flex(monkeypatch):
    """The ``'flex'`` kernel with FlexAttention's eager form in place of its compiled one: the same ``score_mod``,
    padding and slicing through torch's unfused reference of the kernel, without a C++ compile per shape (about 20 s
    each on the 2-core CI machine). ``test_layers_attention_kernels`` compiles it once (slow)."""
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(attention_kernels, '_compiled_flex_attention', lambda: flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='flex_attention called without torch.compile')
        yield


SYNTHETIC_TRAIN_IMAGES, SYNTHETIC_TEST_IMAGES = 512, 256


def write_synthetic_cifar10(folder, train_images=SYNTHETIC_TRAIN_IMAGES, test_images=SYNTHETIC_TEST_IMAGES, seed=0):
    """``train.npz`` / ``test.npz`` in the real files' format (``x`` uint8 ``(N, 32, 32, 3)`` RGB, ``y`` int64 in
    0..9, as ``../shared/data/README.md`` describes them), small and learnable: each class paints its own pair of
    colours on the top and bottom halves under pixel noise, which a random crop (4 px) and a horizontal flip keep, so
    a tiny model beats chance within a few steps. Balanced classes, shuffled; the same files for the same seed."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, (10, 2, 3))  # per class: top half, bottom half
    for split, count in (('train', train_images), ('test', test_images)):
        labels = rng.permutation(np.arange(count) % 10).astype(np.int64)
        halves = np.repeat(colours[labels], 16, axis=1)  # (N, 32, 3): each row's colour
        images = np.broadcast_to(halves[:, :, None, :], (count, 32, 32, 3)) + rng.normal(0, 24, (count, 32, 32, 3))
        np.savez_compressed(os.path.join(folder, f'{split}.npz'), x=images.clip(0, 255).astype(np.uint8), y=labels)
    return str(folder)


@pytest.fixture(scope='session')
def synthetic_cifar10(tmp_path_factory):
    """A folder with a small synthetic CIFAR-10 (see :func:`write_synthetic_cifar10`): the tests of training,
    evaluation and staging run on it wherever the real data is absent, as on a fresh clone."""
    return write_synthetic_cifar10(tmp_path_factory.mktemp('synthetic_cifar10'))


@pytest.fixture(scope='module')
def synthetic_cifar10_as_default(synthetic_cifar10):
    """The synthetic set as every tool's default data folder (``$TIMM_ATTNCONV_CIFAR10``) for one module's tests, so
    that the command lines they share (``test_train.TINY``) need no ``--data-dir``; module-scoped, as the runs those
    modules train once and share are."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CIFAR10_DIR_ENV, synthetic_cifar10)
        yield synthetic_cifar10
