"""Values several modules must agree on: data statistics, class names, file names of runs and weights, AMP dtypes, the
register budget of the Triton kernel of evolving attention."""
import torch

__all__ = ['CIFAR10_CLASSES', 'CIFAR10_MEAN', 'CIFAR10_STD', 'CIFAR100_MEAN', 'CIFAR100_STD', 'CHECKPOINT', 'LOG',
           'RUN_CONFIG', 'MANIFEST', 'WEIGHTS_FILE', 'WEIGHTS_FILES', 'CONFIG_FILE', 'AMP_DTYPES',
           'EVOLUTION_KERNEL_ACCUMULATORS']

CIFAR10_CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')
# the Normalize of Cordonnier et al.'s training code (epfml/attention-cnn train.py), not the exact pixel std; the
# trained weights expect them
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

# a training run's folder (python -m timm_attnconv.train --output)
CHECKPOINT = 'last.pth.tar'
LOG = 'log.jsonl'
RUN_CONFIG = 'config.json'  # the run config, beside weights exported without a checkpoint
WEIGHTS_FILES = {'model': 'model.safetensors', 'ema': 'ema.safetensors'}
MANIFEST = 'manifest.json'  # what transfer brought back: the parts' digests, and the checkpoint's epoch and step

# a staged weights folder, in timm's Hub layout
WEIGHTS_FILE = WEIGHTS_FILES['model']
CONFIG_FILE = 'config.json'  # timm's model config (architecture, pretrained cfg), not a run config

# --amp of the command-line tools
AMP_DTYPES = {'none': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}

# fp32 accumulators one program of the Triton evolution kernel holds (layers/evolution_kernel.py: output heads × query
# rows × keys, padded to powers of two): 8,192 are 64 registers a thread in 4 warps. The interpreter takes this many;
# on CUDA the autotuner tries half to twice as many (layers/_evolution_triton.py), maps needing more are not taken
EVOLUTION_KERNEL_ACCUMULATORS = 8192
