"""Train any registered model on CIFAR-10 with timm's optimizer, scheduler, loss and EMA factories.

    python -m timm_attnconv.train --model sa_quadratic_tiny_cifar --output runs/sa_quadratic_tiny_cifar
    torchrun --nproc_per_node 4 -m timm_attnconv.train --model sa_quadratic_cifar --output runs/x --batch-size 256

From Python, ``train(TrainConfig(model='sa_quadratic_tiny_cifar', output='runs/x'))`` runs the same: each option is a
field of :class:`~timm_attnconv.train_config.TrainConfig`, with the command's default and check, and ``main(argv)``
parses a command line into one.

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
from dataclasses import MISSING, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from tqdm import tqdm

from . import cli
from .constants import AMP_DTYPES, CHECKPOINT, LOG
from .data import EpochBatches, load_cifar10, normalize
from .evaluate import evaluate
from .runs import logged_epochs, read_checkpoint, save_checkpoint, write_log
from .train_config import RUNTIME_KEYS, TrainConfig, check_resumable, initial_model, option_default

__all__ = ['TrainConfig', 'train', 'main']

LOCK = 'train.lock'
DIVERGED_FIX = ('running the same command again repeats it; start over with another --output and a lower --lr, '
                '--clip-grad (e.g. 1.0) or more --warmup-epochs')


def _parser() -> argparse.ArgumentParser:
    """The command line of :class:`TrainConfig`: an option per field, with the field's default, check and help."""
    p = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    for option in fields(TrainConfig):
        flag, default, meta = f"--{option.name.replace('_', '-')}", option_default(option), option.metadata
        if option.name == 'data_dir':
            cli.add_data_dir_arg(p, 'train.npz / test.npz')
        elif option.name == 'device':
            cli.add_device_arg(p)
        elif isinstance(default, bool):
            p.add_argument(flag, action='store_true', help=meta['help'])
        else:
            check = dict(choices=meta['check']) if isinstance(meta['check'], tuple) else dict(type=meta['check'])
            given = dict(required=True) if default is MISSING else dict(default=default)
            p.add_argument(flag, **check, **given, help=meta['help'])
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


def _note_runtime_change(before: Optional[Dict[str, Any]], now: Dict[str, Any]) -> None:
    changed = [f'{k} {now[k]} (was {before[k]})' for k in RUNTIME_KEYS if before and before.get(k) != now[k]]
    if changed:
        print(f"note: resumed with {', '.join(changed)}: results change by float rounding only, so the run need not "
              f'match an uninterrupted one bit for bit')


def _load_data(config: TrainConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    train_x, train_y = load_cifar10(config.data_dir, 'train')
    test_x, test_y = load_cifar10(config.data_dir, 'test')
    train_limit, eval_limit = config.train_limit or None, config.eval_limit or None
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
    cli.tune_for_device(device)
    return device


def train(config: TrainConfig) -> Dict[str, Any]:
    """Run, or resume, the training run ``config`` describes (see the module docstring); under torchrun, this process's
    share of it. Returns the last epoch's log entry with ``epoch`` and ``stopped`` (and ``step_in_epoch`` when it
    stopped within an epoch)."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f'train() takes a TrainConfig, not {type(config).__name__}: TrainConfig(**vars(args)) turns '
                        f'parsed options into one')
    rank, world, local_rank = _launch()
    device = _device(config.device, local_rank, world)
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    try:
        os.makedirs(config.output, exist_ok=True)
        with _exclusive(config.output) if rank == 0 else nullcontext():
            if world > 1:
                dist.barrier()  # the other processes start once rank 0 holds the folder
            return _train(config, device, rank, world)
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


def _evaluates(config: TrainConfig, epoch: int) -> Tuple[bool, bool]:
    """Whether epoch ``epoch`` (1-based) ends with a test of the weights, and of the EMA: every ``--eval-every``
    epochs and after the last; the EMA with ``--eval-ema``, else after the last epoch only."""
    last = epoch == config.epochs
    weights = last or epoch % config.eval_every == 0
    return weights, bool(config.model_ema) and (last or (weights and config.eval_ema))


def _train(config: TrainConfig, device: torch.device, rank: int, world: int) -> Dict[str, Any]:
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    ckpt_path, log_path = os.path.join(config.output, CHECKPOINT), os.path.join(config.output, LOG)
    train_x, train_y, test_x, test_y = _load_data(config)
    run_config = config.run_config(
        dict(train_data=_data_digest(train_x, train_y), test_data=_data_digest(test_x, test_y)), world)
    # the whole data set lives on the device: batches are picked and augmented there (EpochBatches)
    train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))
    runtime = {k: getattr(config, k) for k in RUNTIME_KEYS}

    # seeds torch's RNG for the whole run; a resumed run's checkpoint replaces the weights, so no warm start to load
    model = initial_model(run_config, warm_start=not os.path.isfile(ckpt_path))
    if rank:  # each process its own dropout masks; rank 0 draws as a single process does
        torch.manual_seed(config.seed * 1_000_003 + rank)
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    mean, std = (torch.tensor(model.pretrained_cfg[k], device=device) for k in ('mean', 'std'))
    batches = EpochBatches(train_x, train_y, config.batch_size, config.seed, 0, rank=rank, world_size=world)
    steps_per_epoch = len(batches)
    if steps_per_epoch == 0:
        raise ValueError(f'{train_y.shape[0]} training images make no batch of {config.batch_size}')
    optimizer = create_optimizer_v2(model, config.opt, lr=config.lr, weight_decay=config.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer, config.sched, num_epochs=config.epochs, warmup_epochs=config.warmup_epochs, min_lr=config.min_lr,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    ema = ModelEmaV3(model, decay=config.model_ema_decay) if config.model_ema and rank == 0 else None
    criterion = LabelSmoothingCrossEntropy(config.smoothing) if config.smoothing > 0 else nn.CrossEntropyLoss()
    amp_dtype = AMP_DTYPES[config.amp]
    grad_scaler = torch.amp.GradScaler(device.type) if config.amp == 'fp16' else None

    epoch, step_in_epoch, global_step, log = 0, 0, 0, []
    # the epoch's loss so far, summed on the device: reading it makes the host wait for the device
    loss_sum, loss_images = torch.zeros((), dtype=torch.float64, device=device), 0
    if os.path.isfile(ckpt_path):
        if config.no_resume:
            raise FileExistsError(f'{ckpt_path!r} exists and --no-resume was given')
        state = read_checkpoint(ckpt_path)
        check_resumable(state['config'], run_config, ckpt_path)
        log = logged_epochs(state, log_path)
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
            write_log(log, log_path)  # a kill between the checkpoint's rename and the log's left the log a line short
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
    if config.compile:
        forward = torch.compile(forward)

    def save(when: str) -> None:
        processes = _gather(_process_state(device, loss_sum), world)
        if rank != 0:
            return
        state = dict(
            config=run_config, epoch=epoch, step_in_epoch=step_in_epoch, global_step=global_step,
            steps_per_epoch=steps_per_epoch, loss_images=loss_images, model=model.state_dict(),
            optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
            ema=ema.state_dict() if ema is not None else None,
            scaler=grad_scaler.state_dict() if grad_scaler is not None else None,
            processes=processes, runtime=runtime, log=log)
        _refuse_non_finite(state, when, ckpt_path)
        save_checkpoint(config.output, state)

    def progress(stop_requested: bool) -> Tuple[float, bool]:
        """The epoch's mean training loss so far, over all processes, and whether any process was asked to stop. The
        host waits for the device here, so a step calls it only every --log-interval steps."""
        flags = torch.stack([loss_sum, torch.full_like(loss_sum, float(stop_requested))])
        total, stops = _sum_over_processes(flags, world).tolist()
        return total / max(loss_images, 1), stops > 0

    stop = _StopFlag()
    result: Dict[str, Any] = dict(stopped=False, epoch=epoch)
    try:
        while epoch < config.epochs:
            model.train()
            batches = EpochBatches(train_x, train_y, config.batch_size, config.seed, epoch, rank=rank, world_size=world)
            bar = tqdm(total=len(batches), initial=step_in_epoch, desc=f'epoch {epoch + 1}/{config.epochs}',
                       unit='batch', dynamic_ncols=True, disable=rank != 0)
            seen, start, stop_agreed = 0, time.perf_counter(), False
            for images, labels in batches.iterate(step_in_epoch):
                x = normalize(images, mean, std)
                if config.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = criterion(forward(x), labels)
                optimizer.zero_grad(set_to_none=True)
                if grad_scaler is not None:
                    grad_scaler.scale(loss).backward()
                    grad_scaler.unscale_(optimizer)
                else:
                    loss.backward()
                if config.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
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
                loss_images += config.batch_size
                seen += config.batch_size
                bar.update()
                if global_step % config.log_interval == 0:
                    mean_loss, stop_agreed = progress(stop.requested)
                    _refuse_non_finite({'the training loss': mean_loss}, f'epoch {epoch + 1} by step {step_in_epoch}',
                                       ckpt_path)
                    bar.set_postfix(loss=f'{mean_loss:.3f}', img_s=f'{seen / (time.perf_counter() - start):.0f}',
                                    lr=f"{optimizer.param_groups[0]['lr']:.2e}")
                # processes stop together: a single one at the next step, those of torchrun when they agreed above
                stopping = stop.requested if world == 1 else stop_agreed
                if stopping or (config.max_steps and global_step >= config.max_steps):
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
            test_weights, test_ema = _evaluates(config, epoch + 1)
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
    return train(TrainConfig(**vars(_parser().parse_args(argv))))


if __name__ == '__main__':
    cli.run(main)
