"""Where a model's inference time goes, op by op: the profile to read before optimising the models that miss issue
18's GPU targets (AA-ResNet-50 against ResNet-50, the EA models against their bases, the SA fast path at 96 px).

    PYTHONPATH=. python3 training/gpu/op_profile.py aa_resnet50 resnet50 'ea_aa_resnet50:{"evolve": false}' ...

Each MODEL[:JSON kwargs] at its default input size (or --img-size), in eval mode, under --amp autocast (default
bf16), optionally compiled, is warmed up as the benchmark does (until two timings agree) and then profiled over
--steps forward passes with torch.profiler; printed: its time per image and the --top ops by self time on the device
(the CPU when --device cpu). --evolution-layout sets how the EA models' maps evolve (set_evolution_layout), e.g.
'channels_last', the reference update, against the default's Triton kernel. Run it on an idle GPU.
"""
import argparse
import json

import timm
import torch

from timm_attnconv.benchmark import MAX_WARMUP, inference_call, seconds_of, warm_up  # registers the models too
from timm_attnconv.cli import tune_for_device
from timm_attnconv.constants import AMP_DTYPES
from timm_attnconv.layers import EVOLUTION_LAYOUTS, set_evolution_layout


def _model_and_kwargs(text):
    name, _, kwargs = text.partition(':')
    return name, json.loads(kwargs) if kwargs else {}


def profile(name, kwargs, args):
    device = torch.device(args.device)
    model = timm.create_model(name, **kwargs).eval().to(device)
    if args.evolution_layout:
        set_evolution_layout(model, args.evolution_layout)
    size = model.pretrained_cfg['input_size']
    if args.img_size:
        size = (size[0], args.img_size, args.img_size)
    x = torch.randn(args.batch_size, *size, device=device)
    run = inference_call(torch.compile(model) if args.compile else model, x, AMP_DTYPES[args.amp])
    warm_up(run, device, max_runs=args.max_warmup)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # input shapes tell the AA branches' convolutions (odd channel counts) from the plain ones of the same op
    with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
        seconds = seconds_of(lambda: [run() for _ in range(args.steps)], device)
    per_image_us = seconds / (args.steps * args.batch_size) * 1e6
    sort_by = 'self_device_time_total' if device.type == 'cuda' else 'self_cpu_time_total'
    label = f'{name} {json.dumps(kwargs)}' if kwargs else name
    if args.evolution_layout:
        label += f', evolution layout {args.evolution_layout}'
    print(f"== {label}, {size[1]} px, batch {args.batch_size}, "
          f"{args.amp}, compile {'on' if args.compile else 'off'}: {per_image_us:.1f} µs/image while profiled")
    print(prof.key_averages(group_by_input_shape=args.shapes).table(sort_by=sort_by, row_limit=args.top), flush=True)


def parse_args(argv=None):
    """The command line (``argv``, default ``sys.argv[1:]``); ``benchmark.sh --profile`` is tested against it."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('models', nargs='+', type=_model_and_kwargs, metavar='MODEL[:JSON]')
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--amp', choices=tuple(AMP_DTYPES), default='bf16')
    parser.add_argument('--compile', action='store_true')
    parser.add_argument('--batch-size', type=int, default=128)
    parser.add_argument('--img-size', type=int, help='input height and width of every model (default: its own)')
    parser.add_argument('--max-warmup', type=int, default=MAX_WARMUP,
                        help='warm-up runs at most (until two timings agree)')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--top', type=int, default=25)
    parser.add_argument('--shapes', action='store_true', help='one row per op and input shapes')
    parser.add_argument('--evolution-layout', choices=EVOLUTION_LAYOUTS,
                        help="how every evolving-attention model's maps evolve (default: the models' own, 'auto')")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    tune_for_device(args.device)  # as the benchmark and the trainer do
    print(f'torch {torch.__version__}, timm {timm.__version__}, '
          f'{torch.cuda.get_device_name() if args.device == "cuda" else args.device}')
    for name, kwargs in args.models:
        profile(name, kwargs, args)


if __name__ == '__main__':
    main()
