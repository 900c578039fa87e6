"""Side-by-side speed and memory of the original attention algorithm and this package's exact fast path.

For every model and input size, in one process on one machine:

* **original**: ``attn_path='dense'`` — full ``(HW)²`` probability maps per head and one einsum over all heads, then
  the per-head value map and the output projection as two layers (the algorithm of the authors' code);
* **fast**: the default ``attn_path='auto'`` (separable where exact) with ``proj ∘ proj_heads`` folded by
  ``timm.utils.reparameterize_model``.

Both get the same weights; the table gives images/s, peak memory above the idle process and ``max |Δ logits|``,
and the ratios (memory: peak tensor allocations of one forward pass). Run::

    python -m timm_attnconv.benchmark                       # all SA models at 32, 64, 96 px, fp32, CPU
    python -m timm_attnconv.benchmark --models sa_quadratic_cifar --sizes 32 96 --device cuda
    python -m timm_attnconv.benchmark --versus aa_resnet50:resnet50 --sizes 224 320   # AA-ResNet vs timm ResNet
    python -m timm_attnconv.benchmark --versus ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}'

With CIFAR-10 available (``--data-dir``), it also checks that bf16 autocast keeps the fp32 top-1 predictions on real
test images.
"""
import argparse
import json
import os
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import cli
from .constants import AMP_DTYPES
from .data import default_data_dir, load_cifar10, normalize
from .layers import set_attn_path

__all__ = ['compare_paths', 'main']

DEFAULT_BATCH = {32: 64, 64: 8, 96: 2}
# the CPU-trainable twins (weights work, issue 3): the tiny SA/EA models and the ResNet-20s
COMPACT_MODELS = ['*_tiny_cifar', '*resnet20_cifar']
ORIGINAL_R_BUFFER_MB = 50 ** 4 * 5 * 4 / 2 ** 20  # float32 (50, 50, 50, 50, 5) per quadratic layer in the original


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    # the profiler's C++ side logs start/stop lines to fd 2, through the printed table
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def peak_memory_mb(device: torch.device) -> Iterator[List[float]]:
    """Peak tensor memory allocated inside the block, in MiB (yields a one-element list filled on exit).

    CUDA: the caching allocator's peak statistics. CPU: the running total of the CPU allocator's allocations recorded
    by ``torch.profiler`` with ``profile_memory=True`` (process RSS would hide reused, already-freed pages).
    """
    result = [float('nan')]
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result[0] = (torch.cuda.max_memory_allocated(device) - start) / 2 ** 20
        return
    with _native_stderr_silenced(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, 'trace.json')
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)['traceEvents']
    totals = [e['args']['Total Allocated'] for e in events if e.get('name') == '[memory]']
    result[0] = max(totals, default=0) / 2 ** 20


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


@torch.no_grad()
def _run(model: nn.Module, x: torch.Tensor, iters: int) -> Dict[str, object]:
    model(x)  # warm-up
    with peak_memory_mb(x.device) as peak_mb:
        out = model(x)
    _sync(x.device)
    start = time.perf_counter()
    for _ in range(iters):
        model(x)
    _sync(x.device)
    seconds = (time.perf_counter() - start) / iters
    return dict(logits=out.float().cpu(), img_s=x.shape[0] / seconds, peak_mb=peak_mb[0])


def compare_paths(
        name: str, img_size: int, batch_size: int, iters: int = 3, device: str = 'cpu', **model_kwargs,
) -> Dict[str, object]:
    """Time the original algorithm and the fast path of ``name`` on one random batch; see the module docstring."""
    import timm
    from timm.utils import reparameterize_model  # timm.models exports it only from timm 1.0.31

    dev = torch.device(device)
    original = timm.create_model(name, **model_kwargs).eval().to(dev)
    set_attn_path(original, 'dense')
    fast = timm.create_model(name, **model_kwargs).eval().to(dev)
    fast.load_state_dict(original.state_dict())
    fast = reparameterize_model(fast, inplace=True)
    x = torch.randn(batch_size, 3, img_size, img_size, device=dev)
    ref = _run(original, x, iters)
    new = _run(fast, x, iters)
    position_buffers = sum(b.numel() * b.element_size() for b in fast.buffers())
    return dict(
        name=name, img_size=img_size, batch=batch_size,
        original_img_s=ref['img_s'], fast_img_s=new['img_s'], speedup=new['img_s'] / ref['img_s'],
        original_peak_mb=ref['peak_mb'], fast_peak_mb=new['peak_mb'],
        memory_ratio=ref['peak_mb'] / max(new['peak_mb'], 1e-6),
        max_abs_diff=(ref['logits'] - new['logits']).abs().max().item(),
        buffer_bytes=position_buffers,
    )


def compare_models(
        name: str, baseline: str, img_size: int, batch_size: int, iters: int = 3, device: str = 'cpu',
        baseline_kwargs: Optional[Dict[str, object]] = None,
) -> Dict[str, object]:
    """Inference img/s and peak memory of ``name`` against a ``baseline`` model (e.g. timm's own ``resnet50``)."""
    dev = torch.device(device)
    x = torch.randn(batch_size, 3, img_size, img_size, device=dev)
    rows = {}
    for key, model_name, kwargs in (('model', name, {}), ('baseline', baseline, baseline_kwargs or {})):
        rows[key] = _run(cli.create_model(model_name, '--baseline-kwargs', kwargs).eval().to(dev), x, iters)
    return dict(
        name=name, baseline=baseline, img_size=img_size, batch=batch_size,
        img_s=rows['model']['img_s'], baseline_img_s=rows['baseline']['img_s'],
        time_ratio=rows['baseline']['img_s'] / rows['model']['img_s'],
        peak_mb=rows['model']['peak_mb'], baseline_peak_mb=rows['baseline']['peak_mb'],
        memory_ratio=rows['model']['peak_mb'] / max(rows['baseline']['peak_mb'], 1e-6),
    )


def training_throughput(
        name: str, batch_size: int = 256, steps: int = 3, device: str = 'cpu', amp: Optional[torch.dtype] = None,
) -> Dict[str, object]:
    """img/s and achieved GFLOP/s of full training steps (forward, backward, AdamW) of ``name`` at 32×32.

    FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one step (matrix products and convolutions of
    forward and backward; 2 per multiply-add)."""
    import timm
    from timm.optim import create_optimizer_v2
    from torch.utils.flop_counter import FlopCounterMode

    dev = torch.device(device)
    model = timm.create_model(name).train().to(dev)
    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3)
    x = torch.randn(batch_size, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch_size,), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    with FlopCounterMode(display=False) as counter:
        step()  # also the warm-up
    _sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(dev)
    seconds = (time.perf_counter() - start) / steps
    return dict(name=name, batch=batch_size, img_s=batch_size / seconds,
                gflop_s=counter.get_total_flops() / seconds / 1e9)


def bf16_top1_agreement(name: str, data_dir: str, num_images: int = 512, device: str = 'cpu') -> Dict[str, object]:
    """Share of real CIFAR-10 test images whose top-1 class is the same under bf16 autocast as in fp32."""
    import timm

    images, _ = load_cifar10(data_dir, 'test')
    pretrained = timm.models.is_model_pretrained(name)
    model = timm.create_model(name, pretrained=pretrained).eval().to(device)
    x = normalize(images[:num_images], model.pretrained_cfg['mean'], model.pretrained_cfg['std']).to(device)
    with torch.no_grad():
        ref = model(x).argmax(-1)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            low = model(x).argmax(-1)
    return dict(name=name, images=x.shape[0], pretrained=pretrained, agreement=(ref == low).float().mean().item())


def _print_row(r: Dict[str, object]) -> None:
    print(f"{r['name']:30s} {r['img_size']:4d} {r['batch']:5d} {r['original_img_s']:9.2f} {r['fast_img_s']:9.2f} "
          f"{r['speedup']:7.2f}x {r['original_peak_mb']:9.1f} {r['fast_peak_mb']:9.1f} {r['memory_ratio']:7.2f}x "
          f"{r['max_abs_diff']:10.2e} {r['buffer_bytes']:8d}", flush=True)


def _model_pair(text: str) -> Tuple[str, str]:
    name, _, baseline = text.partition(':')
    if not baseline:
        raise argparse.ArgumentTypeError(f'expected MODEL:BASELINE, as in aa_resnet50:resnet50, got {text!r}')
    return cli.model_name(name), cli.model_name(baseline)


def _optional_model(text: str) -> str:
    return text and cli.model_name(text)  # '' skips the bf16 check


def _versus(pairs: Sequence[Tuple[str, str]], args: argparse.Namespace) -> List[Dict[str, object]]:
    print(f'inference, fp32, device {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}')
    print(f"{'model':22s} {'baseline':12s} {'px':>4s} {'batch':>5s} {'img/s':>8s} {'base img/s':>10s} {'time':>7s} "
          f"{'MB':>8s} {'base MB':>8s} {'memory':>7s}")
    rows = []
    for name, baseline in pairs:
        for size in args.sizes:
            r = compare_models(name, baseline, size, args.batch_size or 8, args.iters, args.device,
                               args.baseline_kwargs)
            print(f"{name:22s} {baseline:12s} {size:4d} {r['batch']:5d} {r['img_s']:8.2f} {r['baseline_img_s']:10.2f} "
                  f"{r['time_ratio']:6.2f}x {r['peak_mb']:8.1f} {r['baseline_peak_mb']:8.1f} {r['memory_ratio']:6.2f}x",
                  flush=True)
            rows.append(r)
    print('time: model time / baseline time per image; memory: peak tensor allocations of one forward pass, '
          'model / baseline.')
    return rows


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    import timm_attnconv
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='*', type=cli.model_name, default=None,
                        help='default: every paper-size model of the SA family')
    parser.add_argument('--sizes', nargs='*', type=cli.positive_int, default=[32, 64, 96])
    parser.add_argument('--batch-size', type=cli.positive_int, default=None,
                        help='default: 64 / 8 / 2 for 32 / 64 / 96 px')
    parser.add_argument('--iters', type=cli.positive_int, default=2)
    cli.add_device_arg(parser)
    parser.add_argument('--threads', type=cli.positive_int, default=None,
                        help='torch CPU threads (default: torch default)')
    cli.add_data_dir_arg(parser, use=', for the bf16 check (skipped if absent)')
    parser.add_argument('--bf16-model', type=_optional_model, default='sa_quadratic_cifar',
                        help='model for the bf16 check ("" to skip)')
    parser.add_argument('--train', action='store_true',
                        help='instead: training-step throughput of the compact CPU-trainable models (or --models), '
                             'batch 256')
    parser.add_argument('--amp', choices=('none', 'bf16'), default='none', help='autocast for --train')
    parser.add_argument('--versus', nargs='*', type=_model_pair, default=None, metavar='MODEL:BASELINE',
                        help='instead: inference time and memory of models against baselines as ratios '
                             '(default pair aa_resnet50:resnet50; use --sizes 224 320)')
    parser.add_argument('--baseline-kwargs', type=cli.json_object, default=None,
                        help='JSON kwargs for the --versus baselines, e.g. \'{"evolve": false}\' for the base of an '
                             'EA model')
    parser.add_argument('--bf16-images', type=cli.positive_int, default=128,
                        help='test images for the bf16 check (bf16 matmul is slow on CPUs without bf16 units)')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.train:
        names = args.models or timm_attnconv.list_models(filter=COMPACT_MODELS)
        amp = AMP_DTYPES[args.amp]
        print(f'training steps (AdamW), 32 px, {args.amp}, device {args.device}, {torch.get_num_threads()} threads')
        rows = []
        for name in names:
            row = training_throughput(name, args.batch_size or 256, args.iters, args.device, amp)
            print(f"{name:32s} batch {row['batch']:4d} {row['img_s']:8.1f} img/s {row['gflop_s']:8.1f} GFLOP/s",
                  flush=True)
            rows.append(row)
        return rows
    if args.versus is not None:
        return _versus(args.versus or [('aa_resnet50', 'resnet50')], args)
    names = args.models or [n for n in timm_attnconv.list_models(filter='sa_*') if '_tiny_' not in n]
    print(f'device {args.device}, {torch.get_num_threads()} threads, fp32, torch {torch.__version__}')
    print(f"{'model':30s} {'px':>4s} {'batch':>5s} {'orig img/s':>9s} {'fast img/s':>9s} {'speed':>8s} "
          f"{'orig MB':>9s} {'fast MB':>9s} {'memory':>8s} {'max|Δlogit|':>10s} {'buffers':>8s}")
    rows = []
    for name in names:
        for size in args.sizes:
            batch = args.batch_size or DEFAULT_BATCH.get(size, max(1, 64 * 32 * 32 // (size * size)))
            row = compare_paths(name, size, batch, args.iters, args.device)
            _print_row(row)
            rows.append(row)
    print(f'Original code also holds a {ORIGINAL_R_BUFFER_MB:.0f} MB position buffer per quadratic layer; '
          f'"buffers" is what the fast model holds, in bytes.')
    data_dir = args.data_dir or default_data_dir()
    if args.bf16_model and os.path.exists(os.path.join(data_dir, 'test.npz')):
        r = bf16_top1_agreement(args.bf16_model, data_dir, args.bf16_images, device=args.device)
        weights = 'pretrained' if r['pretrained'] else 'random-init, no weights yet'
        print(f"bf16 autocast vs fp32 top-1 agreement, {r['name']} ({weights}), {r['images']} CIFAR-10 test "
              f"images: {100 * r['agreement']:.1f}%")
    return rows


if __name__ == '__main__':
    cli.run(main)
