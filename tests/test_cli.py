"""Every ``python -m timm_attnconv.<tool>`` fails like a command-line tool: a bad argument or input gets one line on
stderr that names the problem and the fix, a non-zero exit status and no traceback.

The table runs each tool's ``main`` in this process through :func:`timm_attnconv.cli.run`, the function its
``__main__`` block calls; two subprocesses check that a real terminal sees the same, and a third what the tools
that train and evaluate set in their own process (:func:`timm_attnconv.cli.keep_freed_memory`).
"""
import argparse
import ast
import importlib
import json
import os
import pkgutil
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import timm_attnconv
from timm_attnconv import cli
from timm_attnconv.data import SAMPLES_DIR
from timm_attnconv.pretrained import bundled_weights_dir


SAMPLE = os.path.join(SAMPLES_DIR, '00000_cat.png')
WEIGHTS = str(bundled_weights_dir() / 'sa_quadratic_tiny_cifar.c10' / 'model.safetensors')
TINY = ['--model', 'sa_quadratic_tiny_cifar']
USAGE, INPUT = 2, 1  # exit statuses: a bad argument, an input or run that cannot be used

# tool ('' is the package's own __main__), argv ({tmp}: a folder of bad inputs, see `inputs`; {cifar10}: the synthetic
# CIFAR-10 of conftest.py), exit status, what the one error line must say
BAD_ARGUMENTS = [
    ('', ['no_such_model'], USAGE, "unknown model 'no_such_model'"),
    ('', ['resnet50'], USAGE, 'resnet50: not a model of this package'),
    ('', ['sa_quadratic_tiny_cifar.c99'], USAGE, 'sa_quadratic_tiny_cifar.c99: no such pretrained tag'),
    ('', ['--tabel'], USAGE, 'unrecognized arguments: --tabel'),
    ('benchmark', ['--sizes', '0'], USAGE, "argument --sizes: expected a whole number ≥ 1, got '0'"),
    ('benchmark', ['--iters', 'two'], USAGE, "argument --iters: expected a whole number ≥ 1, got 'two'"),
    ('benchmark', ['--versus', 'aa_resnet50'], USAGE, 'argument --versus: expected MODEL:BASELINE'),
    ('benchmark', ['--versus', 'aa_resnet50:resnet5O'], USAGE, "unknown model 'resnet5O'"),
    ('benchmark', ['--baseline-kwargs', '[1]'], USAGE, 'argument --baseline-kwargs: expected a JSON object'),
    ('benchmark', ['--device', 'gpu'], USAGE, "argument --device: 'gpu' is not a torch device"),
    ('benchmark', ['--max-warmup', '0'], USAGE, "argument --max-warmup: expected a whole number ≥ 1, got '0'"),
    ('benchmark', ['--amp', 'fp8'], USAGE, "argument --amp: invalid choice: 'fp8'"),
    ('benchmark', ['--paths', '--versus'], USAGE, '--paths and --versus each print a table of their own'),
    ('benchmark', ['--train', '--paths'], USAGE, '--paths times inference: run it on its own'),
    ('benchmark', ['--train', '--sizes', '64'], USAGE, '--train times training steps at 32 px'),
    ('benchmark', ['--versus', '--models', 'aa_resnet50'], USAGE, 'name them there, not with --models'),
    ('benchmark', ['--baseline-kwargs', '{"evolve": false}'], USAGE, '--baseline-kwargs goes to the baselines'),
    ('benchmark', ['--versus', 'attnconv_resnet20_cifar:resnet18', '--baseline-kwargs', '{"foo": 1}', '--sizes', '8',
                   '--batch-size', '1', '--iters', '1'], USAGE, 'resnet18 does not take --baseline-kwargs {"foo": 1}'),
    ('evaluate', TINY + ['--limit', '0'], USAGE, "argument --limit: expected a whole number ≥ 1, got '0'"),
    ('evaluate', TINY + ['--batch-size', '-5'], USAGE, 'argument --batch-size'),
    ('evaluate', TINY + ['--device', 'cuda:7'], USAGE, 'argument --device: cuda:7: torch sees'),
    ('evaluate', ['--pretrained'], USAGE, 'the following arguments are required: --model'),
    ('evaluate', TINY + ['--checkpoint', WEIGHTS, '--ema'], USAGE, '--ema needs a training checkpoint'),
    ('evaluate', TINY + ['--checkpoint', '{tmp}/missing.pth.tar'], USAGE, "missing.pth.tar': no such file"),
    ('evaluate', TINY + ['--checkpoint', '{tmp}/garbage.pth.tar'], INPUT, 'the file is truncated or corrupt'),
    ('evaluate', TINY + ['--checkpoint', '{tmp}/timm_train.pth.tar'], INPUT,
     "holds argparse.Namespace objects, which no training checkpoint of `python -m timm_attnconv.train` does"),
    ('evaluate', ['--model', 'aa_resnet20_cifar', '--checkpoint', '{tmp}/run/last.pth.tar'], INPUT,
     'is a checkpoint of sa_quadratic_tiny_cifar, not of aa_resnet20_cifar: pass --model sa_quadratic_tiny_cifar'),
    ('evaluate', TINY + ['--data-dir', '{tmp}'], INPUT, 'no CIFAR-10 test data in'),
    ('evaluate', TINY + ['--checkpoint', '{tmp}/pruned.safetensors'], USAGE,
     'Pass the --model (and --model-kwargs) the file was saved from (pruned weights: --model-kwargs '
     '\'{"num_heads": [9, 8, 9, 9, 9, 9]}\')'),
    ('evaluate', TINY + ['--model-kwargs', '[9]'], USAGE, 'argument --model-kwargs: expected a JSON object'),
    ('flops', ['sa_quadratic_tiny'], USAGE, "argument models: unknown model 'sa_quadratic_tiny'"),
    ('flops', ['--model', 'aa_resnet20_cifar'], USAGE, 'unrecognized arguments: --model'),  # not --model-kwargs
    ('flops', ['--img-size', '-32'], USAGE, "argument --img-size: expected a whole number ≥ 1, got '-32'"),
    ('flops', ['aa_resnet20_cifar', '--model-kwargs', '{"foo": 1}'], USAGE,
     'aa_resnet20_cifar does not take --model-kwargs {"foo": 1}'),
    ('imagefolder', ['{tmp}/out', '--per-class', '0'], USAGE, 'argument --per-class'),
    ('imagefolder', ['{tmp}/out', '--split', 'val'], USAGE, "argument --split: invalid choice: 'val'"),
    ('imagefolder', ['{tmp}/out', '--classes', 'kitten'], INPUT, "unknown CIFAR-10 classes ['kitten']"),
    ('predict', [SAMPLE] + TINY + ['--model-kwargs', '{"num_head": 3}'], USAGE,
     'sa_quadratic_tiny_cifar does not take --model-kwargs {"num_head": 3}'),
    ('predict', [SAMPLE] + TINY + ['--topk', '0'], USAGE, "argument --topk: expected a whole number ≥ 1, got '0'"),
    ('predict', [SAMPLE] + TINY + ['--num-classes', '2.5'], USAGE, 'argument --num-classes'),
    ('predict', [SAMPLE] + TINY + ['--pretrained', '--checkpoint', WEIGHTS], USAGE, 'not allowed with argument'),
    ('predict', ['{tmp}/missing.png'] + TINY, INPUT, "no such image file or folder: '"),
    ('predict', [SAMPLE, '--model', 'aa_resnet20_cifar', '--checkpoint', WEIGHTS], USAGE,
     'holds sa_quadratic_tiny_cifar weights (says the config.json beside it), not aa_resnet20_cifar'),
    ('predict', [SAMPLE, '--model', 'aa_resnet20_cifar', '--checkpoint', '{tmp}/lone.safetensors'], USAGE,
     "does not fit aa_resnet20_cifar: 152 of its tensors are missing from the file"),
    ('predict', [SAMPLE] + TINY + ['--checkpoint', '{tmp}/lone.safetensors', '--num-classes', '5'], USAGE,
     'does not fit sa_quadratic_tiny_cifar: the file\'s tensors have other shapes'),
    ('predict', [SAMPLE] + TINY + ['--checkpoint', '{tmp}/garbage.safetensors'], INPUT,
     'as a .safetensors weights file (Error while deserializing header'),
    ('predict', [SAMPLE, '--model', 'aa_resnet20_cifar', '--checkpoint', '{tmp}/run/last.pth.tar'], INPUT,
     'is a checkpoint of sa_quadratic_tiny_cifar, not of aa_resnet20_cifar'),
    ('predict', [SAMPLE] + TINY + ['--checkpoint', '{tmp}/run/last.pth.tar', '--num-classes', '5'], USAGE,
     'num_classes cannot change the model of a training checkpoint'),
    ('prune', TINY + ['--min-eig=-1e-5'], USAGE, "argument --min-eig: expected a finite number ≥ 0, got '-1e-5'"),
    ('prune', TINY + ['--max-cond', 'inf'], USAGE, "argument --max-cond: expected a finite number > 0, got 'inf'"),
    ('prune', TINY + ['--num-heads', '7,x'], USAGE,
     "argument --num-heads: expected whole numbers ≥ 1 separated by commas, such as 7,5,8,7,3,9, got '7,x'"),
    ('prune', TINY + ['--out', '{tmp}/p.st'], USAGE,
     "argument --out: expected a file name ending in .safetensors, as the tools read weights files, got '"),
    ('prune', TINY + ['--num-heads', '9,9'], INPUT,
     'num_heads=(9, 9) does not fit a model with (9, 9, 9, 9, 9, 9) heads per layer: give one count per layer'),
    ('prune', ['--model', 'sa_quadratic_cifar', '--checkpoint', '{tmp}/run/last.pth.tar'], INPUT,
     'is a checkpoint of sa_quadratic_tiny_cifar, not of sa_quadratic_cifar'),
    ('publish', ['{tmp}/missing'], INPUT, 'lacks config.json, model.safetensors, README.md: stage it'),
    ('publish', ['{tmp}/a', '{tmp}/b', '--repo-id', 'me/x'], USAGE, '--repo-id names one repo'),
    ('run', [], USAGE, 'name the script to run'),
    ('run', ['{tmp}/missing.py'], USAGE, 'no such script'),
    ('run', ['-m'], USAGE, '-m needs a module name'),
    ('run', ['-m', 'no_such_module.inside'], USAGE, "no module named 'no_such_module.inside'"),
    ('stage', ['{tmp}', '--tag', 'c10/x'], USAGE, "argument --tag: expected letters, digits, _ or -"),
    ('stage', ['{tmp}', '--tag', 'c10', '--limit', '0'], USAGE, 'argument --limit'),
    ('stage', ['{tmp}', '--tag', 'c10', '--dtype', 'float64'], USAGE, "argument --dtype: invalid choice: 'float64'"),
    ('stage', ['{tmp}', '--tag', 'c10'], INPUT, 'holds no training checkpoint (last.pth.tar) and no weights'),
    ('theory', ['--model', 'attnconv_resnet20_cifar', '--batch-size', '0'], USAGE, 'argument --batch-size'),
    ('theory', ['--model', 'attnconv_resnet20_cifar', '--checkpoint', '{tmp}/run/last.pth.tar'], INPUT,
     'is a checkpoint of sa_quadratic_tiny_cifar, not of attnconv_resnet20_cifar'),
    ('train', TINY + ['--output', '{tmp}/r', '--epochs', '0'], USAGE, 'argument --epochs: expected a whole number'),
    ('train', TINY + ['--output', '{tmp}/r', '--lr', 'nan'], USAGE, "argument --lr: expected a finite number ≥ 0"),
    ('train', TINY + ['--output', '{tmp}/r', '--smoothing', '1.5'], USAGE, 'argument --smoothing: expected a number '
                                                                         'in [0, 1)'),
    ('train', TINY + ['--output', '{tmp}/r', '--model-ema-decay', '1'], USAGE, 'argument --model-ema-decay'),
    ('train', TINY + ['--output', '{tmp}/r', '--clip-grad', '0'], USAGE, 'argument --clip-grad'),
    ('train', TINY + ['--output', '{tmp}/r', '--warmup-epochs', '-1'], USAGE, 'argument --warmup-epochs'),
    ('train', TINY + ['--output', '{tmp}/r', '--eval-every', '0'], USAGE, 'argument --eval-every'),
    ('train', TINY + ['--output', '{tmp}/r', '--eval', '5'], USAGE, 'unrecognized arguments: --eval'),
    ('train', TINY + ['--output', '{tmp}/r', '--log-interval', '0'], USAGE, 'argument --log-interval'),
    ('train', TINY + ['--output', '{tmp}/r', '--train-limit', '0'], USAGE, 'argument --train-limit'),
    ('train', TINY + ['--output', '{tmp}/r', '--model-kwargs', '{"depth": 2'], USAGE,
     'argument --model-kwargs: expected a JSON object'),
    ('train', TINY + ['--output', '{tmp}/r', '--device', 'tpu'], USAGE, "argument --device: 'tpu' is not a torch "
                                                                       'device'),
    ('train', ['--model', 'sa_quadratic_tiny', '--output', '{tmp}/r'], USAGE, "unknown model 'sa_quadratic_tiny'"),
    ('train', TINY, USAGE, 'the following arguments are required: --output'),
    ('train', TINY + ['--output', '{tmp}/r', '--data-dir', '{tmp}'], INPUT, 'no CIFAR-10 train data in'),
    ('train', TINY + ['--output', '{tmp}/r', '--data-dir', '{cifar10}', '--model-kwargs', '{"depht": 2}'], USAGE,
     'sa_quadratic_tiny_cifar does not take --model-kwargs {"depht": 2}'),
    ('train', TINY + ['--output', '{tmp}/r', '--data-dir', '{cifar10}', '--model-kwargs', '{"num_classes": 100}'],
     USAGE, '--model-kwargs {"num_classes": 100}: this command sets num_classes=10 itself; drop it from'),
    ('predict', [SAMPLE] + TINY + ['--num-classes', '5', '--model-kwargs', '{"num_classes": 3}'], USAGE,
     '--model-kwargs {"num_classes": 3}: this command sets num_classes=5 itself'),
    ('transfer', ['pack'], USAGE, "argument command: invalid choice: 'pack'"),
    ('transfer', ['export', '{tmp}', '{tmp}/out', '--start', '-1'], USAGE, 'argument --start: expected a whole '
                                                                           'number ≥ 0'),
    ('transfer', ['export', '{tmp}', '{tmp}/out', '--max-file', '3'], USAGE, 'unrecognized arguments: --max-file'),
    ('transfer', ['export', '{tmp}', '{tmp}/out'], INPUT, 'no training checkpoint at'),
    ('transfer', ['join', '{tmp}/joined', '{tmp}'], INPUT, 'no manifest.json in'),
    ('viz', ['heatmap'] + TINY + ['--out', '{tmp}/x.png'], USAGE, "argument figure: invalid choice: 'heatmap'"),
    ('viz', ['attention'] + TINY + ['--query', '-1', '3', '--out', '{tmp}/x.png'], USAGE, 'argument --query'),
    ('viz', ['attention'] + TINY + ['--image', SAMPLE, '--query', '32', '3', '--out', '{tmp}/x.png'], USAGE,
     '--query 32 3 is outside the 32×32 input: pass ROW in 0..31 and COL in 0..31'),
    ('viz', ['attention'] + TINY + ['--image', SAMPLE, '--average', '4', '--out', '{tmp}/x.png'], USAGE,
     'argument --average: not allowed with argument --image'),
    ('viz', ['attention'] + TINY + ['--image', '{tmp}/garbage.safetensors', '--out', '{tmp}/x.png'], INPUT,
     'garbage.safetensors: cannot read it as an image'),
    ('viz', ['attention'] + TINY + ['--checkpoints', '{tmp}/run/last.pth.tar', '--out', '{tmp}/x.png'], USAGE,
     '--checkpoints draws the centers of a run\'s checkpoints'),
    ('viz', ['centers'] + TINY + ['--checkpoints', '{tmp}/run/last.pth.tar', '--model-kwargs', '{"depth": 2}', '--out',
                                  '{tmp}/x.png'], USAGE, 'without --pretrained / --checkpoint / --model-kwargs'),
    ('viz', ['centers', '--model', 'sa_quadratic_cifar', '--checkpoints', '{tmp}/run/last.pth.tar', '--out',
             '{tmp}/x.png'], USAGE, 'is a checkpoint of sa_quadratic_tiny_cifar, not of sa_quadratic_cifar'),
    ('viz', ['centers', '--model', 'aa_resnet20_cifar', '--out', '{tmp}/x.png'], INPUT,
     'no quadratic-encoding attention heads'),
]


def _tool_module(tool: str):
    return importlib.import_module(f'timm_attnconv.{tool or "__main__"}')


def _tool_source(tool: str) -> str:
    return Path(_tool_module(tool).__file__).read_text()


def _tools():
    """Every module of the package with a ``main``: the ``python -m timm_attnconv.<tool>`` commands."""
    names = [info.name for info in pkgutil.iter_modules(timm_attnconv.__path__)]
    return sorted(name.replace('__main__', '') for name in names if hasattr(_tool_module(name), 'main'))


@pytest.fixture(scope='module')
def inputs(tmp_path_factory):
    """A folder of bad inputs: a corrupt checkpoint and weights file, weights without the config.json that names
    their architecture, pruned weights (one head fewer in layer 2, as ``prune --out`` writes them), a checkpoint of
    timm's train.py (its options pickled beside the weights) and a training checkpoint of sa_quadratic_tiny_cifar in
    ``run/``."""
    from safetensors.torch import save_file
    from timm_attnconv.runs import checkpoint_digest
    folder = tmp_path_factory.mktemp('inputs')
    (folder / 'garbage.pth.tar').write_bytes(b'not a checkpoint' * 64)
    (folder / 'garbage.safetensors').write_bytes(b'not a weights file' * 64)
    shutil.copy(WEIGHTS, folder / 'lone.safetensors')
    pruned = timm.create_model('sa_quadratic_tiny_cifar')
    heads = timm_attnconv.prune_degenerate_heads(pruned, heads={1: [0]})
    save_file(pruned.state_dict(), folder / 'pruned.safetensors', metadata={'num_heads': json.dumps(heads)})
    torch.save(dict(epoch=1, arch='sa_quadratic_tiny_cifar', state_dict=pruned.state_dict(),
                    args=argparse.Namespace(model='sa_quadratic_tiny_cifar')), folder / 'timm_train.pth.tar')
    (folder / 'run').mkdir()
    model = timm.create_model('sa_quadratic_tiny_cifar', num_classes=10)
    state = dict(config=dict(model='sa_quadratic_tiny_cifar', model_kwargs={}), epoch=1, step_in_epoch=0,
                 model=model.state_dict(), ema=None)
    state['sha256'] = checkpoint_digest(state)
    torch.save(state, folder / 'run' / 'last.pth.tar')
    return folder


def test_model_kwargs_build_the_model_that_pruned_weights_fit(inputs, capsys):
    from timm_attnconv.predict import main
    kwargs = ['--model-kwargs', '{"num_heads": [9, 8, 9, 9, 9, 9]}']
    main([SAMPLE] + TINY + ['--checkpoint', str(inputs / 'pruned.safetensors')] + kwargs)
    assert 'read weights file' in capsys.readouterr().err


def run_tool(tool, argv, capsys):
    """``python -m timm_attnconv.<tool> ARGV`` in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run(_tool_module(tool).main, argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_the_table_covers_every_tool():
    assert {getattr(row, 'values', row)[0] for row in BAD_ARGUMENTS} == set(_tools())


@pytest.mark.parametrize('tool,argv,status,message', BAD_ARGUMENTS)
def test_a_bad_argument_gets_one_line_and_a_non_zero_exit(tool, argv, status, message, inputs, synthetic_cifar10,
                                                           capsys):
    argv = [a.replace('{tmp}', str(inputs)).replace('{cifar10}', synthetic_cifar10) for a in argv]
    code, _, err = run_tool(tool, argv, capsys)
    errors = [line for line in err.splitlines() if ': error: ' in line]
    assert code == status and 'Traceback' not in err
    assert len(errors) == 1 and errors[0].startswith(cli.prog(f'timm_attnconv.{tool}'.rstrip('.')))
    assert message in errors[0]


def _cifar10_readers():
    sources = {tool: _tool_source(tool) for tool in _tools()}
    readers = ('load_cifar10', 'load_test_split', 'write_image_folder')
    return sorted(tool for tool, source in sources.items() if any(f'{reader}(' in source for reader in readers))


def test_every_cifar10_reader_says_where_its_data_defaults_to(capsys):
    # one help text, cli.add_data_dir_arg's: the environment variable and the folder beside the checkout
    assert _cifar10_readers() == ['benchmark', 'evaluate', 'imagefolder', 'stage', 'theory', 'train', 'viz']
    for tool in _cifar10_readers():
        code, out, _ = run_tool(tool, ['--help'], capsys)
        assert code == 0 and len(re.findall(r'^ +--data-dir DATA_DIR', out, re.MULTILINE)) == 1, tool
        help_text = ' '.join(out.split())  # as argparse wrapped it for this terminal
        assert '$TIMM_ATTNCONV_CIFAR10 when set, else ../shared/data/cifar10 beside the source checkout' in help_text
        assert "'--data-dir'" not in _tool_source(tool), f'{tool} declares its own --data-dir'


def test_a_later_device_overrides_one_this_machine_lacks():
    # training/gpu/launch.sh passes its recipe's --device cuda first and the caller's options after it
    from timm_attnconv.train import _parser
    args = _parser().parse_args(TINY + ['--output', 'unused', '--device', f'cuda:{torch.cuda.device_count()}',
                                        '--device', 'cpu'])
    assert args.device == 'cpu'


@pytest.mark.parametrize('device, autotuned', [('cpu', False), ('cuda', True), ('cuda:1', True)])
def test_cudnn_times_its_algorithms_on_cuda_only(monkeypatch, device, autotuned):
    # the flag can be set without a GPU; what it changes (cuDNN's choice per convolution shape) needs one
    monkeypatch.setattr(torch.backends.cudnn, 'benchmark', False)
    cli.tune_for_device(device)
    assert torch.backends.cudnn.benchmark is autotuned


def test_every_tool_runs_its_main_through_the_runner():
    # `run` hands a script's own errors through (its main reports its argument errors itself); the tools that train
    # or evaluate set their process's malloc first
    for tool in _tools():
        source = ast.parse(_tool_source(tool))
        block, = [node for node in source.body if isinstance(node, ast.If) and 'main' in ast.unparse(node.test)]
        expected = 'main()' if tool == 'run' else 'cli.run(main)'
        if tool in ('train', 'evaluate', 'stage'):
            expected = 'cli.keep_freed_memory()\n' + expected
        assert ast.unparse(block.body) == expected, tool


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason="glibc's malloc only")
def test_a_tool_process_keeps_freed_memory_in_the_heap():
    # in a process of its own: the setting is the whole process's. By default glibc maps a 256 MiB block on its own
    # (mallinfo's hblkhd) and unmaps it when freed; set, the block comes from the heap (arena), which keeps it. Read
    # from malloc's own statistics: page faults, what the setting saves, depend on how the heap happens to fragment
    code = '''
import ctypes, torch
from timm_attnconv import cli
libc = ctypes.CDLL(None)
size = ctypes.c_size_t if hasattr(libc, 'mallinfo2') else ctypes.c_int  # mallinfo2 since glibc 2.33
class MallInfo(ctypes.Structure):  # malloc.h
    _fields_ = [(name, size) for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks',
                                          'uordblks', 'fordblks', 'keepcost')]
mallinfo = getattr(libc, 'mallinfo2', None) or libc.mallinfo
mallinfo.restype = MallInfo
applied = cli.keep_freed_memory()
block = torch.ones(64, 2 ** 20)  # 256 MiB
held = mallinfo()
del block
kept = mallinfo()
print(applied, held.hblkhd < 2 ** 28, held.arena >= 2 ** 28, kept.arena >= 2 ** 28)
'''
    env = {name: value for name, value in os.environ.items() if name not in cli.MALLOC_ENV}
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    # applied; the block not mapped on its own; in the heap; the heap kept it once freed
    assert done.stdout.split() == ['True'] * 4, done.stdout


def test_freed_memory_is_left_to_malloc_where_the_user_set_it(monkeypatch):
    # neither case reaches mallopt, so this process's malloc stays as it is
    monkeypatch.setenv('MALLOC_MMAP_MAX_', '65536')
    assert cli.keep_freed_memory() is False
    monkeypatch.delenv('MALLOC_MMAP_MAX_')
    monkeypatch.setattr(platform, 'libc_ver', lambda: ('', ''))  # musl, macOS, Windows
    assert cli.keep_freed_memory() is False


def test_predict_reports_an_unreadable_image_and_classifies_the_others(tmp_path, capsys):
    images = tmp_path / 'images'
    shutil.copytree(SAMPLES_DIR, images)
    (images / '00007_broken.png').write_bytes(b'\x89PNG\r\n\x1a\n' + b'cut off here')
    argv = [str(images), str(tmp_path / 'gone.png')] + TINY + ['--pretrained', '--topk', '1', '--json',
                                                               str(tmp_path / 'p.json')]
    code, out, err = run_tool('predict', argv, capsys)
    assert code == INPUT and 'Traceback' not in err
    classified = [line.split(':')[0] for line in out.splitlines()]
    assert classified == [str(images / name) for name in sorted(os.listdir(SAMPLES_DIR))]
    errors = [line for line in err.splitlines() if ': error: ' in line]
    assert errors == [
        f'python -m timm_attnconv.predict: error: {images / "00007_broken.png"}: cannot read it as an image '
        f"(cannot identify image file '{images / '00007_broken.png'}')",
        f'python -m timm_attnconv.predict: error: {tmp_path / "gone.png"}: no such image file',
        'python -m timm_attnconv.predict: error: 2 of 22 images could not be read (named above); the others were '
        'classified']
    results = json.loads((tmp_path / 'p.json').read_text())
    unreadable = [r['file'] for r in results if 'error' in r]
    assert unreadable == [str(images / '00007_broken.png'), str(tmp_path / 'gone.png')]


def test_predict_says_which_kind_of_checkpoint_it_read(inputs, capsys):
    from timm_attnconv import predict
    from_weights = predict.main([SAMPLE] + TINY + ['--checkpoint', WEIGHTS])
    assert f'read weights file {WEIGHTS}' in capsys.readouterr().err
    checkpoint = str(inputs / 'run' / 'last.pth.tar')
    from_run = predict.main([SAMPLE] + TINY + ['--checkpoint', checkpoint])
    assert f'read training checkpoint {checkpoint}' in capsys.readouterr().err
    assert from_weights[0]['probs'] != from_run[0]['probs']  # the run's random initialisation, not the weights


def test_errors_of_other_libraries_name_their_kind_and_bugs_keep_their_traceback(monkeypatch, capsys):
    def torch_fails(argv):
        return torch.zeros(2) @ torch.zeros(3)

    with pytest.raises(SystemExit) as exit_info:
        cli.run(torch_fails)
    assert exit_info.value.code == INPUT
    line, = capsys.readouterr().err.splitlines()
    assert line.startswith('python -m tests.test_cli: error: RuntimeError: ') and 'TIMM_ATTNCONV_DEBUG=1' in line

    def bug(argv):
        return {}['key']

    with pytest.raises(KeyError):
        cli.run(bug)
    monkeypatch.setenv('TIMM_ATTNCONV_DEBUG', '1')
    with pytest.raises(RuntimeError):
        cli.run(torch_fails)


@pytest.mark.parametrize('argv,status,message', [
    (['-m', 'timm_attnconv.train'] + TINY + ['--output', 'unused', '--epochs', '0'], USAGE,
     "python -m timm_attnconv.train: error: argument --epochs: expected a whole number ≥ 1, got '0' (--help lists "
     'the options)'),
    (['-m', 'timm_attnconv.evaluate'] + TINY + ['--checkpoint', 'missing.pth.tar'], USAGE,
     "python -m timm_attnconv.evaluate: error: --checkpoint 'missing.pth.tar': no such file"),
])
def test_a_terminal_sees_one_line_and_no_traceback(argv, status, message, tmp_path):
    done = subprocess.run([sys.executable] + argv, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(timm_attnconv.__file__))))
    assert done.returncode == status and done.stderr.strip() == message
