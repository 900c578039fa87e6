import os

# keep any accidental hub access local and quick; set before timm / huggingface_hub are imported
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('HF_HUB_DISABLE_TELEMETRY', '1')

import pytest  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402

import timm_attnconv  # noqa: E402,F401  (registers the models before collection)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_report_header(config):
    return f'torch {torch.__version__}, timm {timm.__version__}'  # the versions a run checked, at the top of its log


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
