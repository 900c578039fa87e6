"""A training run's configuration: :class:`TrainConfig`, every option of ``python -m timm_attnconv.train`` with its
default, check and help; the run config a checkpoint records of it; the check that a resumption keeps it; and the
model the run starts from.

The command line is built from :class:`TrainConfig`, so a Python caller of :func:`timm_attnconv.train.train` gets the
command's defaults and has a bad value refused as the command refuses it, naming the field::

    from timm_attnconv.train import TrainConfig, train
    train(TrainConfig(model='sa_quadratic_tiny_cifar', output='training/tiny', epochs=2))
"""
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from . import cli
from .constants import AMP_DTYPES
from .runs import cifar10_cfg_overlay

__all__ = ['TrainConfig', 'RESUME_KEYS', 'DATA_KEYS', 'RUNTIME_KEYS', 'MACHINE_KEYS', 'START_KEYS', 'option_default',
           'check_resumable', 'init_from_pretrained', 'initial_model']

# options that must not change between a run and its resumption: each changes the trained weights or (eval_limit) the
# test images behind the log's metrics. A checkpoint that predates a key was written with the option's default.
RESUME_KEYS = ('model', 'model_kwargs', 'epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'warmup_epochs',
               'min_lr', 'smoothing', 'clip_grad', 'model_ema', 'model_ema_decay', 'amp', 'seed', 'train_limit',
               'eval_limit', 'init_from')
# sha256 prefixes of the images a run trains and tests on, checked on resume too, with the options that pick them:
# the images matter, not their path (a moved copy of the data resumes)
DATA_KEYS = {'train_data': '--data-dir / --train-limit', 'test_data': '--data-dir / --eval-limit'}
# how a run executes, not what it computes (they change it by float rounding only): free to change on resume, and
# recorded in every log line, whose throughput depends on them
RUNTIME_KEYS = ('device', 'channels_last', 'compile')
# what the run computes on, recorded beside those: a resume on another processor or torch changes rounding only
MACHINE_KEYS = ('processor', 'torch')
# the options that decide the weights a run starts from (:func:`initial_model`, then ``--init-from``): two checkpoints
# that agree on them share a start, whatever keys later versions of the trainer added to their configs
START_KEYS = ('model', 'model_kwargs', 'seed', 'init_from')


def _option(default: Any = MISSING, check: Any = None, help: Optional[str] = None, path: bool = False) -> Any:
    """A field of :class:`TrainConfig`: ``check`` is the option's command-line check (a ``cli`` validator or a tuple
    of choices), ``path`` a file or folder (a ``os.PathLike`` is kept as its ``str``, the form checkpoints record)."""
    return field(default=default, metadata=dict(check=check, help=help, path=path))


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every option of a training run, as ``python -m timm_attnconv.train --<name-with-dashes>`` takes it; ``model``
    and ``output`` are required. An option left at ``None`` is off. ``device='auto'`` becomes ``'cuda'`` where torch
    sees a GPU, else ``'cpu'``."""
    model: str = _option(check=cli.model_name)
    model_kwargs: Dict[str, Any] = field(default_factory=dict, metadata=dict(
        check=cli.json_object, help='JSON dict for timm.create_model', path=False))
    init_from: Optional[str] = _option(
        None, path=True, help='start from these pretrained weights (e.g. sa_learned_tiny_cifar.c10) or .safetensors '
                              'file instead of a random init; a model of another layout must support it '
                              '(SelfAttentionNet.init_from)')
    data_dir: Optional[str] = _option(None, path=True)  # its help is every CIFAR-10 tool's: cli.add_data_dir_arg
    output: str = _option(path=True, help='run folder: checkpoint, log.jsonl')
    epochs: int = _option(30, cli.positive_int)
    batch_size: int = _option(128, cli.positive_int)
    opt: str = _option('adamw', help='timm optimizer name')
    lr: float = _option(2e-3, cli.non_negative_float)
    weight_decay: float = _option(0.05, cli.non_negative_float)
    sched: str = _option('cosine', help='timm scheduler name')
    warmup_epochs: int = _option(1, cli.non_negative_int)
    min_lr: float = _option(1e-5, cli.non_negative_float)
    smoothing: float = _option(0.1, cli.probability, 'label smoothing')
    clip_grad: Optional[float] = _option(None, cli.positive_float, 'clip the gradient norm to this value')
    model_ema: bool = _option(False, help='keep an EMA of the weights (timm ModelEmaV3)')
    model_ema_decay: float = _option(0.999, cli.probability)
    amp: str = _option('none', tuple(AMP_DTYPES),
                       'autocast dtype (bf16 pays off only on CPUs with bf16 units and on GPUs)')
    channels_last: bool = _option(False)
    compile: bool = _option(False, help='torch.compile the model')
    device: str = _option('auto', cli.device)  # its help is every tool's: cli.add_device_arg
    seed: int = _option(42, cli.non_negative_int)
    train_limit: Optional[int] = _option(None, cli.positive_int, 'first N training images only (smoke tests)')
    eval_limit: Optional[int] = _option(
        None, cli.positive_int,
        'first N test images only (smoke tests); fixed for the run, so its log compares like with like')
    max_steps: Optional[int] = _option(None, cli.positive_int, 'stop (with a checkpoint) after this many steps')
    eval_every: int = _option(1, cli.positive_int, 'test the weights every N epochs and after the last; the log line '
                                                   'of an epoch without a test has no test_* keys')
    eval_ema: bool = _option(False, help='test the EMA weights at every test of the weights, not only after the last '
                                         'epoch')
    log_interval: int = _option(50, cli.positive_int, 'check the training loss and update the progress bar every N '
                                                      'steps: the only points in an epoch where the host waits for '
                                                      'the device')
    no_resume: bool = _option(False, help='refuse to start if the output holds a checkpoint')

    def __post_init__(self):
        for option in fields(self):
            value = getattr(self, option.name)
            if not (value is None and option.default is None):  # None: an option that is off
                # frozen: the checked value (a device resolved, a path as str) is set once, here
                object.__setattr__(self, option.name, _checked(option, value))
        missing = cli.missing_device(self.device)
        if missing:
            raise cli.UsageError(f'TrainConfig device: {missing}')

    def run_config(self, data: Dict[str, str], world_size: int) -> Dict[str, Any]:
        """The run config a checkpoint records: the options of :data:`RESUME_KEYS`, the digests of the images
        (:data:`DATA_KEYS`) and the number of processes."""
        return dict({k: getattr(self, k) for k in RESUME_KEYS}, **data, world_size=world_size)


def _checked(option: Any, value: Any) -> Any:
    name = f'TrainConfig {option.name}'
    if option.metadata['path']:
        try:
            return os.fspath(value)
        except TypeError:
            raise cli.UsageError(f'{name}: expected a path, got {value!r}') from None
    if option.metadata['check'] is not None:
        return cli.check_value(name, option.metadata['check'], value)
    kind = bool if isinstance(option.default, bool) else str
    if not isinstance(value, kind):
        raise cli.UsageError(f'{name}: expected a {kind.__name__}, got {value!r}')
    return value


def option_default(option: Any) -> Any:
    """The default of a :class:`TrainConfig` field; ``dataclasses.MISSING`` for a required one."""
    return option.default_factory() if option.default_factory is not MISSING else option.default


def check_resumable(saved: Dict[str, Any], config: Dict[str, Any], path: str) -> None:
    """Refuse to resume the checkpoint ``path``, whose run config is ``saved``, with the run config ``config`` when
    the result would differ from an uninterrupted run: other options, other images, another number of processes."""
    defaults = {option.name: option_default(option) for option in fields(TrainConfig) if option.name in RESUME_KEYS}
    diff = [f'{k}: checkpoint {saved.get(k, defaults[k])!r} vs now {config[k]!r}'
            for k in RESUME_KEYS if saved.get(k, defaults[k]) != config[k]]
    diff += [f'{k} ({options}): checkpoint {saved[k]} vs now {config[k]}'
             for k, options in DATA_KEYS.items() if k in saved and saved[k] != config[k]]
    if diff:
        raise ValueError(f"cannot resume {path!r} with different settings ({'; '.join(diff)}): the result would "
                         f'differ from an uninterrupted run. Use the original options or another --output folder')
    before, now = saved.get('world_size', 1), config['world_size']
    if before != now:
        launch = f'torchrun --nproc_per_node {before} -m timm_attnconv.train' if before > 1 else 'without torchrun'
        raise ValueError(f'cannot resume {path!r} with world size {now}: it was trained by {before} process(es), and '
                         f'every process keeps its own random state (dropout masks) and share of each batch, so '
                         f'another count would not continue the run exactly. Launch it as it started ({launch}) or '
                         f'pass another --output')
    if any(k not in saved for k in DATA_KEYS):
        print(f'note: {path!r} predates data digests; the images under --data-dir are not checked against the run')


def init_from_pretrained(model: nn.Module, name: str) -> nn.Module:
    """Load the pretrained weights ``name`` into ``model``: as they are when the layouts match, else through the
    model's own ``init_from(source)`` (e.g. a content model warm-started from a positional one). ``name`` may also
    be a ``.safetensors`` file of ``model``'s layout (e.g. weights pruned by ``prune_degenerate_heads``)."""
    import timm
    if name.endswith('.safetensors'):
        from safetensors.torch import load_file
        model.load_state_dict(load_file(name))  # strict: a mismatch names the keys
        return model
    source = timm.create_model(name, pretrained=True, num_classes=10)
    init = getattr(model, 'init_from', None)
    if init is not None and source.state_dict().keys() != model.state_dict().keys():
        return init(source)
    model.load_state_dict(source.state_dict())  # strict: a mismatch names the keys
    return model


def initial_model(config: Dict[str, Any], warm_start: bool = True) -> nn.Module:
    """The model exactly as a run with the run config ``config`` starts: torch's RNG seeded with ``config['seed']``,
    then built, then (``warm_start``) loaded with the run's ``--init-from`` weights, if it has them."""
    torch.manual_seed(config['seed'])
    # the same model as runs.build_model, with a kwarg the model does not take named as the option that passed it
    asked = {k: v for k, v in config['model_kwargs'].items() if k != 'pretrained_cfg_overlay'}
    model = cli.create_model(config['model'], '--model-kwargs', asked, num_classes=10,
                             pretrained_cfg_overlay=cifar10_cfg_overlay(config['model_kwargs']))
    if warm_start and config.get('init_from'):
        model = init_from_pretrained(model, config['init_from'])
    return model
