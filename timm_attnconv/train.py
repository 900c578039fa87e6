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
same command again resumes exactly where the last checkpoint left off (on the same processor and torch, which the log
records: a resume on others is noted, as fp32 kernels may round differently there); options that would change the
result are refused, and so is a checkpoint that no longer matches its digest. Ctrl-C or SIGTERM stops at the next
step and writes a checkpoint first. A NaN or infinite loss, weight or test loss stops the run before it saves, so the
last good checkpoint stays. One run at a time holds an output folder (``train.lock``). Batches come from
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
import platform
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
from .train_config import MACHINE_KEYS, RUNTIME_KEYS, TrainConfig, check_resumable, initial_model, option_default

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


def _cpu_name() -> str:
    # Linux names the model and its instruction sets in /proc/cpuinfo (torch's CPU kernels follow the widest vector
    # unit); elsewhere the architecture alone
    try:
        with open('/proc/cpuinfo') as f:
            first = f.read().split('\n\n')[0]
    except OSError:
        return platform.machine()
    info = {k.strip(): v.strip() for k, v in (line.split(':', 1) for line in first.splitlines() if ':' in line)}
    flags = set(info.get('flags', '').split())
    vector = next((name for flag, name in (('avx512f', 'AVX-512'), ('avx2', 'AVX2')) if flag in flags), None)
    name = info.get('model name', platform.machine())
    return f'{name}, {vector}' if vector else name


def _machine(device: torch.device) -> Dict[str, str]:
    """What a run's rounding depends on besides its options: the processor (the CPU's model and vector unit, or the
    GPU's name) and torch's version, recorded in each log line and the checkpoint."""
    processor = torch.cuda.get_device_name(device) if device.type == 'cuda' else _cpu_name()
    return dict(processor=processor, torch=str(torch.__version__))  # a plain str: checkpoints load weights_only


def _note_runtime_change(before: Optional[Dict[str, Any]], now: Dict[str, Any]) -> None:
    # a checkpoint from before the machine was recorded says nothing of it
    changed = [f'{k} {now[k]!r} (was {before[k]!r})' for k in RUNTIME_KEYS + MACHINE_KEYS
               if before and k in before and before[k] != now[k]]
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


def _evaluates(config: TrainConfig, epoch: int) -> Tuple[bool, bool]:
    """Whether epoch ``epoch`` (1-based) ends with a test of the weights, and of the EMA: every ``--eval-every``
    epochs and after the last; the EMA with ``--eval-ema``, else after the last epoch only."""
    last = epoch == config.epochs
    weights = last or epoch % config.eval_every == 0
    return weights, bool(config.model_ema) and (last or (weights and config.eval_ema))


class _Run:
    """This process's share of a training run: the model with its optimizer, scheduler, EMA and gradient scaler,
    where the run stands (epoch, step, the epoch's loss so far, the log), and what moves it on: a step, the end of an
    epoch, a checkpoint (rank 0 writes it, with every process's random state)."""

    def __init__(self, config: TrainConfig, run_config: Dict[str, Any], device: torch.device, rank: int, world: int,
                 steps_per_epoch: int):
        from timm.loss import LabelSmoothingCrossEntropy
        from timm.optim import create_optimizer_v2
        from timm.scheduler import create_scheduler_v2
        from timm.utils import ModelEmaV3

        self.config, self.run_config, self.device, self.rank, self.world = config, run_config, device, rank, world
        self.ckpt_path, self.log_path = os.path.join(config.output, CHECKPOINT), os.path.join(config.output, LOG)
        self.runtime = dict({k: getattr(config, k) for k in RUNTIME_KEYS}, **_machine(device))
        self.steps_per_epoch = steps_per_epoch
        # seeds torch's RNG for the whole run; a resumed run's checkpoint replaces the weights, so no warm start to load
        model = initial_model(run_config, warm_start=not os.path.isfile(self.ckpt_path))
        if rank:  # each process its own dropout masks; rank 0 draws as a single process does
            torch.manual_seed(config.seed * 1_000_003 + rank)
        model = model.to(device)
        self.model = model.to(memory_format=torch.channels_last) if config.channels_last else model
        self.mean, self.std = (torch.tensor(model.pretrained_cfg[k], device=device) for k in ('mean', 'std'))
        self.optimizer = create_optimizer_v2(model, config.opt, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler, _ = create_scheduler_v2(
            self.optimizer, config.sched, num_epochs=config.epochs, warmup_epochs=config.warmup_epochs,
            min_lr=config.min_lr, step_on_epochs=False, updates_per_epoch=steps_per_epoch)
        self.ema = ModelEmaV3(model, decay=config.model_ema_decay) if config.model_ema and rank == 0 else None
        self.criterion = LabelSmoothingCrossEntropy(config.smoothing) if config.smoothing > 0 else nn.CrossEntropyLoss()
        self.amp_dtype = AMP_DTYPES[config.amp]
        self.grad_scaler = torch.amp.GradScaler(device.type) if config.amp == 'fp16' else None
        self.epoch, self.step_in_epoch, self.global_step, self.loss_images = 0, 0, 0, 0
        # the epoch's loss so far, summed on the device: reading it makes the host wait for the device
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.log: List[Dict[str, Any]] = []

    def resume_or_start(self) -> None:
        """Load the output folder's checkpoint where there is one (refused where it is another run's or diverged),
        else start at step 0."""
        if not os.path.isfile(self.ckpt_path):
            if os.path.isfile(self.log_path):
                raise FileExistsError(f'{self.log_path!r} exists without a checkpoint beside it: it is the log of '
                                      f'another run. Move it away or pass another --output')
            self.scheduler.step_update(0)
            return
        if self.config.no_resume:
            raise FileExistsError(f'{self.ckpt_path!r} exists and --no-resume was given')
        state = read_checkpoint(self.ckpt_path)
        check_resumable(state['config'], self.run_config, self.ckpt_path)
        self.log = logged_epochs(state, self.log_path)
        problem = _non_finite(dict(state, log=self.log))
        if problem:  # saved by a trainer from before the divergence check
            raise FloatingPointError(f'{self.ckpt_path!r} holds {problem}: it was saved after the run diverged; '
                                     f'{DIVERGED_FIX}')
        self.model.load_state_dict(state['model'])
        self.optimizer.load_state_dict(state['optimizer'])
        self.scheduler.load_state_dict(state['scheduler'])
        if self.ema is not None:
            self.ema.load_state_dict(state['ema'])
        if self.grad_scaler is not None and state.get('scaler') is not None:
            self.grad_scaler.load_state_dict(state['scaler'])
        # a checkpoint from before it kept one state per process was written by a single process
        processes = state.get('processes') or [dict(rng=state['rng'], loss_sum=state.get('loss_sum', 0.))]
        own = processes[self.rank]
        torch.set_rng_state(own['rng'])
        if self.device.type == 'cuda' and own.get('cuda_rng') is not None:
            torch.cuda.set_rng_state(own['cuda_rng'], self.device)
        self.loss_sum.fill_(own['loss_sum'])
        self.epoch, self.step_in_epoch, self.global_step = state['epoch'], state['step_in_epoch'], state['global_step']
        self.loss_images = state.get('loss_images', 0)
        if self.rank == 0:
            write_log(self.log, self.log_path)  # a kill between the checkpoint's rename and the log's left it short
            _note_runtime_change(state.get('runtime'), self.runtime)
            print(f'resumed {self.ckpt_path}: {self.epoch} epochs and {self.step_in_epoch} steps done')

    def step(self, forward: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> None:
        """One optimizer step on a batch (``forward``: the model as it trains, parallel or compiled); the loss is
        added to the epoch's on the device, not read."""
        x = normalize(images, self.mean, self.std)
        if self.config.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            loss = self.criterion(forward(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
            self.grad_scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        if self.config.clip_grad:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        self.global_step += 1
        self.step_in_epoch += 1
        self.scheduler.step_update(self.global_step)
        if self.ema is not None:
            self.ema.update(self.model, step=self.global_step)
        self.loss_sum.add_(loss.detach(), alpha=labels.shape[0])
        self.loss_images += self.config.batch_size

    def progress(self, stop_requested: bool) -> Tuple[float, bool]:
        """The epoch's mean training loss so far, over all processes, and whether any process was asked to stop. The
        host waits for the device here, so the loop calls it only every --log-interval steps."""
        flags = torch.stack([self.loss_sum, torch.full_like(self.loss_sum, float(stop_requested))])
        total, stops = _sum_over_processes(flags, self.world).tolist()
        return total / max(self.loss_images, 1), stops > 0

    def end_epoch(self, entry: Dict[str, Any], test_x: torch.Tensor, test_y: torch.Tensor) -> Dict[str, Any]:
        """The epoch's log ``entry`` with the tests it is due (rank 0 runs them), logged, and the run at the next
        epoch; refused before it counts if anything in it is not finite."""
        test_weights, test_ema = _evaluates(self.config, self.epoch + 1)
        # the tests run under the run's autocast, as timm's train.py validates (in fp32, one test of the content model
        # took about 30 s on an H200, longer than its 28 s training epoch: session 46); staging measures in fp32
        if self.rank == 0 and test_weights:
            results = evaluate(self.model, test_x, test_y, amp_dtype=self.amp_dtype)
            entry.update({f'test_{k}': v for k, v in results.items()})
        if self.rank == 0 and test_ema:
            results = evaluate(self.ema.module, test_x, test_y, amp_dtype=self.amp_dtype)
            entry.update({f'ema_test_{k}': v for k, v in results.items()})
        entry.update(self.runtime)
        _refuse_non_finite(entry, f'epoch {self.epoch + 1}', self.ckpt_path)
        self.log.append(entry)
        self.epoch, self.step_in_epoch, self.loss_images = self.epoch + 1, 0, 0
        self.loss_sum.zero_()
        return entry

    def save(self, when: str) -> None:
        """The checkpoint, written by rank 0 with every process's random state and loss share; ``when`` (a point of
        the run) names it if it is refused as not finite."""
        processes = _gather(self._process_state(), self.world)
        if self.rank != 0:
            return
        state = dict(
            config=self.run_config, epoch=self.epoch, step_in_epoch=self.step_in_epoch, global_step=self.global_step,
            steps_per_epoch=self.steps_per_epoch, loss_images=self.loss_images, model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
            ema=self.ema.state_dict() if self.ema is not None else None,
            scaler=self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            processes=processes, runtime=self.runtime, log=self.log)
        _refuse_non_finite(state, when, self.ckpt_path)
        save_checkpoint(self.config.output, state)

    def _process_state(self) -> Dict[str, Any]:
        # what differs between the processes of a run: their RNG streams (dropout; the CUDA one too, which a compiled
        # model's dropout draws from) and their share of the epoch's training loss so far
        return dict(rng=torch.get_rng_state(), loss_sum=self.loss_sum.item(),
                    cuda_rng=torch.cuda.get_rng_state(self.device) if self.device.type == 'cuda' else None)


def _train(config: TrainConfig, device: torch.device, rank: int, world: int) -> Dict[str, Any]:
    train_x, train_y, test_x, test_y = _load_data(config)
    run_config = config.run_config(
        dict(train_data=_data_digest(train_x, train_y), test_data=_data_digest(test_x, test_y)), world)
    # the whole data set lives on the device: batches are picked and augmented there (EpochBatches)
    train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))

    def epoch_batches(epoch: int) -> EpochBatches:
        return EpochBatches(train_x, train_y, config.batch_size, config.seed, epoch, rank=rank, world_size=world)

    steps_per_epoch = len(epoch_batches(0))
    if steps_per_epoch == 0:
        raise ValueError(f'{train_y.shape[0]} training images make no batch of {config.batch_size}')
    run = _Run(config, run_config, device, rank, world, steps_per_epoch)
    run.resume_or_start()
    forward = run.model
    if world > 1:
        forward = nn.parallel.DistributedDataParallel(forward, device_ids=[device] if device.type == 'cuda' else None)
    if config.compile:
        forward = torch.compile(forward)

    result: Dict[str, Any] = dict(stopped=False, epoch=run.epoch)
    if config.max_steps and run.global_step >= config.max_steps:  # the same command again: no step past the limit
        if rank == 0:
            print(f'{run.global_step} steps already done, --max-steps {config.max_steps}: nothing to train; raise '
                  f'--max-steps or drop it to go on')
        return dict(result, stopped=True, step_in_epoch=run.step_in_epoch)
    stop = _StopFlag()
    try:
        while run.epoch < config.epochs:
            run.model.train()
            batches = epoch_batches(run.epoch)
            bar = tqdm(total=len(batches), initial=run.step_in_epoch, desc=f'epoch {run.epoch + 1}/{config.epochs}',
                       unit='batch', dynamic_ncols=True, disable=rank != 0)
            seen, start, stop_agreed = 0, time.perf_counter(), False
            for images, labels in batches.iterate(run.step_in_epoch):
                run.step(forward, images, labels)
                seen += config.batch_size
                bar.update()
                if run.global_step % config.log_interval == 0:
                    mean_loss, stop_agreed = run.progress(stop.requested)
                    _refuse_non_finite({'the training loss': mean_loss},
                                       f'epoch {run.epoch + 1} by step {run.step_in_epoch}', run.ckpt_path)
                    bar.set_postfix(loss=f'{mean_loss:.3f}', img_s=f'{seen / (time.perf_counter() - start):.0f}',
                                    lr=f"{run.optimizer.param_groups[0]['lr']:.2e}")
                # processes stop together: a single one at the next step, those of torchrun when they agreed above
                stopping = stop.requested if world == 1 else stop_agreed
                if stopping or (config.max_steps and run.global_step >= config.max_steps):
                    bar.close()
                    run.save(f'epoch {run.epoch + 1}, step {run.step_in_epoch}')
                    if rank == 0:
                        print(f'stopped with {run.epoch} epochs and {run.step_in_epoch} steps done: checkpoint '
                              f'{run.ckpt_path}; run the same command to resume')
                    result.update(stopped=True, epoch=run.epoch, step_in_epoch=run.step_in_epoch)
                    return result
            bar.close()
            train_loss, _ = run.progress(False)  # waits for the epoch's steps, so the time below is theirs
            seconds = time.perf_counter() - start
            entry = run.end_epoch(dict(epoch=run.epoch + 1, global_step=run.global_step, train_loss=train_loss,
                                       lr=run.optimizer.param_groups[0]['lr'], train_img_s=seen / seconds,
                                       epoch_seconds=seconds), test_x, test_y)
            run.save(f'epoch {run.epoch}')
            if rank == 0:
                print(json.dumps(entry))
            result.update(entry)
        result['epoch'] = run.epoch
        return result
    finally:
        stop.restore()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return train(TrainConfig(**vars(_parser().parse_args(argv))))


if __name__ == '__main__':
    cli.keep_freed_memory()  # this process is the command's: see there
    cli.run(main)
