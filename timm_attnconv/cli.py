"""What every ``python -m timm_attnconv.<tool>`` shares: failing like a command-line tool, validated options, and the
model, checkpoint and device plumbing.

A tool's ``main(argv)`` raises; :func:`run`, which runs it as a command, turns an error that describes a bad argument
or input into one line on stderr, ``<prog>: error: <what is wrong, and the fix>``, and exit status 2 for a bad
argument (:class:`UsageError`, argparse's own errors) or 1 for an input or run that cannot be used (``ValueError``,
``OSError``, ``RuntimeError``, ``FloatingPointError``). Any other exception is a bug and keeps its traceback;
``TIMM_ATTNCONV_DEBUG=1`` shows the traceback of every error.

Every numeric option goes through one of the validators below, so a value that makes no sense is refused with the
option's name before anything runs. ``--device auto``, the default of every tool that takes ``--device``, is ``cuda``
when torch sees a GPU, else ``cpu``. ``--checkpoint`` takes a training checkpoint of ``python -m timm_attnconv.train``
(``last.pth.tar``) or a ``.safetensors`` weights file, says on stderr which it read, and must hold ``--model``.
"""
import argparse
import ctypes
import json
import math
import os
import platform
import sys
import traceback
from typing import Any, Callable, Dict, NoReturn, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .constants import CONFIG_FILE

__all__ = ['UsageError', 'run', 'fail', 'prog', 'parser', 'positive_int', 'non_negative_int', 'positive_float',
           'non_negative_float', 'probability', 'json_object', 'check_value', 'weights_path', 'model_name', 'device',
           'missing_device', 'create_model', 'tune_for_device', 'keep_freed_memory', 'add_model_args',
           'add_data_dir_arg', 'add_test_set_args', 'add_device_arg', 'load_model', 'load_test_split', 'print_result']

DEBUG_ENV = 'TIMM_ATTNCONV_DEBUG'
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# glibc's malloc settings (malloc.h's mallopt parameters) and the variables through which a user sets them
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
MALLOC_ENV = ('MALLOC_MMAP_MAX_', 'MALLOC_TRIM_THRESHOLD_', 'GLIBC_TUNABLES')
# faults of an input or a run that a tool reports in one line; any other exception is a bug
INPUT_ERRORS = (ValueError, OSError, RuntimeError, FloatingPointError)
LIST_MODELS = '`python -c "import timm_attnconv; print(timm_attnconv.list_models())"` lists this package\'s models'
# --checkpoint reads a file of this suffix as weights, any other as a training checkpoint
WEIGHTS_SUFFIX = '.safetensors'


class UsageError(ValueError):
    """A bad argument or combination of arguments: a command reports it in one line with exit status 2."""


def prog(module: str) -> str:
    """``'timm_attnconv.predict'`` → ``'python -m timm_attnconv.predict'``, the name a tool's messages start with."""
    return f"python -m {module.removesuffix('.__main__')}"


def fail(program: str, message: str, status: int = 2) -> NoReturn:
    sys.stderr.write(f'{program}: error: {message}\n')
    raise SystemExit(status)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        # a long option's prefix is not taken for it (argparse's default): `flops --model NAME` was read as
        # --model-kwargs NAME, `train --eval 5` as --eval-every 5; subcommands' parsers are made here too
        kwargs.setdefault('allow_abbrev', False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed = super().parse_args(args, namespace)
        # checked on the parsed value, not per occurrence: a later --device overrides a recipe's earlier one that this
        # machine lacks (training/gpu/launch.sh on a CPU)
        missing = missing_device(parsed.device) if 'device' in vars(parsed) else None
        if missing:
            self.error(f'argument --device: {missing}')
        return parsed

    def error(self, message: str) -> NoReturn:
        # one line like every other failure of the tools (argparse would print the usage first); --help has it
        fail(self.prog, f'{message} (--help lists the options)')


def parser(module: str, description: str) -> argparse.ArgumentParser:
    """The argument parser of the tool ``module`` (its ``__spec__.name``)."""
    return _Parser(prog=prog(module), description=description)


def run(main: Callable[[Optional[Sequence[str]]], Any], argv: Optional[Sequence[str]] = None) -> Any:
    """Run a tool's ``main(argv)`` as a command: see the module docstring. Returns what ``main`` returns."""
    program = prog(sys.modules[main.__module__].__spec__.name)
    try:
        return main(argv)
    except KeyboardInterrupt:
        fail(program, 'interrupted', 130)
    except INPUT_ERRORS as error:
        if os.environ.get(DEBUG_ENV):
            raise
        fail(program, _one_line(error), 2 if isinstance(error, UsageError) else 1)


def _one_line(error: BaseException) -> str:
    message = ' '.join(str(error).split())
    frames = traceback.extract_tb(error.__traceback__)
    if frames and frames[-1].filename.startswith(PACKAGE_DIR):
        return message  # written for the user, with the fix
    # torch's, timm's or PIL's words: name the kind, and where the whole story is
    return f'{type(error).__name__}: {message} ({DEBUG_ENV}=1 shows the traceback)'


def _checked(convert: Callable[[str], Any], accept: Callable[[Any], bool], wanted: str,
             given_as: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An option's check: called on the command line's text (argparse's ``type``) and, as ``check.value``, on a value
    given in Python, which must be of the option's kind (``given_as``) as it is: no text, no bool for a number."""
    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'expected {wanted}, got {text!r}') from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f'expected {wanted}, got {text!r}')
        return value

    def value(given: Any) -> Any:
        if not (given_as(given) and accept(given)):
            raise argparse.ArgumentTypeError(f'expected {wanted}, got {given!r}')
        return given
    check.value = value
    return check


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_json(value: Any) -> bool:
    """Whether JSON keeps ``value`` as it is (lists, not tuples; no objects): run configs record options as JSON."""
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        return False


positive_int = _checked(int, lambda v: v >= 1, 'a whole number ≥ 1', _is_int)
non_negative_int = _checked(int, lambda v: v >= 0, 'a whole number ≥ 0', _is_int)
positive_float = _checked(float, lambda v: 0 < v < math.inf, 'a finite number > 0', _is_number)
non_negative_float = _checked(float, lambda v: 0 <= v < math.inf, 'a finite number ≥ 0', _is_number)
probability = _checked(float, lambda v: 0 <= v < 1, 'a number in [0, 1)', _is_number)
positive_ints = _checked(lambda text: tuple(int(part) for part in text.split(',')), lambda v: all(n >= 1 for n in v),
                         'whole numbers ≥ 1 separated by commas, such as 7,5,8,7,3,9',
                         lambda v: isinstance(v, (tuple, list)) and all(map(_is_int, v)))
json_object = _checked(json.loads, lambda v: isinstance(v, dict), 'a JSON object such as \'{"drop_rate": 0.1}\'',
                       _is_json)


def check_value(name: str, check: Any, value: Any) -> Any:
    """``value``, given in Python for the option ``name``, through the check of its command line (a validator above,
    :func:`model_name`, :func:`device` or a tuple of choices): what it stands for, or a :class:`UsageError` naming
    ``name`` and what it takes, so that a library call refuses what the command refuses."""
    if isinstance(check, tuple):
        if value in check:
            return value
        raise UsageError(f"{name}: expected one of {', '.join(map(repr, check))}, got {value!r}")
    try:
        if hasattr(check, 'value'):
            return check.value(value)
        if isinstance(value, str):  # model_name, device: a name as on the command line
            return check(value)
        problem = f'expected a string, got {value!r}'
    except argparse.ArgumentTypeError as e:
        problem = str(e)
    raise UsageError(f'{name}: {problem}')


def model_name(text: str) -> str:
    """A name ``timm.create_model`` knows (this package's models, timm's own, with or without a pretrained tag)."""
    import timm  # this package's models are registered: importing this module imported the package
    if not timm.is_model(text):
        raise argparse.ArgumentTypeError(f'unknown model {text!r}: {LIST_MODELS}')
    return text


def device(text: str) -> str:
    """``auto``: ``cuda`` when torch sees a GPU, else ``cpu``; any other torch device string (the parser checks that
    the device is there)."""
    if text == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f'{text!r} is not a torch device: pass auto, cpu, cuda or cuda:N') from None
    return text


def missing_device(name: str) -> Optional[str]:
    """What is wrong with a device this machine lacks (a CUDA device torch does not see); None if it has it."""
    chosen = torch.device(name)
    if chosen.type == 'cuda' and (chosen.index or 0) >= torch.cuda.device_count():
        return (f'{name}: torch sees {torch.cuda.device_count()} CUDA device(s) here; pass --device cpu, or auto (cuda '
                f'where there is one)')
    return None


def create_model(name: str, option: str, option_kwargs: Dict[str, Any], **kwargs) -> nn.Module:
    """``timm.create_model(name, **kwargs, **option_kwargs)``; a keyword that the model does not take is refused
    naming ``option``, the option that passed ``option_kwargs``, and so is one that the command sets itself."""
    import timm
    both = {k: kwargs[k] for k in option_kwargs if k in kwargs}
    if both:
        raise UsageError(f"{option} {json.dumps(option_kwargs)}: this command sets "
                         f"{', '.join(f'{k}={v!r}' for k, v in both.items())} itself; drop it from {option} (or set "
                         f"it with the command's own option where it has one, such as --num-classes)")
    try:
        return timm.create_model(name, **kwargs, **option_kwargs)
    except TypeError as e:
        if 'keyword argument' not in str(e):
            raise
        raise UsageError(f'{name} does not take {option} {json.dumps(option_kwargs)}: {e}') from e


def tune_for_device(device: torch.device) -> None:
    """On CUDA, let cuDNN time its algorithms for each convolution shape it meets (``torch.backends.cudnn.benchmark``),
    as timm's own ``benchmark.py``, ``train.py`` and ``validate.py`` do. The families have convolutions whose shapes
    cuDNN's heuristics are not tuned for: AA's narrowed convolution branches (120, 232, 464 channels in
    AA-ResNet-50) and EA's 3×3 over ``N × N`` maps with the heads as channels (6 in EA-DeiT-S)."""
    if torch.device(device).type == 'cuda':
        torch.backends.cudnn.benchmark = True


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory that freed tensors give back, for the next ones, in a tool's own process.

    glibc maps every block over 32 MB afresh and unmaps it when it is freed, so that the next one is faulted in and
    zeroed again, page by page. The attention maps of these models are such blocks, made and freed in every layer
    of every batch (``(64, 9, 256, 256)`` floats, 151 MB, in each layer of the content models at batch 64), and on
    the CPU the page faults took about half of an EA twin's training step (README, "Training and evaluation"). Here
    malloc serves large blocks from its heap and hands the heap's top back only past 2 GiB free (``mallopt``:
    ``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` 2 GiB): faster, for a higher peak of memory held. Results are unchanged.

    Called by the training, evaluation and staging commands, not by the library: a program that imports the models
    keeps its own allocator. Returns whether it applied; it does not where the C library is not glibc, nor where the
    environment sets malloc itself (``MALLOC_MMAP_MAX_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``: e.g.
    ``MALLOC_MMAP_MAX_=65536``, glibc's default, keeps malloc as it was)."""
    if platform.libc_ver()[0] != 'glibc' or any(name in os.environ for name in MALLOC_ENV):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--device', type=device, default='auto',
                        help='torch device; auto (default): cuda when torch sees a GPU, else cpu')


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` and where its weights come from: random init, ``--pretrained`` or a ``--checkpoint``."""
    parser.add_argument('--model', required=True, type=model_name)
    source = parser.add_mutually_exclusive_group()
    source.add_argument('--pretrained', action='store_true', help='load the registered pretrained weights')
    source.add_argument('--checkpoint', default=None,
                        help='a training checkpoint of `python -m timm_attnconv.train` (last.pth.tar) or a '
                             '.safetensors weights file, of --model')
    parser.add_argument('--ema', action='store_true', help='the EMA weights of a training --checkpoint')
    parser.add_argument('--model-kwargs', type=json_object, default={},
                        help='JSON dict for timm.create_model, e.g. \'{"num_heads": [9, 9, 9, 9, 9, 8]}\' for pruned '
                             'weights')


def add_data_dir_arg(parser: argparse.ArgumentParser, files: str = 'test.npz', use: str = '') -> None:
    """``--data-dir``, one help text for every tool that reads CIFAR-10: what the folder holds and where it defaults
    to. ``files``: the npz files this tool reads; ``use``: what the tool reads them for, when that needs saying."""
    from .data import CIFAR10_DIR_ENV
    parser.add_argument('--data-dir', default=None,
                        help=f'CIFAR-10 folder with {files} (any number of images) or cifar-10-batches-py{use}; '
                             f'default ${CIFAR10_DIR_ENV} when set, else ../shared/data/cifar10 beside the source '
                             f'checkout')


def add_test_set_args(parser: argparse.ArgumentParser) -> None:
    """The options of a tool that measures a model on the CIFAR-10 test split: the model (:func:`add_model_args`),
    the data, the device and ``--json``."""
    add_model_args(parser)
    add_data_dir_arg(parser)
    parser.add_argument('--limit', type=positive_int, default=None, help='first N test images only')
    parser.add_argument('--batch-size', type=positive_int, default=500)
    add_device_arg(parser)
    parser.add_argument('--json', default=None, help='also write the result to this file')


def load_model(args: argparse.Namespace, **kwargs) -> nn.Module:
    """The model named by ``--model``: random init, its ``--pretrained`` weights, or a ``--checkpoint`` of either
    kind (which one it read goes to stderr); a checkpoint of another architecture is refused. ``--model-kwargs`` and
    ``kwargs`` (a tool's own options, such as ``--num-classes``) go to ``timm.create_model`` (a training checkpoint
    records its own)."""
    if args.ema and not _is_training_checkpoint(args.checkpoint):
        raise UsageError('--ema needs a training checkpoint (last.pth.tar of a run with --model-ema) as --checkpoint')
    if args.checkpoint is None:
        return create_model(args.model, '--model-kwargs', args.model_kwargs, pretrained=args.pretrained, **kwargs)
    if not os.path.isfile(args.checkpoint):
        raise UsageError(f'--checkpoint {args.checkpoint!r}: no such file')
    if _is_training_checkpoint(args.checkpoint):
        return _from_training_checkpoint(args, dict(args.model_kwargs, **kwargs))
    return _from_weights_file(args.checkpoint, args.model, args.model_kwargs, kwargs)


def _is_training_checkpoint(path: Optional[str]) -> bool:
    return path is not None and not path.endswith(WEIGHTS_SUFFIX)


def weights_path(text: str) -> str:
    """A file name for weights that the tools read back: ``--checkpoint`` tells weights from a training checkpoint by
    the ``.safetensors`` suffix."""
    if not text.endswith(WEIGHTS_SUFFIX):
        raise argparse.ArgumentTypeError(f'expected a file name ending in {WEIGHTS_SUFFIX}, as the tools read weights '
                                         f'files, got {text!r}')
    return text


def _from_training_checkpoint(args: argparse.Namespace, kwargs: Dict[str, Any]) -> nn.Module:
    from .runs import load_training_checkpoint
    if kwargs:
        raise UsageError(f"{', '.join(kwargs)} cannot change the model of a training checkpoint, which records its "
                         f'own settings: drop it, or pass a .safetensors weights file')
    model = load_training_checkpoint(args.checkpoint, use_ema=args.ema, model_name=args.model)
    print(f"read {'the EMA weights of ' if args.ema else ''}training checkpoint {args.checkpoint}", file=sys.stderr)
    return model


def _from_weights_file(path: str, name: str, model_kwargs: Dict[str, Any], kwargs: Dict[str, Any]) -> nn.Module:
    holds = _declared_architecture(path)
    if holds is not None and holds.split('.')[0] != name.split('.')[0]:
        raise UsageError(f'{path!r} holds {holds} weights (says the config.json beside it), not {name}: pass '
                         f'--model {holds}')
    file_keys, file_metadata = _read_header(path)
    every_kwarg = dict(model_kwargs, **kwargs)
    # the file's head is as wide as num_classes says: else timm would drop it for a random one
    overlay = dict(file=path, **{k: v for k, v in every_kwarg.items() if k == 'num_classes'})
    try:
        model = create_model(name, '--model-kwargs', model_kwargs, pretrained=True, pretrained_cfg_overlay=overlay,
                             **kwargs)
    except RuntimeError as e:
        if 'loading state_dict' not in str(e):
            raise
        raise UsageError(_misfit(path, name, every_kwarg, file_keys, file_metadata)) from e
    print(f'read weights file {path}', file=sys.stderr)
    return model


def _declared_architecture(path: str) -> Optional[str]:
    """The architecture named by the ``config.json`` beside a weights file: a staged folder's (``architecture``) or a
    run's (``model``, as ``transfer join`` writes it); None without one."""
    config_path = os.path.join(os.path.dirname(path), CONFIG_FILE)  # the run's RUN_CONFIG has the same name
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError:
            return None  # not ours to judge: the weights themselves are checked against the model next
    return (config.get('architecture') or config.get('model')) if isinstance(config, dict) else None


def _read_header(path: str) -> Tuple[set, Dict[str, str]]:
    """The names of the tensors in a ``.safetensors`` file, and its metadata."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, 'pt') as f:
            return set(f.keys()), f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f'cannot read {path!r} as a .safetensors weights file ({e}): it is truncated or not a weights '
                         f'file. Copy it again, or pass the file it should be') from e


def _misfit(path: str, name: str, kwargs: Dict[str, Any], file_keys: set, file_metadata: Dict[str, str]) -> str:
    import timm
    model_keys = set(timm.create_model(name, **kwargs).state_dict())
    missing, foreign = sorted(model_keys - file_keys), sorted(file_keys - model_keys)
    if missing or foreign:
        detail = (f'{len(missing)} of its tensors are missing from the file and {len(foreign)} of the file\'s are '
                  f"not its (e.g. {(foreign or missing)[0]!r})")
    else:
        detail = 'the file\'s tensors have other shapes (another num_classes or other model settings)'
    fix = 'Pass the --model (and --model-kwargs) the file was saved from'
    if 'num_heads' in file_metadata:  # pruned weights (python -m timm_attnconv.prune --out) say their heads
        fix += f' (pruned weights: --model-kwargs \'{{"num_heads": {file_metadata["num_heads"]}}}\')'
    return f'{path!r} does not fit {name}: {detail}. {fix}'


def load_test_split(args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    """The CIFAR-10 test images and labels of ``--data-dir``, the first ``--limit`` of them."""
    from .data import load_cifar10
    images, labels = load_cifar10(args.data_dir, 'test')
    return images[:args.limit], labels[:args.limit]


def print_result(result: Dict[str, Any], json_path: Optional[str] = None, indent: Optional[int] = None) -> None:
    """Print ``result`` as JSON and, given ``json_path``, write it there too."""
    print(json.dumps(result, indent=indent))
    if json_path:
        with open(json_path, 'w') as f:
            json.dump(result, f, indent=2)
