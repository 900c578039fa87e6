"""``python -m timm_attnconv``: classify the bundled CIFAR-10 samples with every pretrained model, then count and run
every registered model.

Part 1 loads each model that has weights (``pretrained=True``: the clone's ``weights/`` folder, else the Hub), prints
its prediction for each sample image in ``timm_attnconv/samples/`` and its accuracy on them. Part 2 prints one row per
model: parameters, GMACs (fvcore, the path the model runs), the paper-style GFLOPs and the time of one forward pass
(after a warm-up) on a batch of 8 images at the model's default input size.
"""
import argparse
import time
from typing import Dict, List, Optional, Sequence

import torch
from tqdm import tqdm


def classify_samples(names: Sequence[str]) -> Dict[str, List[int]]:
    """Predicted class of every bundled sample image for each pretrained model in ``names``; prints the table."""
    import timm
    from .data import CIFAR10_CLASSES, load_samples, normalize

    images, labels, files = load_samples()
    predictions = {}
    for name in names:
        model = timm.create_model(name, pretrained=True).eval()
        with torch.no_grad():
            probs = model(normalize(images, model.pretrained_cfg['mean'], model.pretrained_cfg['std'])).softmax(-1)
        predictions[name] = probs.argmax(-1).tolist()
        confidence = probs.max(-1).values.tolist()
        print(f'\n{name} ({timm.models.get_pretrained_cfg(name).hf_hub_id}) on {len(files)} bundled test images:')
        print(f"{'image':20s} {'label':11s} {'predicted':11s} {'p':>5s}")
        for file, label, pred, p in zip(files, labels.tolist(), predictions[name], confidence):
            mark = '' if pred == label else '  ✗'
            print(f'{file:20s} {CIFAR10_CLASSES[label]:11s} {CIFAR10_CLASSES[pred]:11s} {p:5.2f}{mark}')
        correct = sum(p == t for p, t in zip(predictions[name], labels.tolist()))
        print(f'accuracy: {correct}/{len(files)} = {100 * correct / len(files):.0f}%')
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

    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('models', nargs='*', help='model names (default: all registered)')
    args = parser.parse_args(argv)
    names = args.models or timm_attnconv.list_models()
    classify_samples([n for n in timm_attnconv.list_models(pretrained=True) if n.split('.')[0] in names])
    model_table(names)


if __name__ == '__main__':
    main()
