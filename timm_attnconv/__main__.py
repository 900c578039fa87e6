"""``python -m timm_attnconv``: create every registered model, count it, run it.

Prints one row per model: parameters, GMACs (fvcore, the path the model runs) and the paper-style GFLOPs, then the
logits shape and the time of one forward pass (after a warm-up) on a batch of 8 images at the model's default input size.
"""
import argparse
import time
from typing import Optional, Sequence

import torch
from tqdm import tqdm


def main(argv: Optional[Sequence[str]] = None) -> None:
    import timm
    import timm_attnconv
    from timm_attnconv.flops import model_report

    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('models', nargs='*', help='model names (default: all registered)')
    args = parser.parse_args(argv)
    names = args.models or timm_attnconv.list_models()

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
    print('\nGMACs: fvcore with exact attention handles, one 32×32 image. Paper-style: 2 × MACs of Linear layers '
          'and stem only, the convention of the paper\'s FLOP column.')


if __name__ == '__main__':
    main()
