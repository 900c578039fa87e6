"""``python -m timm_attnconv``: classify the bundled CIFAR-10 samples with every pretrained model, the headline
model first; with ``--table``, also count and run every registered model.

Part 1 loads each model that has weights (``pretrained=True``: the clone's ``weights/`` folder, else the Hub),
``HEADLINE`` first and then largest first, prints the leading model's prediction for each sample image in
``timm_attnconv/samples/`` and every model's accuracy on them. Part 2 (``--table``) prints one row per model:
parameters, GMACs (fvcore, the path the model runs), the paper-style GFLOPs and the time of one forward pass (after a
warm-up) on a batch of 8 images at the model's default input size.
"""
import time
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm

from . import cli

# the model the README leads with: the first row of Cordonnier et al. 2020, Table 1, at paper size
HEADLINE = 'sa_quadratic_cifar.c10'


def classify_samples(names: Sequence[str]) -> Dict[str, List[int]]:
    """Predicted class of every bundled sample image for each pretrained model in ``names``, ``HEADLINE`` first, then
    in order of size (most parameters first); prints the first model's predictions per image and every model's
    accuracy."""
    import timm
    from .data import CIFAR10_CLASSES, load_samples, normalize

    images, labels, files = load_samples()
    models = {name: timm.create_model(name, pretrained=True).eval() for name in names}
    models = dict(sorted(models.items(), key=lambda item: (item[0] != HEADLINE,
                                                           -sum(p.numel() for p in item[1].parameters()))))
    predictions, confidences = {}, {}
    for name, model in models.items():
        with torch.no_grad():
            probs = model(normalize(images, model.pretrained_cfg['mean'], model.pretrained_cfg['std'])).softmax(-1)
        predictions[name] = probs.argmax(-1).tolist()
        confidences[name] = probs.max(-1).values.tolist()

    for lead in list(models)[:1]:
        print(f'\n{lead} ({timm.models.get_pretrained_cfg(lead).hf_hub_id}) on {len(files)} bundled test images:')
        print(f"{'image':20s} {'label':11s} {'predicted':11s} {'p':>5s}")
        for file, label, pred, p in zip(files, labels.tolist(), predictions[lead], confidences[lead]):
            mark = '' if pred == label else '  ✗'
            print(f'{file:20s} {CIFAR10_CLASSES[label]:11s} {CIFAR10_CLASSES[pred]:11s} {p:5.2f}{mark}')
    width = max(len('pretrained model'), *map(len, models))
    print(f"\n{'pretrained model':{width}s} {'params':>12s}   on the samples")
    for name, model in models.items():
        correct = sum(p == t for p, t in zip(predictions[name], labels.tolist()))
        params = sum(p.numel() for p in model.parameters())
        print(f'{name:{width}s} {params:12,d}   accuracy: {correct}/{len(files)} = {100 * correct / len(files):.0f}%')
    return predictions


def model_table(names: Sequence[str]) -> None:
    import timm
    from .flops import model_report

    rows = []
    for name in tqdm(names, desc='models', unit='model'):
        report = model_report(name)
        model = timm.create_model(name).eval()
        x = torch.randn(8, *model.pretrained_cfg['input_size'])
        with torch.no_grad():
            model(x)  # warm-up: the first call pays one-off allocation costs
            start = time.perf_counter()
            logits = model(x)
            seconds = time.perf_counter() - start
        if not torch.isfinite(logits).all():
            raise RuntimeError(f'{name} produced non-finite logits')
        rows.append((name, report['params'], report['macs'] / 1e9, report['paper_gflops'],
                     tuple(logits.shape), seconds * 1000))

    print(f"\n{'model':32s} {'params':>12s} {'GMACs':>7s} {'paper-style GFLOPs':>19s} {'logits':>9s} "
          f"{'forward, batch 8':>17s}")
    for name, params, gmacs, paper, shape, ms in rows:
        print(f'{name:32s} {params:12,d} {gmacs:7.3f} {paper:19.3f} {str(shape):>9s} {ms:14.0f} ms')
    print('\nGMACs: fvcore with exact attention handles, one image at the default input size. Paper-style GFLOPs: '
          'the convention of each paper, 2 × MACs of Linear layers and stem for Cordonnier et al. (their counter '
          'missed attention), 2 × all MACs for Bello et al.')


def main(argv: Optional[Sequence[str]] = None) -> None:
    import timm_attnconv

    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('models', nargs='*', type=cli.model_name,
                        help='model names, an architecture (all its weights) or one tag of it (arch.tag; default: '
                             'every model with weights; with --table, every registered model)')
    parser.add_argument('--table', action='store_true',
                        help='also count the FLOPs of the models and time a forward pass (all 25 models: about a '
                             'minute and a half on 2 CPU cores)')
    args = parser.parse_args(argv)
    archs = list(dict.fromkeys(name.split('.')[0] for name in args.models))
    foreign = sorted(set(archs) - set(timm_attnconv.list_models()))
    if foreign:
        parser.error(f"{', '.join(foreign)}: not a model of this package; {cli.LIST_MODELS}")
    with_weights = timm_attnconv.list_models(pretrained=True)
    untagged = sorted(name for name in args.models if '.' in name and name not in with_weights)
    if untagged:
        parser.error(f"{', '.join(untagged)}: no such pretrained tag; "
                     f'`python -c "import timm_attnconv; print(timm_attnconv.list_models(pretrained=True))"` lists '
                     f'them')
    pretrained = [n for n in with_weights if not args.models or n in args.models or n.split('.')[0] in args.models]
    if pretrained:
        classify_samples(pretrained)
    else:
        print(f"none of {', '.join(args.models)} has pretrained weights: no predictions")
    if args.table:
        model_table(archs or timm_attnconv.list_models())
    else:
        print('\nThe model table (parameters, GMACs, forward time of every registered model): '
              'python -m timm_attnconv --table')


if __name__ == '__main__':
    cli.run(main)
