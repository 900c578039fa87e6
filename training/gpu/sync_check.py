"""Train briefly on the GPU with torch's sync debug mode and print where a training step made the host wait.

    python3 training/gpu/sync_check.py [DATA]   # DATA: folder with train.npz / test.npz (default /tmp/c10)

Reading a value off the GPU (``.item()``, a copy to the host) or copying to it from pageable host memory waits for all
queued work, which leaves the GPU idle while the host catches up. The trainer's steps should wait only in the loss
check every ``--log-interval`` steps: a source line that waited in most steps is reported, and the exit status is 1.
"""
import collections
import sys
import tempfile
import warnings

import torch

from timm_attnconv.data import EpochBatches
from timm_attnconv.train import main

STEPS, INTERVAL, BATCH = 40, 10, 64  # per epoch, 2 epochs
data = sys.argv[1] if len(sys.argv) > 1 else '/tmp/c10'
waits, stepping = collections.Counter(), [False]


def record(message, category, filename, lineno, file=None, line=None):
    if stepping[0] and 'synchroniz' in str(message):
        waits[f'{filename}:{lineno}'] += 1


def epoch_of_steps(self, start_step=0, _iterate=EpochBatches.iterate):
    stepping[0] = True  # from the epoch's first batch to its last step; tests and saves come after
    yield from _iterate(self, start_step)
    stepping[0] = False


warnings.showwarning = record
warnings.simplefilter('always')
EpochBatches.iterate = epoch_of_steps
torch.cuda.set_sync_debug_mode('warn')
with tempfile.TemporaryDirectory() as out:
    main(['--model', 'sa_quadratic_cifar', '--data-dir', data, '--output', out, '--epochs', '2',
          '--train-limit', str(STEPS * BATCH), '--batch-size', str(BATCH), '--eval-limit', '1000', '--model-ema',
          '--clip-grad', '1.0', '--device', 'cuda', '--amp', 'bf16', '--log-interval', str(INTERVAL)])
torch.cuda.set_sync_debug_mode(0)
print(f'host waits during {2 * STEPS} steps (expected: {2 * STEPS // INTERVAL} in the loss check):')
for site, count in waits.most_common():
    print(f'{count:6d}  {site}')
every_step = [site for site, count in waits.items() if count > STEPS]
print(f"FAIL: waited in most steps at {', '.join(every_step)}" if every_step else 'OK: no line waited in most steps')
sys.exit(1 if every_step else 0)
