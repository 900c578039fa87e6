"""CIFAR-10 as the ImageFolder tree that timm's own scripts (train.py, validate.py, inference.py) read.

    python -m timm_attnconv.imagefolder OUT --split test           # OUT/validation/<label>_<class>/<index>.png
    python -m timm_attnconv.imagefolder OUT --split train --classes cat dog --per-class 300      # a 2-class task
"""
import os
from typing import List, Optional, Sequence

from . import cli
from .data import SPLITS, write_image_folder

__all__ = ['main']


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    parser = cli.parser(__spec__.name, __doc__.split('\n')[0])
    parser.add_argument('out_dir')
    parser.add_argument('--split', choices=sorted(SPLITS), default='test')
    parser.add_argument('--classes', nargs='+', default=None, metavar='NAME', help='a subset of the classes, by name')
    parser.add_argument('--per-class', type=cli.positive_int, default=None, metavar='N',
                        help='the first N images of each class')
    cli.add_data_dir_arg(parser, 'train.npz / test.npz')
    args = parser.parse_args(argv)
    paths = write_image_folder(args.out_dir, args.split, args.classes, args.per_class, args.data_dir)
    print(f'wrote {len(paths)} images under {os.path.dirname(os.path.dirname(paths[0]))}')
    return paths


if __name__ == '__main__':
    cli.run(main)
