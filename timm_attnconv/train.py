"""Train any registered model on CIFAR-10 with timm's optimizer, scheduler, loss and EMA factories.

    python -m timm_attnconv.train --model sa_quadratic_tiny_cifar --output runs/sa_quadratic_tiny_cifar
    torchrun --nproc_per_node 4 -m timm_attnconv.train --model sa_quadratic_cifar --output runs/x --batch-size 256

Every epoch ends with an atomic checkpoint ``<output>/last.pth.tar`` (model, optimizer, scheduler, EMA, RNG, epoch and
step, the run's log and a sha256 digest of all of it) and, every ``--eval-every`` epochs and after the last, a test-set
evaluation (of the EMA too with ``--eval-ema``, else after the last epoch only); ``<output>/log.jsonl``, one
strict-JSON line per epoch, is then rewritten from the checkpoint, so a kill at any moment loses no line. Running the
same command again resumes exactly where the last checkpoint left off; options that would change the result are
refused, and so is a checkpoint that no longer matches its digest. Ctrl-C or SIGTERM stops at the next step and writes
a checkpoint first. A NaN or infinite loss, weight or test loss stops the run before it saves, so the last good
checkpoint stays. One run at a time holds an output folder (``train.lock``). Batches come from
:class:`timm_attnconv.data.EpochBatches`, which fixes every batch by ``(seed, epoch, step)``, so a resumed run sees the
same data as an uninterrupted one.

The data set lives on the device, where batches are picked and augmented, and a step makes the host wait for the
device only every ``--log-interval`` steps (loss check, progress bar), so a GPU is not left idle between steps.

Under torchrun every process trains on its share of each batch with DistributedDataParallel (NCCL on CUDA, gloo on the
CPU): ``--batch-size`` is the global batch, so N processes compute what one process does, up to float rounding and
their own dropout masks (BatchNorm, though, normalises each process's share). Rank 0 holds the lock, evaluates and
writes checkpoint and log; the checkpoint keeps every process's random state, so the run resumes exactly with the same
number of processes, and refuses another (the run config records ``world_size``). Processes stop on a signal together,
at the next ``--log-interval`` step.
"""
import argparse
import hashlib
import json
import math
import os
import signal
import time
from contextlib import contextmanager, nullcontext
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from tqdm import tqdm

from . import cli
from .constants import AMP_DTYPES, CHECKPOINT, LOG
from .data import EpochBatches, load_cifar10, normalize
from .evaluate import evaluate
from .runs import checkpoint_digest, read_checkpoint

__all__ = ['main']

LOCK = 'train.lock'
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
DIVERGED_FIX = ('running the same command again repeats it; start over with another --output and a lower --lr, '
                '--clip-grad (e.g. 1.0) or more --warmup-epochs')


def _parser() -> argparse.ArgumentParser:
    p = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    p.add_argument('--model', required=True, type=cli.model_name)
    p.add_argument('--model-kwargs', type=cli.json_object, default={}, help='JSON dict for timm.create_model')
    p.add_argument('--init-from', default=None,
                   help='start from these pretrained weights (e.g. sa_learned_tiny_cifar.c10) or .safetensors file '
                        'instead of a random init; a model of another layout must support it '
                        '(SelfAttentionNet.init_from)')
    cli.add_data_dir_arg(p, 'train.npz / test.npz')
    p.add_argument('--output', required=True, help='run folder: checkpoint, log.jsonl')
    p.add_argument('--epochs', type=cli.positive_int, default=30)
    p.add_argument('--batch-size', type=cli.positive_int, default=128)
    p.add_argument('--opt', default='adamw', help='timm optimizer name')
    p.add_argument('--lr', type=cli.non_negative_float, default=2e-3)
    p.add_argument('--weight-decay', type=cli.non_negative_float, default=0.05)
    p.add_argument('--sched', default='cosine', help='timm scheduler name')
    p.add_argument('--warmup-epochs', type=cli.non_negative_int, default=1)
    p.add_argument('--min-lr', type=cli.non_negative_float, default=1e-5)
    p.add_argument('--smoothing', type=cli.probability, default=0.1, help='label smoothing')
    p.add_argument('--clip-grad', type=cli.positive_float, default=None, help='clip the gradient norm to this value')
    p.add_argument('--model-ema', action='store_true', help='keep an EMA of the weights (timm ModelEmaV3)')
    p.add_argument('--model-ema-decay', type=cli.probability, default=0.999)
    p.add_argument('--amp', choices=tuple(AMP_DTYPES), default='none',
                   help='autocast dtype (bf16 pays off only on CPUs with bf16 units and on GPUs)')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--compile', action='store_true', help='torch.compile the model')
    cli.add_device_arg(p)
    p.add_argument('--seed', type=cli.non_negative_int, default=42)
    p.add_argument('--train-limit', type=cli.positive_int, default=None,
                   help='first N training images only (smoke tests)')
    p.add_argument('--eval-limit', type=cli.positive_int, default=None,
                   help='first N test images only (smoke tests); fixed for the run, so its log compares like with like')
    p.add_argument('--max-steps', type=cli.positive_int, default=None,
                   help='stop (with a checkpoint) after this many steps')
    p.add_argument('--eval-every', type=cli.positive_int, default=1,
                   help='test the weights every N epochs and after the last; the log line of an epoch without a test '
                        'has no test_* keys')
    p.add_argument('--eval-ema', action='store_true',
                   help='test the EMA weights at every test of the weights, not only after the last epoch')
    p.add_argument('--log-interval', type=cli.positive_int, default=50,
                   help='check the training loss and update the progress bar every N steps: the only points in '
                        'an epoch where the host waits for the device')
    p.add_argument('--no-resume', action='store_true', help='refuse to start if the output holds a checkpoint')
    return p


class _StopFlag:
    """Set by SIGINT / SIGTERM; the loop checks it between steps so the checkpoint it writes is consistent."""

    def __init__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextmanager
def _exclusive(output: str) -> Iterator[None]:
    """Hold ``<output>/train.lock`` while a run uses the folder, so that a second run fails at once instead of
    interleaving checkpoints and log lines. The OS drops the lock with the process: a killed run leaves nothing to
    clean up. The file stays (deleting it would let two runs lock two different files)."""
    import fcntl  # POSIX only
    with open(os.path.join(output, LOCK), 'a+') as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            raise RuntimeError(f"another training run{f' (pid {holder})' if holder else ''} is using {output!r} "
                               f'(it holds {LOCK}); wait for it to finish or pass another --output') from None
        f.seek(0)
        f.truncate()
        f.write(f'{os.getpid()}\n')
        f.flush()
        yield


def _atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through a temporary file, synced to disk, then renamed over it: a reader, or a run killed at any
    moment, sees the old file or the new one, never a part of either."""
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_log(entries: List[Dict[str, Any]], path: str) -> None:
    """``log.jsonl`` as the checkpoint records it: one strict-JSON line (no NaN) per finished epoch."""
    text = ''.join(json.dumps(entry, allow_nan=False) + '\n' for entry in entries)
    _atomic_write(path, lambda f: f.write(text.encode()))


def _logged_epochs(state: Dict[str, Any], log_path: str) -> List[Dict[str, Any]]:
    """The log entries of the epochs a checkpoint has finished: its own record or, for a checkpoint written before it
    carried one, those lines of ``log.jsonl``."""
    if 'log' in state:
        return state['log']
    if not os.path.isfile(log_path):
        return []
    with open(log_path) as f:
        return [entry for entry in map(json.loads, filter(str.strip, f)) if entry['epoch'] <= state['epoch']]


def _data_digest(images: torch.Tensor, labels: torch.Tensor) -> str:
    h = hashlib.sha256(images.contiguous().numpy())
    h.update(labels.contiguous().numpy())
    return h.hexdigest()[:16]


def _non_finite(obj: Any, name: str = '') -> Optional[str]:
    """``'<name> = nan'`` for the first NaN or infinity in ``obj`` (tensors and floats, in nested dicts and lists)."""
    if isinstance(obj, torch.Tensor):
        return f'{name} holds NaN or inf' if obj.is_floating_point() and not torch.isfinite(obj).all() else None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else f'{name} = {obj}'
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite(value, f'{name}.{key}' if name else str(key))
        if found:
            return found
    return None


def _refuse_non_finite(obj: Any, when: str, ckpt_path: str) -> None:
    """Stop a diverged run before it saves: its checkpoint would replace the last good one with NaN or inf."""
    problem = _non_finite(obj)
    if problem:
        kept = f'{ckpt_path!r} keeps the last good state' if os.path.isfile(ckpt_path) else 'there is no checkpoint'
        raise FloatingPointError(f'the run diverged in {when}: {problem}. Nothing was saved ({kept}); {DIVERGED_FIX}')


def _config(args: argparse.Namespace, data: Dict[str, str], world_size: int) -> Dict[str, Any]:
    return dict({k: getattr(args, k) for k in RESUME_KEYS}, **data, world_size=world_size)


def initial_model(config: Dict[str, Any]) -> nn.Module:
    """The model exactly as a run with ``config`` starts: torch's RNG seeded with ``config['seed']``, then built."""
    torch.manual_seed(config['seed'])
    # the same model as runs.build_model, with a kwarg the model does not take named as the option that passed it
    return cli.create_model(config['model'], '--model-kwargs', config['model_kwargs'], num_classes=10)


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


def _check_resumable(saved: Dict[str, Any], config: Dict[str, Any], path: str) -> None:
    defaults = {k: _parser().get_default(k) for k in RESUME_KEYS}
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


def _note_runtime_change(before: Optional[Dict[str, Any]], now: Dict[str, Any]) -> None:
    changed = [f'{k} {now[k]} (was {before[k]})' for k in RUNTIME_KEYS if before and before.get(k) != now[k]]
    if changed:
        print(f"note: resumed with {', '.join(changed)}: results change by float rounding only, so the run need not "
              f'match an uninterrupted one bit for bit')


def _load_data(args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    train_x, train_y = load_cifar10(args.data_dir, 'train')
    test_x, test_y = load_cifar10(args.data_dir, 'test')
    train_limit, eval_limit = args.train_limit or None, args.eval_limit or None
    return train_x[:train_limit], train_y[:train_limit], test_x[:eval_limit], test_y[:eval_limit]


def _launch() -> Tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` of this process: as torchrun set them, else ``(0, 1, 0)``."""
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if world == 1:
        return 0, 1, 0
    return int(os.environ['RANK']), world, int(os.environ['LOCAL_RANK'])


def _device(name: str, local_rank: int, world: int) -> torch.device:
    device = torch.device(name)
    if device.type == 'cuda' and world > 1:  # one GPU per process
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
    return device


def train(args: argparse.Namespace) -> Dict[str, Any]:
    rank, world, local_rank = _launch()
    device = _device(args.device, local_rank, world)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    try:
        os.makedirs(args.output, exist_ok=True)
        with _exclusive(args.output) if rank == 0 else nullcontext():
            if world > 1:
                dist.barrier()  # the other processes start once rank 0 holds the folder
            return _train(args, device, rank, world)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _sum_over_processes(tensor: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor


def _gather(obj: Any, world: int) -> List[Any]:
    """``obj`` of every process, by rank."""
    if world == 1:
        return [obj]
    import torch.distributed as dist
    objs = [None] * world
    dist.all_gather_object(objs, obj)
    return objs


def _process_state(device: torch.device, loss_sum: torch.Tensor) -> Dict[str, Any]:
    """What differs between the processes of a run: their RNG streams (dropout; the CUDA one too, which a compiled
    model's dropout draws from) and their share of the epoch's training loss so far."""
    return dict(rng=torch.get_rng_state(), loss_sum=loss_sum.item(),
                cuda_rng=torch.cuda.get_rng_state(device) if device.type == 'cuda' else None)


def _restore_process_state(state: Dict[str, Any], device: torch.device) -> float:
    torch.set_rng_state(state['rng'])
    if device.type == 'cuda' and state.get('cuda_rng') is not None:
        torch.cuda.set_rng_state(state['cuda_rng'], device)
    return state['loss_sum']


def _evaluates(args: argparse.Namespace, epoch: int) -> Tuple[bool, bool]:
    """Whether epoch ``epoch`` (1-based) ends with a test of the weights, and of the EMA: every ``--eval-every``
    epochs and after the last; the EMA with ``--eval-ema``, else after the last epoch only."""
    last = epoch == args.epochs
    weights = last or epoch % args.eval_every == 0
    return weights, bool(args.model_ema) and (last or (weights and args.eval_ema))


def _train(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> Dict[str, Any]:
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    ckpt_path, log_path = os.path.join(args.output, CHECKPOINT), os.path.join(args.output, LOG)
    train_x, train_y, test_x, test_y = _load_data(args)
    config = _config(args, dict(train_data=_data_digest(train_x, train_y), test_data=_data_digest(test_x, test_y)),
                     world)
    # the whole data set lives on the device: batches are picked and augmented there (EpochBatches)
    train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))
    runtime = {k: getattr(args, k) for k in RUNTIME_KEYS}

    model = initial_model(config)  # seeds torch's RNG for the whole run
    if args.init_from and not os.path.isfile(ckpt_path):
        init_from_pretrained(model, args.init_from)
    if rank:  # each process its own dropout masks; rank 0 draws as a single process does
        torch.manual_seed(args.seed * 1_000_003 + rank)
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    mean, std = (torch.tensor(model.pretrained_cfg[k], device=device) for k in ('mean', 'std'))
    batches = EpochBatches(train_x, train_y, args.batch_size, args.seed, 0, rank=rank, world_size=world)
    steps_per_epoch = len(batches)
    if steps_per_epoch == 0:
        raise ValueError(f'{train_y.shape[0]} training images make no batch of {args.batch_size}')
    optimizer = create_optimizer_v2(model, args.opt, lr=args.lr, weight_decay=args.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer, args.sched, num_epochs=args.epochs, warmup_epochs=args.warmup_epochs, min_lr=args.min_lr,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema and rank == 0 else None
    criterion = LabelSmoothingCrossEntropy(args.smoothing) if args.smoothing > 0 else nn.CrossEntropyLoss()
    amp_dtype = AMP_DTYPES[args.amp]
    grad_scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None

    epoch, step_in_epoch, global_step, log = 0, 0, 0, []
    # the epoch's loss so far, summed on the device: reading it makes the host wait for the device
    loss_sum, loss_images = torch.zeros((), dtype=torch.float64, device=device), 0
    if os.path.isfile(ckpt_path):
        if args.no_resume:
            raise FileExistsError(f'{ckpt_path!r} exists and --no-resume was given')
        state = read_checkpoint(ckpt_path)
        _check_resumable(state['config'], config, ckpt_path)
        log = _logged_epochs(state, log_path)
        problem = _non_finite(dict(state, log=log))
        if problem:  # saved by a trainer from before the divergence check
            raise FloatingPointError(f'{ckpt_path!r} holds {problem}: it was saved after the run diverged; '
                                     f'{DIVERGED_FIX}')
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        scheduler.load_state_dict(state['scheduler'])
        if ema is not None:
            ema.load_state_dict(state['ema'])
        if grad_scaler is not None and state.get('scaler') is not None:
            grad_scaler.load_state_dict(state['scaler'])
        # a checkpoint from before it kept one state per process was written by a single process
        processes = state.get('processes') or [dict(rng=state['rng'], loss_sum=state.get('loss_sum', 0.))]
        loss_sum.fill_(_restore_process_state(processes[rank], device))
        epoch, step_in_epoch, global_step = state['epoch'], state['step_in_epoch'], state['global_step']
        loss_images = state.get('loss_images', 0)
        if rank == 0:
            _write_log(log, log_path)  # a kill between the checkpoint's rename and the log's left the log a line short
            _note_runtime_change(state.get('runtime'), runtime)
            print(f'resumed {ckpt_path}: {epoch} epochs and {step_in_epoch} steps done')
    elif os.path.isfile(log_path):
        raise FileExistsError(f'{log_path!r} exists without a checkpoint beside it: it is the log of another run. Move '
                              f'it away or pass another --output')
    else:
        scheduler.step_update(0)
    forward = model
    if world > 1:
        forward = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == 'cuda' else None)
    if args.compile:
        forward = torch.compile(forward)

    def save(when: str) -> None:
        processes = _gather(_process_state(device, loss_sum), world)
        if rank != 0:
            return
        state = dict(
            config=config, epoch=epoch, step_in_epoch=step_in_epoch, global_step=global_step, loss_images=loss_images,
            model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
            ema=ema.state_dict() if ema is not None else None,
            scaler=grad_scaler.state_dict() if grad_scaler is not None else None,
            processes=processes, runtime=runtime, log=log)
        _refuse_non_finite(state, when, ckpt_path)
        state['sha256'] = checkpoint_digest(state)
        _atomic_write(ckpt_path, lambda f: torch.save(state, f))
        _write_log(log, log_path)  # after the checkpoint, which holds the log: a kill in between loses no line

    def progress(stop_requested: bool) -> Tuple[float, bool]:
        """The epoch's mean training loss so far, over all processes, and whether any process was asked to stop. The
        host waits for the device here, so a step calls it only every --log-interval steps."""
        flags = torch.stack([loss_sum, torch.full_like(loss_sum, float(stop_requested))])
        total, stops = _sum_over_processes(flags, world).tolist()
        return total / max(loss_images, 1), stops > 0

    stop = _StopFlag()
    result: Dict[str, Any] = dict(stopped=False, epoch=epoch)
    try:
        while epoch < args.epochs:
            model.train()
            batches = EpochBatches(train_x, train_y, args.batch_size, args.seed, epoch, rank=rank, world_size=world)
            bar = tqdm(total=len(batches), initial=step_in_epoch, desc=f'epoch {epoch + 1}/{args.epochs}',
                       unit='batch', dynamic_ncols=True, disable=rank != 0)
            seen, start, stop_agreed = 0, time.perf_counter(), False
            for images, labels in batches.iterate(step_in_epoch):
                x = normalize(images, mean, std)
                if args.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = criterion(forward(x), labels)
                optimizer.zero_grad(set_to_none=True)
                if grad_scaler is not None:
                    grad_scaler.scale(loss).backward()
                    grad_scaler.unscale_(optimizer)
                else:
                    loss.backward()
                if args.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                if grad_scaler is not None:
                    grad_scaler.step(optimizer)
                    grad_scaler.update()
                else:
                    optimizer.step()
                global_step += 1
                step_in_epoch += 1
                scheduler.step_update(global_step)
                if ema is not None:
                    ema.update(model, step=global_step)
                loss_sum.add_(loss.detach(), alpha=labels.shape[0])
                loss_images += args.batch_size
                seen += args.batch_size
                bar.update()
                if global_step % args.log_interval == 0:
                    mean_loss, stop_agreed = progress(stop.requested)
                    _refuse_non_finite({'the training loss': mean_loss}, f'epoch {epoch + 1} by step {step_in_epoch}',
                                       ckpt_path)
                    bar.set_postfix(loss=f'{mean_loss:.3f}', img_s=f'{seen / (time.perf_counter() - start):.0f}',
                                    lr=f"{optimizer.param_groups[0]['lr']:.2e}")
                # processes stop together: a single one at the next step, those of torchrun when they agreed above
                stopping = stop.requested if world == 1 else stop_agreed
                if stopping or (args.max_steps and global_step >= args.max_steps):
                    bar.close()
                    save(f'epoch {epoch + 1}, step {step_in_epoch}')
                    if rank == 0:
                        print(f'stopped with {epoch} epochs and {step_in_epoch} steps done: checkpoint {ckpt_path}; '
                              f'run the same command to resume')
                    result.update(stopped=True, epoch=epoch, step_in_epoch=step_in_epoch)
                    return result
            bar.close()
            train_loss, _ = progress(False)  # waits for the epoch's steps, so the time below is theirs
            seconds = time.perf_counter() - start
            entry = dict(epoch=epoch + 1, global_step=global_step, train_loss=train_loss,
                         lr=optimizer.param_groups[0]['lr'], train_img_s=seen / seconds, epoch_seconds=seconds)
            test_weights, test_ema = _evaluates(args, epoch + 1)
            if rank == 0 and test_weights:
                entry.update({f'test_{k}': v for k, v in evaluate(model, test_x, test_y).items()})
            if rank == 0 and test_ema:
                entry.update({f'ema_test_{k}': v for k, v in evaluate(ema.module, test_x, test_y).items()})
            entry.update(runtime)
            _refuse_non_finite(entry, f'epoch {epoch + 1}', ckpt_path)
            log.append(entry)
            epoch, step_in_epoch, loss_images = epoch + 1, 0, 0
            loss_sum.zero_()
            save(f'epoch {epoch}')
            if rank == 0:
                print(json.dumps(entry))
            result.update(entry)
        result['epoch'] = epoch
        return result
    finally:
        stop.restore()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return train(_parser().parse_args(argv))


if __name__ == '__main__':
    cli.run(main)
