"""Side-by-side speed and memory of the original attention algorithm and this package's exact fast path.

For every model and input size, in one process on one machine:

* **original**: ``attn_path='dense'`` — full ``(HW)²`` probability maps per head and one einsum over all heads, then
  the per-head value map and the output projection as two layers (the algorithm of the authors' code);
* **fast**: the default ``attn_path='auto'`` (separable where exact) with ``proj ∘ proj_heads`` folded by
  ``timm.utils.reparameterize_model``.

Both get the same weights; the table gives images/s, peak memory above the idle process and ``max |Δ logits|``,
and the ratios (memory: peak tensor allocations of one forward pass). ``--paths`` instead times the exact algorithms
of the separable SA models against each other, ``dense``, ``separable_loop`` (one head at a time) and
``separable_direct`` (each head's columns written in place into the value maps' input), and prints the one
``attn_path='auto'`` takes on the device: the measurement behind ``timm_attnconv.layers.auto_path_rule``.

Timing: each side is first run until two successive calls agree within 5% (at most ``--max-warmup`` runs), then the
two sides of a comparison alternate, ABBA, for ``--iters`` repetitions; a ratio is the median of the per-repetition
ratios, printed with its range, ``1.74× (1.61–1.88)``, and img/s is each side's median. Timing each side as one
block and comparing means let a slow phase of a shared machine land on one side only (the same pair twice in one
run read 1.60× and 1.22×). ``--amp``, ``--compile`` and ``--channels-last`` apply to every timed side. Run::

    python -m timm_attnconv.benchmark                       # all SA models at 32, 64, 96 px, fp32, CPU
    python -m timm_attnconv.benchmark --models sa_quadratic_cifar --sizes 32 96 --device cuda
    python -m timm_attnconv.benchmark --paths --device cuda --amp bf16 --sizes 32 64 96   # the 'auto' crossover
    python -m timm_attnconv.benchmark --versus aa_resnet50:resnet50 --sizes 224 320   # AA-ResNet vs timm ResNet
    python -m timm_attnconv.benchmark --versus ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}'
    python -m timm_attnconv.benchmark --kernels --models aa_resnet50 sa_learned_content_cifar --batch-size 256 \
        --device cuda                 # every attention kernel, each model at its default size
    python -m timm_attnconv.benchmark --evolution-layouts --models deit_ea_small_patch16_224 --device cuda --amp bf16

``--kernels`` times the attention kernels of the AA and SA content layers (``attn_kernel``, see
:mod:`timm_attnconv.layers.attention_kernels`; with ``--train``, their training steps) on one model's weights:
img/s, speed over the first kernel named, peak memory and ``max |Δ logits|``; a kernel that cannot run on the device
(FlexAttention without a CPU backward, a dtype it lacks) is listed with the reason instead. ``--evolution-layouts``
times an evolving-attention model with each way of running the update over its attention maps
(``timm_attnconv.layers.set_evolution_layout``; or those named): ``'auto'`` (the default: the Triton kernel at
inference on CUDA, else channels_last), the reference convolution over channels_last maps, and the whole update as
one Triton kernel (inference on CUDA; elsewhere listed with the reason it cannot run) (with ``--train``, their training
steps).
``--evolution-layout`` runs the EA models of ``--versus`` pairs in one such layout (``--versus
ea_aa_resnet50:ea_aa_resnet50 --baseline-kwargs '{"evolve": false}' --evolution-layout channels_last``). With
``--reparameterize`` both time each model's inference form (``reparameterize_model``), the form the fast side of the
original-vs-fast comparison runs.

With CIFAR-10 available (``--data-dir``), it also checks that bf16 autocast keeps the fp32 top-1 predictions on real
test images.
"""
import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import cli
from .constants import AMP_DTYPES
from .data import default_data_dir, load_cifar10, normalize
from .layers import (
    ATTN_KERNELS, EVOLUTION_LAYOUTS, PositionalSelfAttention, resolve_attn_path, set_attn_kernel, set_attn_path,
    set_evolution_layout)
from .layers.kernel_failures import compile_failure_cause

__all__ = ['compare_paths', 'compare_attn_paths', 'compare_models', 'compare_variants', 'compare_training_variants',
           'training_throughput', 'measure', 'warm_up', 'seconds_of', 'inference_call', 'interleaved_seconds',
           'median_spread', 'ratio_text', 'parse_args', 'main']

DEFAULT_BATCH = {32: 64, 64: 8, 96: 2}
# compared variants of a model: a name → the function that sets a copy of the model up
Variants = Dict[str, Callable[[nn.Module], nn.Module]]
# the CPU-trainable twins (weights work, issue 3): the tiny SA/EA models and the ResNet-20s
COMPACT_MODELS = ['*_tiny_cifar', '*resnet20_cifar']
ORIGINAL_R_BUFFER_MB = 50 ** 4 * 5 * 4 / 2 ** 20  # float32 (50, 50, 50, 50, 5) per quadratic layer in the original
# warm-up stops when one run's time is within 5% of the previous one's, or after MAX_WARMUP runs
WARMUP_TOLERANCE = 0.05
MAX_WARMUP = 8
# the exact algorithms of a separable SA layer, as --paths times them; the first is the reference of the ratios
EXACT_PATHS = ('dense', 'separable_loop', 'separable_direct')


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


def seconds_of(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn``; on CUDA synchronized before and after, so it holds the kernels' time and not
    only their launch."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


Timer = Callable[[Callable[[], object], torch.device], float]


def warm_up(fn: Callable[[], object], device: torch.device, max_runs: int = MAX_WARMUP,
            tolerance: float = WARMUP_TOLERANCE, timer: Timer = seconds_of) -> int:
    """Run ``fn`` until two successive timings differ by less than ``tolerance`` (relative) or ``max_runs`` runs are
    done; returns the runs it took. Compilation, autotuning, allocator growth and CPU frequency ramps make the first
    calls slow by a varying amount, and a fixed count of warm-up calls is either wasted or too few."""
    previous = None
    for run in range(1, max_runs + 1):
        seconds = timer(fn, device)
        if previous is not None and abs(seconds - previous) < tolerance * previous:
            return run
        previous = seconds
    return max_runs


def interleaved_seconds(sides: Sequence[Callable[[], object]], reps: int, device: torch.device,
                        timer: Timer = seconds_of) -> List[List[float]]:
    """``reps`` timings of every side, taken in ABBA order (A B, B A, A B, ...): a slow phase of a shared machine or
    a clock that drifts hits both sides of a repetition alike instead of one side's whole block, and the reversal
    cancels a linear drift over each pair of repetitions. Returns one list of seconds per side."""
    times: List[List[float]] = [[] for _ in sides]
    for rep in range(reps):
        order = range(len(sides)) if rep % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            times[i].append(timer(sides[i], device))
    return times


def measure(sides: Sequence[Callable[[], object]], reps: int, device: torch.device, max_warmup: int = MAX_WARMUP,
            timer: Timer = seconds_of) -> Dict[str, object]:
    """The timing every comparison of this tool shares: each side warmed up until its timings settle, then ``reps``
    interleaved repetitions. ``seconds``: one list per side; ``ratio`` (two sides): the median, min and max over
    repetitions of side 0's time over side 1's, each repetition's pair taken back to back."""
    warmup_runs = [warm_up(fn, device, max_warmup, timer=timer) for fn in sides]
    times = interleaved_seconds(sides, reps, device, timer)
    result = dict(seconds=times, warmup_runs=warmup_runs)
    if len(sides) == 2:
        result['ratio'] = median_spread([a / b for a, b in zip(*times)])
    return result


def median_spread(values: Sequence[float]) -> Dict[str, float]:
    """Median and range of per-repetition values: the median ignores a repetition hit by a burst of other work, which
    would drag a mean, and the range shows how far one repetition can stray."""
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def ratio_text(spread: Dict[str, float]) -> str:
    """``1.74× (1.61–1.88)``: the median ratio and its range over repetitions."""
    return f"{spread['median']:.2f}× ({spread['min']:.2f}–{spread['max']:.2f})"


def _prepared(model: nn.Module, compile_model: bool, channels_last: bool = False) -> nn.Module:
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return torch.compile(model) if compile_model else model


def _images(batch_size: int, img_size: int, device: torch.device, channels_last: bool = False) -> torch.Tensor:
    # random images, NHWC in memory with channels_last (as timm's --channels-last feeds them)
    x = torch.randn(batch_size, 3, img_size, img_size, device=device)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def inference_call(model: nn.Module, x: torch.Tensor, amp: Optional[torch.dtype]) -> Callable[[], torch.Tensor]:
    """``model(x)`` as a call of no arguments: no autograd, under ``amp`` autocast (``None``: none)."""
    def forward() -> torch.Tensor:
        with torch.no_grad(), torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
            return model(x)
    return forward


def _first_call(forward: Callable[[], torch.Tensor], device: torch.device) -> Dict[str, object]:
    """Logits and peak memory of one call, after an untimed one (a compiled model compiles there, and its compiler's
    allocations stay out of the peak)."""
    forward()
    with peak_memory_mb(device) as peak_mb:
        out = forward()
    _sync(device)
    return dict(logits=out.float().cpu(), peak_mb=peak_mb[0])


def _why_compiling_failed(error: Exception) -> str:
    # a backend's failure (inductor's: a Triton kernel out of shared memory) is wrapped in dynamo's, whose first line
    # only names the backend
    cause = getattr(error, 'inner_exception', None) or error
    return f'compiling failed: {type(cause).__name__}: {compile_failure_cause(cause)}'


def compare_paths(
        name: str, img_size: int, batch_size: int, iters: int = 3, device: str = 'cpu',
        amp: Optional[torch.dtype] = None, compile_model: bool = False, max_warmup: int = MAX_WARMUP,
        channels_last: bool = False, **model_kwargs,
) -> Dict[str, object]:
    """Time the original algorithm and the fast path of ``name`` on one random batch; see the module docstring.
    ``iters`` interleaved repetitions (one forward pass each) per path; ``speedup`` is the median over repetitions of
    the original's time over the fast path's, ``speedup_min`` / ``speedup_max`` its range."""
    import timm
    from timm.utils import reparameterize_model  # timm.models exports it only from timm 1.0.31

    dev = torch.device(device)
    original = timm.create_model(name, **model_kwargs).eval().to(dev)
    set_attn_path(original, 'dense')
    fast = timm.create_model(name, **model_kwargs).eval().to(dev)
    fast.load_state_dict(original.state_dict())
    fast = reparameterize_model(fast, inplace=True)
    position_buffers = sum(b.numel() * b.element_size() for b in fast.buffers())
    x = _images(batch_size, img_size, dev, channels_last)
    sides = [inference_call(_prepared(m, compile_model, channels_last), x, amp) for m in (original, fast)]
    ref, new = (_first_call(side, dev) for side in sides)
    timing = measure(sides, iters, dev, max_warmup)
    original_s, fast_s = (statistics.median(t) for t in timing['seconds'])
    speedup = timing['ratio']
    return dict(
        name=name, img_size=img_size, batch=batch_size, reps=iters, warmup_runs=timing['warmup_runs'],
        original_img_s=batch_size / original_s, fast_img_s=batch_size / fast_s,
        speedup=speedup['median'], speedup_min=speedup['min'], speedup_max=speedup['max'],
        original_peak_mb=ref['peak_mb'], fast_peak_mb=new['peak_mb'],
        memory_ratio=ref['peak_mb'] / max(new['peak_mb'], 1e-6),
        max_abs_diff=(ref['logits'] - new['logits']).abs().max().item(),
        buffer_bytes=position_buffers,
    )


def compare_attn_paths(
        name: str, img_size: int, batch_size: int, iters: int = 3, device: str = 'cpu',
        amp: Optional[torch.dtype] = None, compile_model: bool = False, max_warmup: int = MAX_WARMUP,
        channels_last: bool = False, **model_kwargs,
) -> Dict[str, object]:
    """Time every exact algorithm of :data:`EXACT_PATHS` on the SA model ``name`` (same weights, nothing folded), all
    in one interleaved measurement; ``speed[path]`` is the median over repetitions of dense's time over the path's,
    with its range. ``auto`` names the path ``attn_path='auto'`` takes for this device and grid."""
    import timm

    dev = torch.device(device)
    reference = timm.create_model(name, **model_kwargs).eval().to(dev)
    if not _separable(reference):
        raise ValueError(f'{name} has no attention layers or some that are not separable: --paths compares the '
                         f'exact algorithms of separable SA models (e.g. sa_quadratic_cifar, sa_learned_cifar)')
    models = [reference] + [timm.create_model(name, **model_kwargs).eval().to(dev) for _ in EXACT_PATHS[1:]]
    for model, path in zip(models, EXACT_PATHS):
        model.load_state_dict(reference.state_dict())
        set_attn_path(model, path)
    x = _images(batch_size, img_size, dev, channels_last)
    sides = [inference_call(_prepared(m, compile_model, channels_last), x, amp) for m in models]
    firsts = [_first_call(side, dev) for side in sides]
    timing = measure(sides, iters, dev, max_warmup)
    dense_s = timing['seconds'][0]
    grid = img_size // reference.patch_size
    return dict(
        name=name, img_size=img_size, batch=batch_size, reps=iters, warmup_runs=timing['warmup_runs'],
        auto=resolve_attn_path('auto', dev.type, grid * grid),
        img_s={path: batch_size / statistics.median(t) for path, t in zip(EXACT_PATHS, timing['seconds'])},
        speed={path: median_spread([d / s for d, s in zip(dense_s, t)])
               for path, t in zip(EXACT_PATHS, timing['seconds'])},
        peak_mb={path: first['peak_mb'] for path, first in zip(EXACT_PATHS, firsts)},
        max_abs_diff={path: (first['logits'] - firsts[0]['logits']).abs().max().item()
                      for path, first in zip(EXACT_PATHS, firsts)},
    )


def compare_models(
        name: str, baseline: str, img_size: int, batch_size: int, iters: int = 3, device: str = 'cpu',
        baseline_kwargs: Optional[Dict[str, object]] = None, amp: Optional[torch.dtype] = None,
        compile_model: bool = False, max_warmup: int = MAX_WARMUP, channels_last: bool = False,
        evolution_layout: Optional[str] = None,
) -> Dict[str, object]:
    """Inference img/s and peak memory of ``name`` against a ``baseline`` model (e.g. timm's own ``resnet50``);
    ``time_ratio`` is the median over ``iters`` interleaved repetitions of the model's time over the baseline's.
    ``evolution_layout``: the layout of every evolving-attention update of both (``set_evolution_layout``; None: the
    models' default)."""
    dev = torch.device(device)
    x = _images(batch_size, img_size, dev, channels_last)
    models = [cli.create_model(model_name, '--baseline-kwargs', kwargs).eval().to(dev)
              for model_name, kwargs in ((name, {}), (baseline, baseline_kwargs or {}))]
    if evolution_layout is not None:
        models = [set_evolution_layout(model, evolution_layout) for model in models]
    sides = [inference_call(_prepared(m, compile_model, channels_last), x, amp) for m in models]
    model_row, baseline_row = (_first_call(side, dev) for side in sides)
    timing = measure(sides, iters, dev, max_warmup)
    model_s, baseline_s = (statistics.median(t) for t in timing['seconds'])
    ratio = timing['ratio']
    return dict(
        name=name, baseline=baseline, img_size=img_size, batch=batch_size, reps=iters,
        warmup_runs=timing['warmup_runs'], img_s=batch_size / model_s, baseline_img_s=batch_size / baseline_s,
        time_ratio=ratio['median'], time_ratio_min=ratio['min'], time_ratio_max=ratio['max'],
        peak_mb=model_row['peak_mb'], baseline_peak_mb=baseline_row['peak_mb'],
        memory_ratio=model_row['peak_mb'] / max(baseline_row['peak_mb'], 1e-6),
    )


def compare_variants(
        name: str, img_size: Optional[int], batch_size: int, variants: Variants, label: str = 'variant',
        iters: int = 3, device: str = 'cpu', amp: Optional[torch.dtype] = None,
        compile_model: bool = False, max_warmup: int = MAX_WARMUP, channels_last: bool = False,
        reparameterize: bool = False,
) -> List[Dict[str, object]]:
    """Inference of ``name`` in each variant (a copy of the model, same weights, set up by the variant's function),
    interleaved: one row per variant, named under ``label``, with img/s, ``speed`` = the first variant's time over
    this one's (median and range over repetitions), peak memory of one forward pass and ``max_abs_diff`` of the logits
    against the first variant's. A variant that cannot run here (a ``ValueError`` that says why) or, with
    ``compile_model``, that does not compile here gives a row with its ``error`` instead, and the others are timed.
    ``img_size`` None: the model's default input size. ``reparameterize``: the model's inference form
    (``timm.utils.reparameterize_model``), as the fast side of :func:`compare_paths` runs it."""
    import copy

    import timm
    from timm.utils import reparameterize_model  # timm.models exports it only from timm 1.0.31

    dev = torch.device(device)
    model = timm.create_model(name).eval().to(dev)
    if reparameterize:
        model = reparameterize_model(model, inplace=True)
    img_size = img_size or model.pretrained_cfg['input_size'][-1]
    x = _images(batch_size, img_size, dev, channels_last)
    rows, sides, firsts = [], [], []
    for variant, set_up in variants.items():
        side = inference_call(_prepared(set_up(copy.deepcopy(model)), compile_model, channels_last), x, amp)
        row = {'name': name, 'img_size': img_size, 'batch': batch_size, label: variant, 'reps': iters}
        try:
            firsts.append(_first_call(side, dev))
        except ValueError as error:  # e.g. a forced kernel that cannot run on this device or dtype says why
            rows.append(dict(row, error=str(error)))
            continue
        except torch._dynamo.exc.TorchDynamoException as error:  # e.g. FlexAttention's kernel, built in the graph
            rows.append(dict(row, error=_why_compiling_failed(error)))
            continue
        rows.append(row)
        sides.append(side)
    for row, first in zip(_time_against_the_first(rows, sides, batch_size, iters, dev, max_warmup), firsts):
        row.update(peak_mb=first['peak_mb'], max_abs_diff=(first['logits'] - firsts[0]['logits']).abs().max().item())
    return rows


def _time_against_the_first(rows: List[Dict[str, object]], sides: Sequence[Callable[[], object]], batch_size: int,
                            iters: int, dev: torch.device, max_warmup: int) -> List[Dict[str, object]]:
    # the rows without an error, one per side, interleaved: img/s and speed = the first side's time over this one's
    # (median and range over repetitions) added to each; returns those rows
    timed = [row for row in rows if 'error' not in row]
    if not timed:
        return timed
    timing = measure(sides, iters, dev, max_warmup)
    first_seconds = timing['seconds'][0]
    for row, seconds, warmup in zip(timed, timing['seconds'], timing['warmup_runs']):
        speed = median_spread([a / b for a, b in zip(first_seconds, seconds)])
        row.update(warmup_runs=warmup, img_s=batch_size / statistics.median(seconds), speed=speed['median'],
                   speed_min=speed['min'], speed_max=speed['max'])
    return timed


def _kernel_variants(kernels: Sequence[str]) -> Variants:
    return {kernel: functools.partial(set_attn_kernel, kernel=kernel) for kernel in kernels}


def _layout_variants(layouts: Sequence[str]) -> Variants:
    return {layout: functools.partial(set_evolution_layout, layout=layout) for layout in layouts}


def _training_step(model: nn.Module, batch_size: int, dev: torch.device, amp: Optional[torch.dtype],
                   channels_last: bool) -> Callable[[nn.Module], None]:
    """``step(forward)``: one full training step of ``model`` (forward through ``forward``, the model or its compiled
    form; backward; AdamW) on a fixed random batch at 32×32. ``model`` is in its memory format already: the optimizer
    state takes the parameters' layout."""
    from timm.optim import create_optimizer_v2

    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3)
    x = _images(batch_size, 32, dev, channels_last)
    y = torch.randint(0, 10, (batch_size,), device=dev)
    # fp16 trains with loss scaling, as timm_attnconv.train does (its unscale and inf check are part of the step)
    grad_scaler = torch.amp.GradScaler(dev.type, enabled=amp is torch.float16)

    def step(forward: nn.Module) -> None:
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            loss = nn.functional.cross_entropy(forward(x), y)
        optimizer.zero_grad(set_to_none=True)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
    return step


def training_throughput(
        name: str, batch_size: int = 256, steps: int = 3, device: str = 'cpu', amp: Optional[torch.dtype] = None,
        compile_model: bool = False, max_warmup: int = MAX_WARMUP, channels_last: bool = False,
) -> Dict[str, object]:
    """img/s and achieved GFLOP/s of full training steps (forward, backward, AdamW) of ``name`` at 32×32: the median
    over ``steps`` timed steps after warm-up, with the range of img/s over them.

    FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one eager step (matrix products and
    convolutions of forward and backward; 2 per multiply-add)."""
    import timm
    from torch.utils.flop_counter import FlopCounterMode

    dev = torch.device(device)
    model = _prepared(timm.create_model(name).train().to(dev), False, channels_last)
    step = _training_step(model, batch_size, dev, amp, channels_last)
    # counted before compiling: the counter sees the eager operators; this step also creates the optimizer state
    with FlopCounterMode(display=False) as counter:
        step(model)
    timing = measure([functools.partial(step, _prepared(model, compile_model))], steps, dev, max_warmup)
    seconds = timing['seconds'][0]
    img_s = median_spread([batch_size / s for s in seconds])
    return dict(name=name, batch=batch_size, reps=steps, warmup_runs=timing['warmup_runs'],
                img_s=img_s['median'], img_s_min=img_s['min'], img_s_max=img_s['max'],
                gflop_s=counter.get_total_flops() / statistics.median(seconds) / 1e9)


def compare_training_variants(
        name: str, variants: Variants, label: str = 'variant',
        batch_size: int = 256, steps: int = 3, device: str = 'cpu', amp: Optional[torch.dtype] = None,
        compile_model: bool = False, max_warmup: int = MAX_WARMUP, channels_last: bool = False,
) -> List[Dict[str, object]]:
    """Training steps of ``name`` (as :func:`training_throughput`) in each variant (a copy of the model, same initial
    weights, set up by the variant's function), interleaved: a row per variant, named under ``label``, with img/s and
    ``speed`` = the first variant's step time over this one's (median and range over repetitions). A variant that
    cannot train here (a ``ValueError`` that says why: FlexAttention has no CPU backward) gives a row with its
    ``error``."""
    import copy

    import timm

    dev = torch.device(device)
    model = timm.create_model(name).train()
    rows, sides = [], []
    for variant_name, set_up in variants.items():
        variant = _prepared(set_up(copy.deepcopy(model)).to(dev), False, channels_last)
        step = _training_step(variant, batch_size, dev, amp, channels_last)
        row = {'name': name, 'batch': batch_size, label: variant_name, 'reps': steps}
        side = functools.partial(step, _prepared(variant, compile_model))
        try:
            step(variant)  # creates the optimizer state; a variant that cannot run says so here
            if compile_model:
                side()  # compiles here: a variant whose compile fails gets a row saying why, the others are timed
        except ValueError as error:
            rows.append(dict(row, error=str(error)))
            continue
        except torch._dynamo.exc.TorchDynamoException as error:
            rows.append(dict(row, error=_why_compiling_failed(error)))
            continue
        rows.append(row)
        sides.append(side)
    _time_against_the_first(rows, sides, batch_size, steps, dev, max_warmup)
    return rows


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
    speed = ratio_text(dict(median=r['speedup'], min=r['speedup_min'], max=r['speedup_max']))
    print(f"{r['name']:30s} {r['img_size']:4d} {r['batch']:5d} {r['original_img_s']:9.2f} {r['fast_img_s']:9.2f} "
          f"{speed:>19s} {r['original_peak_mb']:9.1f} {r['fast_peak_mb']:9.1f} {r['memory_ratio']:7.2f}x "
          f"{r['max_abs_diff']:10.2e} {r['buffer_bytes']:8d}", flush=True)


def _model_pair(text: str) -> Tuple[str, str]:
    name, _, baseline = text.partition(':')
    if not baseline:
        raise argparse.ArgumentTypeError(f'expected MODEL:BASELINE, as in aa_resnet50:resnet50, got {text!r}')
    return cli.model_name(name), cli.model_name(baseline)


def _optional_model(text: str) -> str:
    return text and cli.model_name(text)  # '' skips the bf16 check


def _header(what: str, args: argparse.Namespace) -> str:
    """The conditions a table was measured under, printed above it: its numbers mean little without them."""
    precision = 'fp32' if args.amp == 'none' else f'{args.amp} autocast'
    autotuned = ' (cuDNN autotuned)' if torch.device(args.device).type == 'cuda' and torch.backends.cudnn.benchmark \
        else ''
    layout = ', channels_last' if args.channels_last else ''
    return (f"{what}, device {args.device}{autotuned}, {torch.get_num_threads()} threads, {precision}, "
            f"compile {'on' if args.compile else 'off'}{layout}, torch {torch.__version__}\n{args.iters} interleaved "
            f"repetitions (ABBA) per side after warm-up (until two runs agree within {WARMUP_TOLERANCE:.0%}, "
            f"at most {args.max_warmup} runs); img/s: median; ratios: median (min–max) over repetitions")


def _options(args: argparse.Namespace) -> Dict[str, object]:
    return dict(amp=AMP_DTYPES[args.amp], compile_model=args.compile, max_warmup=args.max_warmup,
                channels_last=args.channels_last)


def _versus(pairs: Sequence[Tuple[str, str]], args: argparse.Namespace) -> List[Dict[str, object]]:
    print(_header('inference', args))
    print(f"{'model':22s} {'baseline':12s} {'px':>4s} {'batch':>5s} {'img/s':>8s} {'base img/s':>10s} {'time':>19s} "
          f"{'MB':>8s} {'base MB':>8s} {'memory':>7s}")
    rows = []
    for name, baseline in pairs:
        for size in args.sizes:
            r = compare_models(name, baseline, size, args.batch_size or 8, args.iters, args.device,
                               args.baseline_kwargs, evolution_layout=args.evolution_layout, **_options(args))
            time_ratio = ratio_text(dict(median=r['time_ratio'], min=r['time_ratio_min'], max=r['time_ratio_max']))
            print(f"{name:22s} {baseline:12s} {size:4d} {r['batch']:5d} {r['img_s']:8.2f} {r['baseline_img_s']:10.2f} "
                  f"{time_ratio:>19s} {r['peak_mb']:8.1f} {r['baseline_peak_mb']:8.1f} {r['memory_ratio']:6.2f}x",
                  flush=True)
            rows.append(r)
    print('time: model time / baseline time per image; memory: peak tensor allocations of one forward pass, '
          'model / baseline.')
    return rows


def _separable(model: nn.Module) -> bool:
    layers = [m for m in model.modules() if isinstance(m, PositionalSelfAttention)]
    return bool(layers) and all(layer.separable for layer in layers)


def _paths(args: argparse.Namespace) -> List[Dict[str, object]]:
    import timm
    import timm_attnconv
    names = args.models or [n for n in timm_attnconv.list_models(filter='sa_*') if '_tiny_' not in n
                            and _separable(timm.create_model(n, device='meta'))]  # structure only, no memory
    print(_header('exact attention algorithms, inference', args))
    print(f"{'model':24s} {'px':>4s} {'batch':>5s} {'auto':>17s} "
          + ' '.join(f'{path + " img/s":>24s} {"speed":>19s} {"MB":>8s}' for path in EXACT_PATHS[1:])
          + f" {'dense img/s':>11s} {'dense MB':>8s} {'max|Δlogit|':>11s}")
    rows = []
    for name in names:
        for size in args.sizes:
            batch = args.batch_size or DEFAULT_BATCH.get(size, max(1, 64 * 32 * 32 // (size * size)))
            r = compare_attn_paths(name, size, batch, args.iters, args.device, **_options(args))
            cells = ' '.join(f"{r['img_s'][path]:24.2f} {ratio_text(r['speed'][path]):>19s} {r['peak_mb'][path]:8.1f}"
                             for path in EXACT_PATHS[1:])
            print(f"{name:24s} {size:4d} {batch:5d} {r['auto']:>17s} {cells} {r['img_s']['dense']:11.2f} "
                  f"{r['peak_mb']['dense']:8.1f} {max(r['max_abs_diff'].values()):11.2e}", flush=True)
            rows.append(r)
    print("speed: dense time / the path's time (> 1: faster than dense); MB: peak tensor allocations of one forward "
          "pass; auto: the path attn_path='auto' takes here (timm_attnconv.layers.auto_path_rule).")
    return rows


def _chosen_variants(args: argparse.Namespace) -> Optional[Tuple[str, str, Variants]]:
    # --kernels or --evolution-layouts (those named, else all): what they compare, the label of their column and the
    # variants, the reference first; None without either
    if args.kernels is not None:
        kernels = args.kernels or [k for k in ATTN_KERNELS if k != 'auto']
        return 'attention kernels', 'kernel', _kernel_variants(kernels)
    if args.evolution_layouts is not None:
        return ('evolution convolution layouts', 'evolution conv',
                _layout_variants(args.evolution_layouts or EVOLUTION_LAYOUTS))
    return None


def _variants(args: argparse.Namespace, what: str, label: str, variants: Variants) -> List[Dict[str, object]]:
    # one table of compare_variants rows: each model of --models at each size (default: the model's own)
    form = ', the inference form (reparameterize_model)' if args.reparameterize else ''
    print(_header(f'{what}, inference{form}', args))
    print(f"{'model':32s} {'px':>4s} {'batch':>5s} {label:20s} {'img/s':>9s} {'speed':>19s} {'peak MB':>9s} "
          f"{'max|Δlogit|':>11s}")
    rows = []
    for name in args.models:
        for size in args.sizes or [None]:  # None: the model's default input size
            for r in compare_variants(name, size, args.batch_size or 8, variants, label, iters=args.iters,
                                      device=args.device, reparameterize=args.reparameterize, **_options(args)):
                head = f"{name:32s} {r['img_size']:4d} {r['batch']:5d} {r[label]:20s}"
                if 'error' in r:
                    print(f"{head} cannot run: {r['error']}", flush=True)
                else:
                    speed = ratio_text(dict(median=r['speed'], min=r['speed_min'], max=r['speed_max']))
                    print(f"{head} {r['img_s']:9.2f} {speed:>19s} {r['peak_mb']:9.1f} {r['max_abs_diff']:11.2e}",
                          flush=True)
                rows.append(r)
    reference = f"{next(iter(variants))} (where it cannot run, the next {label} that can)"
    print(f'speed: the time of {reference} / this {label}\'s time; peak MB: tensor allocations of one forward pass; '
          f'max|Δlogit|: against the same.')
    return rows


def _train(args: argparse.Namespace) -> List[Dict[str, object]]:
    import timm_attnconv
    names = args.models or timm_attnconv.list_models(filter=COMPACT_MODELS)
    print(_header('training steps (AdamW), 32 px', args))
    chosen = _chosen_variants(args)
    if chosen is not None:
        _, label, variants = chosen
        return _train_variants(names, args, label, variants)
    rows = []
    for name in names:
        row = training_throughput(name, args.batch_size or 256, args.iters, args.device, **_options(args))
        img_s = f"{row['img_s']:.1f} ({row['img_s_min']:.1f}–{row['img_s_max']:.1f})"
        print(f"{name:32s} batch {row['batch']:4d} {img_s:>24s} img/s {row['gflop_s']:8.1f} GFLOP/s", flush=True)
        rows.append(row)
    return rows


def _train_variants(names: Sequence[str], args: argparse.Namespace, label: str,
                    variants: Variants) -> List[Dict[str, object]]:
    rows = []
    for name in names:
        for r in compare_training_variants(name, variants, label, args.batch_size or 256, args.iters, args.device,
                                           **_options(args)):
            head = f"{name:32s} batch {r['batch']:4d} {r[label]:20s}"
            if 'error' in r:
                print(f"{head} cannot run: {r['error']}", flush=True)
            else:
                speed = ratio_text(dict(median=r['speed'], min=r['speed_min'], max=r['speed_max']))
                print(f"{head} {r['img_s']:9.1f} img/s {speed:>19s}", flush=True)
            rows.append(r)
    print(f"speed: the step time of {next(iter(variants))} (where it cannot run, the next {label} that can) / this "
          f"{label}'s step time.")
    return rows


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line of :func:`main`, checked (models, devices, option combinations) without running anything:
    what ``training/gpu/benchmark.sh`` is tested against, so that no GPU minute goes to a mistyped step."""
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='*', type=cli.model_name, default=None,
                        help='default: every paper-size model of the SA family')
    parser.add_argument('--sizes', nargs='*', type=cli.positive_int, default=None,
                        help='input sizes (default: 32 64 96; with --kernels each model\'s default size)')
    parser.add_argument('--batch-size', type=cli.positive_int, default=None,
                        help='default: 64 / 8 / 2 for 32 / 64 / 96 px (other sizes: 65,536 pixels a batch); 8 with '
                             '--versus, --kernels or --evolution-layouts; 256 with --train')
    parser.add_argument('--iters', type=cli.positive_int, default=5,
                        help='timed repetitions per side (interleaved ABBA with the other side); ratios are the '
                             'median over them, with their range')
    parser.add_argument('--max-warmup', type=cli.positive_int, default=MAX_WARMUP,
                        help=f'at most this many warm-up runs per side (warm-up stops earlier once two successive '
                             f'runs agree within {100 * WARMUP_TOLERANCE:g}%%)')  # %% : argparse formats help
    cli.add_device_arg(parser)
    parser.add_argument('--threads', type=cli.positive_int, default=None,
                        help='torch CPU threads (default: torch default)')
    cli.add_data_dir_arg(parser, use=', for the bf16 check (skipped if absent)')
    parser.add_argument('--bf16-model', type=_optional_model, default='sa_quadratic_cifar',
                        help='model for the bf16 check ("" to skip)')
    parser.add_argument('--train', action='store_true',
                        help='instead: training-step throughput of the compact CPU-trainable models (or --models), '
                             'batch 256; with --kernels or --evolution-layouts, each model through those kernels '
                             'or layouts, interleaved')
    parser.add_argument('--amp', choices=tuple(AMP_DTYPES), default='none',
                        help='autocast dtype of every timed side, inference and --train (fp16 training steps scale '
                             'the loss with a GradScaler, as timm_attnconv.train does)')
    parser.add_argument('--compile', action='store_true', help='torch.compile every timed model (each side alike)')
    parser.add_argument('--channels-last', action='store_true',
                        help='every timed model and its input in channels_last memory format (each side alike), as '
                             "timm's train.py and benchmark.py --channels-last run convolutional nets on GPUs")
    parser.add_argument('--paths', action='store_true',
                        help='instead: time the exact attention algorithms (dense, separable_loop, '
                             'separable_direct) of the separable SA models (or --models) against each other, and '
                             'show the one attn_path=auto takes on this device')
    parser.add_argument('--versus', nargs='*', type=_model_pair, default=None, metavar='MODEL:BASELINE',
                        help='instead: inference time and memory of models against baselines as ratios '
                             '(default pair aa_resnet50:resnet50; use --sizes 224 320)')
    parser.add_argument('--kernels', nargs='*', choices=[k for k in ATTN_KERNELS if k != 'auto'], default=None,
                        help='instead: inference of --models with each attention kernel (default: explicit sdpa '
                             'sdpa_onehot flex; speed is relative to the first)')
    parser.add_argument('--evolution-layouts', nargs='*', choices=EVOLUTION_LAYOUTS, default=None,
                        help='instead: inference of --models (evolving-attention models) with the update of their '
                             'attention maps in each of these layouts (default: all, the default first: auto, '
                             'channels_last, the update as one Triton kernel at inference on CUDA); speed is '
                             'relative to the first')
    parser.add_argument('--evolution-layout', choices=EVOLUTION_LAYOUTS, default=None,
                        help='with --versus: every evolving-attention model of the pairs with its maps\' update in '
                             'this layout (default: the models\' own, auto)')
    parser.add_argument('--reparameterize', action='store_true',
                        help='with --kernels or --evolution-layouts: time each model\'s inference form '
                             '(timm.utils.reparameterize_model: projections folded, a content layer\'s keys folded '
                             'into its queries), as the original-vs-fast comparison does')
    parser.add_argument('--baseline-kwargs', type=cli.json_object, default=None,
                        help='JSON kwargs for the --versus baselines, e.g. \'{"evolve": false}\' for the base of an '
                             'EA model')
    parser.add_argument('--bf16-images', type=cli.positive_int, default=128,
                        help='test images for the bf16 check (bf16 matmul is slow on CPUs without bf16 units)')
    args = parser.parse_args(argv)
    if args.kernels is not None and not args.models:
        parser.error('--kernels times the models named by --models, e.g. aa_resnet50 sa_learned_content_cifar')
    if args.evolution_layouts is not None and not args.models:
        parser.error('--evolution-layouts times the models named by --models, e.g. deit_ea_small_patch16_224')
    if args.reparameterize and (args.train or (args.kernels is None and args.evolution_layouts is None)):
        parser.error('--reparameterize times the inference form of the models of --kernels or --evolution-layouts '
                     '(not of --train, which trains the model as built)')
    if args.evolution_layout is not None and args.versus is None:
        parser.error('--evolution-layout sets the layout of the --versus pairs\' EA models; to compare layouts of '
                     'one model: --evolution-layouts')
    tables = [option for option, given in (('--paths', args.paths), ('--versus', args.versus is not None),
                                           ('--kernels', args.kernels is not None),
                                           ('--evolution-layouts', args.evolution_layouts is not None)) if given]
    if len(tables) > 1:
        parser.error(f"{' and '.join(tables)} each print a table of their own: run one per command")
    if args.train and tables and tables[0] not in ('--kernels', '--evolution-layouts'):
        parser.error(f'--train times training steps of --models, per kernel or layout with --kernels or '
                     f'--evolution-layouts; {tables[0]} times inference: run it on its own')
    if args.train and args.sizes is not None:
        parser.error('--train times training steps at 32 px, the CIFAR size of the models it trains: drop --sizes')
    if args.versus is not None and args.models:
        parser.error('--versus times the models of its MODEL:BASELINE pairs: name them there, not with --models')
    if args.baseline_kwargs is not None and args.versus is None:
        parser.error('--baseline-kwargs goes to the baselines of --versus pairs')
    return args


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    import timm_attnconv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cli.tune_for_device(args.device)
    if args.train:
        return _train(args)
    chosen = _chosen_variants(args)
    if chosen is not None:
        return _variants(args, *chosen)
    if args.sizes is None:
        args.sizes = [32, 64, 96]
    if args.paths:
        return _paths(args)
    if args.versus is not None:
        return _versus(args.versus or [('aa_resnet50', 'resnet50')], args)
    names = args.models or [n for n in timm_attnconv.list_models(filter='sa_*') if '_tiny_' not in n]
    print(_header('original vs fast path, inference', args))
    print(f"{'model':30s} {'px':>4s} {'batch':>5s} {'orig img/s':>9s} {'fast img/s':>9s} {'speed':>19s} "
          f"{'orig MB':>9s} {'fast MB':>9s} {'memory':>8s} {'max|Δlogit|':>10s} {'buffers':>8s}")
    rows = []
    for name in names:
        for size in args.sizes:
            batch = args.batch_size or DEFAULT_BATCH.get(size, max(1, 64 * 32 * 32 // (size * size)))
            row = compare_paths(name, size, batch, args.iters, args.device, **_options(args))
            _print_row(row)
            rows.append(row)
    print(f'Original code also holds a {ORIGINAL_R_BUFFER_MB:.0f} MB position buffer per quadratic layer; '
          f'"buffers" is what the fast model holds, in bytes.')
    if args.bf16_model:
        try:  # any folder load_cifar10 reads; without one, skipped unless --data-dir named it
            r = bf16_top1_agreement(args.bf16_model, args.data_dir or default_data_dir(), args.bf16_images,
                                    device=args.device)
        except FileNotFoundError as error:
            if args.data_dir:
                raise
            print(f'bf16 check skipped: {error}')
            return rows
        weights = 'pretrained' if r['pretrained'] else 'random-init, no weights yet'
        print(f"bf16 autocast vs fp32 top-1 agreement, {r['name']} ({weights}), {r['images']} CIFAR-10 test "
              f"images: {100 * r['agreement']:.1f}%")
    return rows


if __name__ == '__main__':
    cli.run(main)
