"""Run an unmodified script (e.g. timm's ``train.py``) with this package's models registered.

    python -m timm_attnconv.run path/to/pytorch-image-models/train.py --model sa_quadratic_tiny_cifar ...
    python -m timm_attnconv.run -m some.module --its-args ...
    torchrun --nproc_per_node 2 -m timm_attnconv.run train.py ...

timm has no plugin mechanism: its scripts know only registered names. This imports ``timm_attnconv`` (which registers
the models) and then runs the script as ``python script.py args`` would: ``sys.argv``, ``__main__``, the script's
folder first on ``sys.path`` (``python -m`` also keeps the current folder there, after it), its exit code. Nothing
is installed into site-packages (a ``.pth`` hook would import torch and timm at every Python start).
"""
import importlib.util
import os
import runpy
import sys
from typing import Optional, Sequence

from . import cli

USAGE = 'usage: python -m timm_attnconv.run SCRIPT.py [ARGS...]  |  python -m timm_attnconv.run -m MODULE [ARGS...]'


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is not there
        return False


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Not through :func:`cli.run`: the script's own errors keep their traceback, as under ``python script.py``."""
    program = cli.prog(__spec__.name)
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (['-h'], ['--help']):
        print(__doc__.strip() + '\n\n' + USAGE)
        raise SystemExit(0)
    if not args:
        cli.fail(program, f'name the script to run: {USAGE}')
    import timm_attnconv  # noqa: F401  (registers the models with timm)

    if args[0] == '-m':
        if len(args) < 2:
            cli.fail(program, f'-m needs a module name: {USAGE}')
        if not _module_exists(args[1]):
            cli.fail(program, f'no module named {args[1]!r} (-m takes a module that Python can import): {USAGE}')
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name='__main__', alter_sys=True)
        return
    script = args[0]
    if not os.path.isfile(script):
        cli.fail(program, f'no such script: {script!r} (pass the path of a timm script, e.g. '
                          f'pytorch-image-models/train.py): {USAGE}')
    sys.argv = [script] + args[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name='__main__')


if __name__ == '__main__':
    main()
