"""Run an unmodified script (e.g. timm's ``train.py``) with this package's models registered.

    python -m timm_attnconv.run path/to/pytorch-image-models/train.py --model sa_quadratic_tiny_cifar ...
    python -m timm_attnconv.run -m some.module --its-args ...
    torchrun --nproc_per_node 2 -m timm_attnconv.run train.py ...

timm has no plugin mechanism: its scripts know only registered names. This imports ``timm_attnconv`` (which registers
the models) and then runs the script exactly as ``python script.py args`` would: ``sys.argv``, ``__main__``, the
script's folder on ``sys.path``, its exit code. Nothing is installed into site-packages (a ``.pth`` hook would import
torch and timm at every Python start).
"""
import os
import runpy
import sys
from typing import Optional, Sequence

USAGE = 'usage: python -m timm_attnconv.run SCRIPT.py [ARGS...]  |  python -m timm_attnconv.run -m MODULE [ARGS...]'


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ('-h', '--help'):
        print(__doc__.strip() + '\n\n' + USAGE)
        raise SystemExit(0 if args else 2)
    import timm_attnconv  # noqa: F401  (registers the models with timm)

    if args[0] == '-m':
        if len(args) < 2:
            raise SystemExit(f'-m needs a module name\n{USAGE}')
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name='__main__', alter_sys=True)
        return
    script = args[0]
    if not os.path.isfile(script):
        raise SystemExit(f'no such script: {script!r} (pass the path of a timm script, e.g. '
                         f'pytorch-image-models/train.py)\n{USAGE}')
    sys.argv = [script] + args[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
