"""Train any registered model on CIFAR-10 with timm's optimizer, scheduler, loss and EMA factories.

    python -m timm_attnconv.train --model sa_quadratic_tiny_cifar --output runs/sa_quadratic_tiny_cifar

Every epoch ends with a test-set evaluation, one JSON line in ``<output>/log.jsonl`` and an atomic checkpoint
``<output>/last.pth.tar`` (model, optimizer, scheduler, EMA, RNG, epoch and step). Running the same command again
resumes exactly where the last checkpoint left off; Ctrl-C or SIGTERM stops at the next step and writes a
checkpoint first. Batches come from :class:`timm_attnconv.data.EpochBatches`, which fixes every batch by
``(seed, epoch, step)``, so a resumed run sees the same data as an uninterrupted one.
"""
import argparse
import json
import math
import os
import signal
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn
from tqdm import tqdm

from .data import EpochBatches, load_cifar10, normalize
from .evaluate import evaluate

__all__ = ['main', 'load_training_checkpoint', 'load_weights']

CHECKPOINT = 'last.pth.tar'
# options that must not change between a run and its resumption
RESUME_KEYS = ('model', 'model_kwargs', 'epochs', 'batch_size', 'opt', 'lr', 'weight_decay', 'sched', 'warmup_epochs',
               'min_lr', 'smoothing', 'model_ema', 'model_ema_decay', 'seed', 'train_limit', 'init_from')


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', required=True)
    p.add_argument('--model-kwargs', type=json.loads, default={}, help='JSON dict for timm.create_model')
    p.add_argument('--init-from', default=None,
                   help='start from these pretrained weights (e.g. sa_learned_tiny_cifar.c10) instead of a random '
                        'init; a model of another layout must support it (SelfAttentionNet.init_from)')
    p.add_argument('--data-dir', default=None, help='folder with train.npz / test.npz or cifar-10-batches-py')
    p.add_argument('--output', required=True, help='run folder: checkpoint, log.jsonl')
    p.add_argument('--epochs', type=int, default=30)
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--opt', default='adamw', help='timm optimizer name')
    p.add_argument('--lr', type=float, default=2e-3)
    p.add_argument('--weight-decay', type=float, default=0.05)
    p.add_argument('--sched', default='cosine', help='timm scheduler name')
    p.add_argument('--warmup-epochs', type=int, default=1)
    p.add_argument('--min-lr', type=float, default=1e-5)
    p.add_argument('--smoothing', type=float, default=0.1, help='label smoothing')
    p.add_argument('--clip-grad', type=float, default=None)
    p.add_argument('--model-ema', action='store_true', help='keep an EMA of the weights (timm ModelEmaV3)')
    p.add_argument('--model-ema-decay', type=float, default=0.999)
    p.add_argument('--amp', choices=('none', 'bf16', 'fp16'), default='none',
                   help='autocast dtype (bf16 pays off only on CPUs with bf16 units and on GPUs)')
    p.add_argument('--channels-last', action='store_true')
    p.add_argument('--compile', action='store_true', help='torch.compile the model')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--seed', type=int, default=42)
    p.add_argument('--train-limit', type=int, default=None, help='first N training images only (smoke tests)')
    p.add_argument('--eval-limit', type=int, default=None, help='first N test images only (smoke tests)')
    p.add_argument('--max-steps', type=int, default=None, help='stop (with a checkpoint) after this many steps')
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


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + '.tmp'
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _config(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: getattr(args, k) for k in RESUME_KEYS}


def _build(config: Dict[str, Any]) -> nn.Module:
    import timm
    return timm.create_model(config['model'], num_classes=10, **config['model_kwargs'])


def initial_model(config: Dict[str, Any]) -> nn.Module:
    """The model exactly as a run with ``config`` starts: torch's RNG seeded with ``config['seed']``, then built."""
    torch.manual_seed(config['seed'])
    return _build(config)


def init_from_pretrained(model: nn.Module, name: str) -> nn.Module:
    """Load the pretrained weights ``name`` into ``model``: as they are when the layouts match, else through the
    model's own ``init_from(source)`` (e.g. a content model warm-started from a positional one)."""
    import timm
    source = timm.create_model(name, pretrained=True, num_classes=10)
    init = getattr(model, 'init_from', None)
    if init is not None and source.state_dict().keys() != model.state_dict().keys():
        return init(source)
    model.load_state_dict(source.state_dict())  # strict: a mismatch names the keys
    return model


def load_weights(state: Dict[str, Any], key: str = 'model') -> nn.Module:
    """The model of a loaded training checkpoint with its ``'model'`` or ``'ema'`` weights, in eval mode."""
    if state.get(key) is None:
        raise ValueError(f'the checkpoint has no {key} weights (was the run started with --model-ema?)')
    model = _build(state['config'])
    weights = {k.removeprefix('module.'): v for k, v in state[key].items()}
    model.load_state_dict(weights)
    return model.eval()


def load_training_checkpoint(path: str, use_ema: bool = False) -> nn.Module:
    """The model of a training checkpoint file (its EMA weights with ``use_ema``), in eval mode."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no training checkpoint at {path!r}')
    state = torch.load(path, map_location='cpu', weights_only=True)
    try:
        return load_weights(state, 'ema' if use_ema else 'model')
    except ValueError as e:
        raise ValueError(f'{path!r}: {e}') from e


def _check_resumable(state: Dict[str, Any], config: Dict[str, Any], path: str) -> None:
    diff = {k: (state['config'].get(k), config[k]) for k in RESUME_KEYS if state['config'].get(k) != config[k]}
    if diff:
        lines = ', '.join(f'{k}: checkpoint {old!r} vs now {new!r}' for k, (old, new) in diff.items())
        raise ValueError(f'cannot resume {path!r} with different settings ({lines}); use the original options '
                         f'or another --output folder')


def train(args: argparse.Namespace) -> Dict[str, Any]:
    from timm.loss import LabelSmoothingCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    from timm.utils import ModelEmaV3

    config = _config(args)
    os.makedirs(args.output, exist_ok=True)
    ckpt_path = os.path.join(args.output, CHECKPOINT)
    device = torch.device(args.device)

    train_x, train_y = load_cifar10(args.data_dir, 'train')
    test_x, test_y = load_cifar10(args.data_dir, 'test')
    if args.train_limit:
        train_x, train_y = train_x[:args.train_limit], train_y[:args.train_limit]
    if args.eval_limit:
        test_x, test_y = test_x[:args.eval_limit], test_y[:args.eval_limit]

    model = initial_model(config)  # seeds torch's RNG for the whole run
    if args.init_from and not os.path.isfile(ckpt_path):
        init_from_pretrained(model, args.init_from)
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    cfg = model.pretrained_cfg
    steps_per_epoch = len(EpochBatches(train_x, train_y, args.batch_size, args.seed, 0))
    if steps_per_epoch == 0:
        raise ValueError(f'{train_y.shape[0]} training images make no batch of {args.batch_size}')
    optimizer = create_optimizer_v2(model, args.opt, lr=args.lr, weight_decay=args.weight_decay)
    scheduler, _ = create_scheduler_v2(
        optimizer, args.sched, num_epochs=args.epochs, warmup_epochs=args.warmup_epochs, min_lr=args.min_lr,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    ema = ModelEmaV3(model, decay=args.model_ema_decay) if args.model_ema else None
    criterion = LabelSmoothingCrossEntropy(args.smoothing) if args.smoothing > 0 else nn.CrossEntropyLoss()
    amp_dtype = {'none': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}[args.amp]
    grad_scaler = torch.amp.GradScaler(device.type) if args.amp == 'fp16' else None
    forward = torch.compile(model) if args.compile else model

    epoch, step_in_epoch, global_step = 0, 0, 0
    if os.path.isfile(ckpt_path):
        if args.no_resume:
            raise FileExistsError(f'{ckpt_path!r} exists and --no-resume was given')
        state = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        _check_resumable(state, config, ckpt_path)
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        scheduler.load_state_dict(state['scheduler'])
        if ema is not None:
            ema.load_state_dict(state['ema'])
        torch.set_rng_state(state['rng'])
        epoch, step_in_epoch, global_step = state['epoch'], state['step_in_epoch'], state['global_step']
        print(f'resumed {ckpt_path} at epoch {epoch}, step {step_in_epoch}')
    else:
        scheduler.step_update(0)

    def save():
        _atomic_save(dict(
            config=config, epoch=epoch, step_in_epoch=step_in_epoch, global_step=global_step,
            model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
            ema=ema.state_dict() if ema is not None else None, rng=torch.get_rng_state()), ckpt_path)

    stop = _StopFlag()
    log_path = os.path.join(args.output, 'log.jsonl')
    result: Dict[str, Any] = dict(stopped=False, epoch=epoch)
    try:
        while epoch < args.epochs:
            model.train()
            batches = EpochBatches(train_x, train_y, args.batch_size, args.seed, epoch)
            bar = tqdm(total=len(batches), initial=step_in_epoch, desc=f'epoch {epoch + 1}/{args.epochs}',
                       unit='batch', dynamic_ncols=True)
            loss_sum, seen, start = 0., 0, time.perf_counter()
            for images, labels in batches.iterate(step_in_epoch):
                x = normalize(images.to(device), cfg['mean'], cfg['std'])
                if args.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                y = labels.to(device)
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = criterion(forward(x), y)
                if not math.isfinite(loss.item()):
                    raise FloatingPointError(f'loss is {loss.item()} at epoch {epoch}, step {step_in_epoch}')
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
                loss_sum += loss.item() * y.shape[0]
                seen += y.shape[0]
                bar.update()
                bar.set_postfix(loss=f'{loss.item():.3f}', img_s=f'{seen / (time.perf_counter() - start):.0f}',
                                lr=f"{optimizer.param_groups[0]['lr']:.2e}")
                if stop.requested or (args.max_steps and global_step >= args.max_steps):
                    bar.close()
                    save()
                    print(f'stopped at epoch {epoch}, step {step_in_epoch}: checkpoint {ckpt_path}; '
                          f'run the same command to resume')
                    result.update(stopped=True, epoch=epoch, step_in_epoch=step_in_epoch)
                    return result
            bar.close()
            seconds = time.perf_counter() - start
            entry = dict(epoch=epoch + 1, global_step=global_step, train_loss=loss_sum / max(seen, 1),
                         lr=optimizer.param_groups[0]['lr'], train_img_s=seen / seconds, epoch_seconds=seconds,
                         **{f'test_{k}': v for k, v in evaluate(model, test_x, test_y).items()})
            if ema is not None:
                entry.update({f'ema_test_{k}': v for k, v in evaluate(ema.module, test_x, test_y).items()})
            epoch += 1
            step_in_epoch = 0
            save()
            with open(log_path, 'a') as f:
                f.write(json.dumps(entry) + '\n')
            print(json.dumps(entry))
            result.update(entry)
        result['epoch'] = epoch
        return result
    finally:
        stop.restore()


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return train(_parser().parse_args(argv))


if __name__ == '__main__':
    main()
