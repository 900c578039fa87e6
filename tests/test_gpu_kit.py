"""The GPU-session scripts of training/gpu, end to end on the CPU: launch a named recipe in the background, wait for
it with status, collect its parts as the device tool would return them, and join them into a run folder."""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import timm
import torch

from timm_attnconv import benchmark
from timm_attnconv.runs import read_checkpoint
from timm_attnconv.stage import _read_run
from timm_attnconv.transfer import main as transfer_main


KIT = os.path.join(os.path.dirname(__file__), '..', 'training', 'gpu')


def kit(script, *args, env):
    return subprocess.run(['bash', os.path.join(KIT, script), *args], env=env, capture_output=True, text=True,
                          timeout=600, check=True).stdout


def test_launch_status_collect_and_join(tmp_path, synthetic_cifar10):
    env = dict(os.environ, RUNS=str(tmp_path / 'runs'), DATA=synthetic_cifar10, COMPILE='0',
               OUT=str(tmp_path / 'out'), OMP_NUM_THREADS='1')
    # the recipe's options, then these: a later option wins (a tiny twin of the paper-size model, on the CPU)
    started = kit('launch.sh', 'sa_learned_cifar', '--device', 'cpu', '--amp', 'none', '--epochs', '1',
                  '--train-limit', '128', '--batch-size', '128', '--eval-limit', '50', '--model-kwargs',
                  json.dumps(dict(embed_dim=16, depth=1, mlp_dim=16, num_heads=3)), env=env)
    assert started.startswith('started sa_learned_cifar (pid ')
    status = kit('status.sh', '300', env=env)  # returns once the run is done
    assert '== sa_learned_cifar: not running' in status and 'epoch=1 ' in status and 'ema_test_top1=' in status
    assert kit('status.sh', 'sa_learned_cifar', env=env).count('== ') == 1  # a NAME alone: that run, no wait
    # files the call already returns count against its 8: 5 others leave room for the 3 small files and no part
    first_call, second_call = tmp_path / 'out', tmp_path / 'out2'
    first_call.mkdir()
    for i in range(5):
        (first_call / f'other{i}.txt').write_text('x')
    with pytest.raises(subprocess.CalledProcessError) as failed:
        kit('collect.sh', 'sa_learned_cifar', env=env)
    assert 'no part of 15728640 bytes fits this call' in failed.value.stderr
    (first_call / 'other4.txt').unlink()
    assert kit('collect.sh', 'sa_learned_cifar', env=env).endswith('next call: --start 1\n')
    assert 'every part is out' in kit('collect.sh', 'sa_learned_cifar', '1', env=dict(env, OUT=str(second_call)))

    transfer_main(['join', str(tmp_path / 'joined'), str(first_call / 'sa_learned_cifar'),
                   str(second_call / 'sa_learned_cifar')])
    run = _read_run(str(tmp_path / 'joined'))
    state = read_checkpoint(str(tmp_path / 'runs' / 'sa_learned_cifar' / 'last.pth.tar'))
    config = run['config']
    assert config['model'] == 'sa_learned_cifar' and config['opt'] == 'adamw' and config['model_ema_decay'] == 0.9995
    assert config['epochs'] == 1 and config['clip_grad'] == 1.0 and config['world_size'] == 1
    assert all(torch.equal(run['model'][k], v) for k, v in state['model'].items())
    # the EMA alone: half the parts
    ema_call = tmp_path / 'out3'
    said = kit('collect.sh', 'sa_learned_cifar', '0', '--weights', 'ema', env=dict(env, OUT=str(ema_call)))
    assert 'every part is out' in said and sorted(os.listdir(ema_call / 'sa_learned_cifar')) == [
        'config.json', 'ema.safetensors.part00', 'log.jsonl', 'manifest.json']
    # the checkpoint itself, for a later session to resume: byte for byte
    checkpoint_call = tmp_path / 'out4'
    said = kit('collect.sh', 'sa_learned_cifar', '--checkpoint', env=dict(env, OUT=str(checkpoint_call)))
    assert 'every part is out' in said
    transfer_main(['join', str(tmp_path / 'carried'), str(checkpoint_call / 'sa_learned_cifar')])
    assert (tmp_path / 'carried' / 'last.pth.tar').read_bytes() == (
        tmp_path / 'runs' / 'sa_learned_cifar' / 'last.pth.tar').read_bytes()


def test_a_run_whose_compile_fails_trains_on_without_it(tmp_path, synthetic_cifar10):
    # inductor's C++ compiler made to fail (CXX), an empty kernel cache: torch.compile fails at the first step
    compiler = tmp_path / 'no-compiler'
    compiler.write_text('#!/bin/sh\nexit 1\n')
    compiler.chmod(0o755)
    env = dict(os.environ, RUNS=str(tmp_path / 'runs'), DATA=synthetic_cifar10, CXX=str(compiler),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / 'inductor'), OMP_NUM_THREADS='1')
    kit('launch.sh', 'sa_learned_cifar', '--device', 'cpu', '--amp', 'none', '--epochs', '1', '--train-limit', '64',
        '--batch-size', '64', '--eval-limit', '20', '--model-kwargs',
        json.dumps(dict(embed_dim=16, depth=1, mlp_dim=16, num_heads=3)), env=env)
    status = kit('status.sh', '300', env=env)
    assert '== sa_learned_cifar: not running' in status and 'epoch=1 ' in status
    log = (tmp_path / 'runs' / 'sa_learned_cifar' / 'train.out').read_text()
    assert 'InductorError' in log and 'launch.sh: torch.compile failed; training on without it' in log


def test_pruned_fine_tune_starts_from_the_staged_generalized_model_pruned_here(tmp_path):
    # prune.py here, on the staged weights: down to the registered pruned model's heads, the most degenerate first
    # (the criterion itself names one head of this run), in float16 as staged, so that the file loads as it is
    env = dict(os.environ, PYTHONPATH=os.path.join(KIT, '..', '..'), OMP_NUM_THREADS='1')
    carried = tmp_path / 'runs' / 'sa_quadratic_gen_pruned_cifar'
    subprocess.run([sys.executable, os.path.join(KIT, 'prune.py'), 'sa_quadratic_gen_cifar.c10', str(carried),
                    '--half'], env=env, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads((carried / 'pruning.json').read_text())
    assert json.loads((carried / 'heads.json').read_text()) == report['num_heads'] == [7, 5, 8, 7, 3, 9]
    assert report['degenerate'] == {'0': [], '1': [], '2': [], '3': [], '4': [], '5': [0]}
    assert [len(heads) for heads in report['pruned'].values()] == [2, 4, 1, 2, 6, 0]
    from safetensors.torch import load_file
    weights = load_file(carried / 'pruned.safetensors')
    assert all(v.dtype == torch.float16 for v in weights.values() if v.is_floating_point())
    timm.create_model('sa_quadratic_gen_pruned_cifar').load_state_dict(weights)
    # launch.sh fine-tunes the carried weights (no generalized run on this machine), a tenth of the SA recipe's LR
    argv, option, env = _launched(tmp_path, 'sa_quadratic_gen_pruned_cifar')
    assert argv[:2] == ['-m', 'timm_attnconv.train'] and option['--model'] == 'sa_quadratic_gen_pruned_cifar'
    assert json.loads(option['--model-kwargs']) == {'num_heads': [7, 5, 8, 7, 3, 9]}
    assert option['--init-from'] == str(carried / 'pruned.safetensors')
    assert option['--lr'] == '1e-4' and option['--epochs'] == '30' and option['--device'] == 'cuda'
    # neither carried weights nor a finished generalized run: launch.sh says what to do
    failed = subprocess.run(['bash', os.path.join(KIT, 'launch.sh'), 'sa_quadratic_gen_pruned_cifar'],
                            env=dict(env, RUNS=str(tmp_path / 'empty')), capture_output=True, text=True)
    assert failed.returncode == 1 and 'carry the pruned weights' in failed.stderr and 'train sa_quadratic_gen_cifar' \
        in failed.stderr
    # a staged fine-tune of the pruned model to go on from (plan C): nothing to prune, the registered model's heads
    (tmp_path / 'staged').mkdir()
    argv, option, _ = _launched(tmp_path / 'staged', 'sa_quadratic_gen_pruned_cifar',
                                '--init-from', 'sa_quadratic_gen_pruned_cifar.c10_cpu2')
    assert option['--init-from'] == 'sa_quadratic_gen_pruned_cifar.c10_cpu2' and '--model-kwargs' not in argv
    assert option['--lr'] == '1e-4' and option['--epochs'] == '30' and argv.count('--init-from') == 1


@pytest.mark.parametrize('name,expected', [
    ('aa_wide_resnet28_10_cifar', {'--epochs': '30', '--opt': 'sgd', '--lr': '0.1', '--batch-size': '128'}),
    ('sa_learned_content_tiny_cifar', {'--epochs': '40', '--opt': 'adamw', '--lr': '2e-3', '--batch-size': '256'}),
    ('sa_learned_tiny_cifar', {'--epochs': '40', '--opt': 'adamw', '--lr': '2e-3', '--batch-size': '256'}),
    ('ea_sa_learned_content_tiny_cifar', {'--epochs': '40', '--opt': 'adamw', '--lr': '2e-3', '--batch-size': '256'}),
    ('ea_sa_learned_content_cifar', {'--epochs': '100', '--opt': 'adamw', '--lr': '1e-3', '--batch-size': '256'}),
])
def test_the_recipes_of_plans_f_g_h_and_i(tmp_path, name, expected):
    # F: the ResNet recipe cut to the 30 epochs one session holds; G: a compact model and its EA twin on one recipe,
    # I: the compact learned model on it; H: the paper-size content model's EA twin on the SA recipe its base trained
    # with (plan A's options follow it)
    argv, option, _ = _launched(tmp_path, name)
    assert option['--model'] == name and {k: option[k] for k in expected} == expected
    assert '--model-ema' in argv and '--compile' in argv and option['--device'] == 'cuda'


def test_cuda_checks_run_detached_and_status_reports_them(tmp_path):
    # the CPU stands in for the device (TIMM_ATTNCONV_TEST_DEVICE), and one check for all of them
    env = dict(os.environ, RUNS=str(tmp_path / 'runs'), CHECKS=str(tmp_path / 'checks.txt'),
               TIMM_ATTNCONV_TEST_DEVICE='cpu', OMP_NUM_THREADS='1')
    started = kit('cuda-checks.sh', '-k', 'test_every_kernel_gives_the_explicit_results_on_the_device and '
                  'aa_resnet20_cifar and sdpa and not onehot', env=env)
    assert started.startswith('cuda checks started (pid ')
    status = kit('status.sh', '300', env=env)  # returns once the checks are done
    assert '== cuda checks: done' in status and '1 passed' in status and 'failed' not in status


def test_op_profile_prints_each_models_time_and_top_ops():
    command = [sys.executable, os.path.join(KIT, 'op_profile.py'), '--device', 'cpu', '--amp', 'none',
               '--batch-size', '1', '--max-warmup', '1', '--steps', '1', '--top', '3', '--shapes', 'aa_resnet20_cifar',
               'resnet18:{"num_classes": 10}']
    env = dict(os.environ, PYTHONPATH=os.path.join(KIT, '..', '..'), OMP_NUM_THREADS='1')
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    assert '== aa_resnet20_cifar, 32 px, batch 1, none, compile off: ' in out
    assert '== resnet18 {"num_classes": 10}, 224 px, batch 1' in out
    sections = out.split('== ')[1:]
    assert len(sections) == 2 and all('Self CPU time total' in t and t.count('aten::') == 3 for t in sections)
    assert all('Input Shapes' in t and '[[1, ' in t for t in sections)  # --shapes: a row per op and input shape


def test_op_profile_runs_every_model_at_the_size_asked():
    # benchmark.sh profiles the SA paths at 96 px, where the fast path misses its target; here the compact twin at 48
    command = [sys.executable, os.path.join(KIT, 'op_profile.py'), '--device', 'cpu', '--amp', 'none',
               '--batch-size', '1', '--max-warmup', '1', '--steps', '1', '--top', '1000', '--shapes',
               '--img-size', '48', 'sa_quadratic_tiny_cifar', 'sa_quadratic_tiny_cifar:{"attn_path": "dense"}']
    env = dict(os.environ, PYTHONPATH=os.path.join(KIT, '..', '..'), OMP_NUM_THREADS='1')
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    sections = out.split('== ')[1:]
    assert [t.split(', batch')[0] for t in sections] == [
        'sa_quadratic_tiny_cifar, 48 px', 'sa_quadratic_tiny_cifar {"attn_path": "dense"}, 48 px']
    assert all('[[1, 3, 48, 48]' in t for t in sections)  # the input itself at that size (every op row: --top 1000)


def _fake_python3(tmp_path, calls, seconds=0):
    """A python3 that writes down its arguments (each ending in \\x1f, a call a line) instead of running, and then
    sleeps SECONDS if it was a benchmark step; PATH and OUT for benchmark.sh with it, DEVICE=cpu."""
    fake_bin = tmp_path / 'bin'
    fake_bin.mkdir()
    (fake_bin / 'python3').write_text(f'#!/usr/bin/env bash\nprintf "%s\\037" "$@" >> {calls}; echo >> {calls}\n'
                                      f'[ "$2" != timm_attnconv.benchmark ] || sleep {seconds}\n')
    (fake_bin / 'python3').chmod(0o755)
    return dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / 'out'),
                BENCH_PID=str(tmp_path / 'benchmark.pid'), RUNS=str(tmp_path / 'runs'), CHECKS=str(tmp_path / 'c.txt'),
                DEVICE='cpu')  # the parsers check that the device is there


def _launched(tmp_path, name, *args):
    """``(argv, each option's last value, env)`` of the trainer command ``launch.sh NAME ARGS...`` starts, run with
    the fake python3 (it records the command instead of training)."""
    calls = tmp_path / 'calls.txt'
    (tmp_path / 'data').mkdir()
    (tmp_path / 'data' / 'train.npz').write_bytes(b'')
    env = dict(_fake_python3(tmp_path, calls), DATA=str(tmp_path / 'data'))
    kit('launch.sh', name, *args, env=env)
    for _ in range(100):  # the command runs detached
        if calls.exists() and calls.read_text():
            break
        time.sleep(0.1)
    argv = calls.read_text().splitlines()[0].split('\x1f')[:-1]
    return argv, dict(zip(argv, argv[1:])), env  # the last value of an option is the one the trainer takes


def test_every_benchmark_step_is_a_valid_command(tmp_path):
    # each step of benchmark.sh must parse (models, flags, combinations), or the GPU minute of that step would go to
    # a usage error
    calls = tmp_path / 'calls.txt'
    kit('benchmark.sh', '--quick', '--profile', env=_fake_python3(tmp_path, calls))
    argvs = [line.split('\x1f')[:-1] for line in calls.read_text().splitlines()]
    steps = [argv[2:] for argv in argvs if argv[:2] == ['-m', 'timm_attnconv.benchmark']]
    assert len(steps) >= 15 and any('--evolution-layouts' in argv for argv in steps)
    for argv in steps:
        args = benchmark.parse_args(argv)
        assert args.device == 'cpu' and args.amp == 'bf16' and args.iters == 2, argv
    spec = importlib.util.spec_from_file_location('op_profile', os.path.join(KIT, 'op_profile.py'))
    op_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(op_profile)
    profiles = [op_profile.parse_args(argv[1:]) for argv in argvs if argv[0] == 'training/gpu/op_profile.py']
    assert [args.compile for args in profiles] == [False, False, False, True]
    for args in profiles:
        assert args.device == 'cpu' and args.shapes
        assert all(name in timm.list_models() for name, _ in args.models), args.models
        for name, kwargs in args.models:
            if kwargs:  # the model takes them
                timm.create_model(name, **kwargs)
    assert ('ea_aa_resnet50', {'evolve': False}) in profiles[0].models
    assert profiles[1].img_size == 96 and ('sa_quadratic_cifar', {'attn_path': 'dense'}) in profiles[1].models
    assert profiles[2].batch_size == 256 and profiles[2].models == [('sa_learned_content_cifar', {})]
    assert all(args.evolution_layout is None for args in profiles)


def test_benchmark_starts_no_step_once_its_budget_is_spent_and_status_waits_for_it(tmp_path):
    # steps of 1 s against a budget of 11 s: the eager steps of every family's targets run first (a short budget
    # still measures each family), the compiled ones are then skipped as they would be cut while compiling, the next
    # eager ones run until the budget is spent (the last cut at what is left), the rest are skipped and say so, and
    # each step that ran says how long it took; status.sh waits while it runs
    calls = tmp_path / 'calls.txt'
    env = _fake_python3(tmp_path, calls, seconds=1)
    bench = subprocess.Popen(['bash', os.path.join(KIT, 'benchmark.sh'), '--quick', '--budget', '11'], env=env,
                             stdout=subprocess.PIPE, text=True)
    pid_file = tmp_path / 'benchmark.pid'
    for _ in range(100):  # status.sh finds the benchmark by the pid it writes first
        if pid_file.exists():
            break
        time.sleep(0.1)
    status = kit('status.sh', '60', env=env)
    assert bench.poll() is not None and '== benchmark: done' in status and status.endswith(
        'skipped (the budget of 11 s is spent): python3 -m timm_attnconv.benchmark --device cpu --amp bf16 --iters 2 '
        '--train --kernels sdpa sdpa_onehot flex --models aa_resnet20_cifar --batch-size 256\n')
    printed = bench.communicate()[0]
    assert bench.returncode == 0 and printed == (tmp_path / 'out' / 'benchmark.txt').read_text()
    ran = [line for line in printed.splitlines() if line.startswith('$ python3 -m timm_attnconv.benchmark')]
    skipped = [line for line in printed.splitlines() if line.startswith('skipped (the budget of 11 s is spent): ')]
    too_late = re.compile(r'skipped \(\d s of the budget left, under the 60 s a compiling step gets\): ')
    too_late_to_compile = [line for line in printed.splitlines() if too_late.match(line)]
    # compiling: torch.compile, or autotuning EA's Triton kernels
    assert '--compile' not in ''.join(ran) and all('--compile' in line or ' triton' in line
                                                   for line in too_late_to_compile)
    families = ('sa_quadratic_cifar', 'aa_resnet50', 'ea_aa_resnet50', 'deit_ea_small_patch16_224',
                'sa_learned_content_cifar')
    assert all(any(name in line for line in ran[:8]) for name in families)
    assert too_late_to_compile and 9 <= len(ran) <= 12 and len(ran) + len(skipped) + len(too_late_to_compile) >= 15
    assert calls.read_text().count('timm_attnconv.benchmark') == len(ran)
    assert '\n(1 s)\n' in printed or '\n(2 s)\n' in printed


def test_benchmark_runs_the_chosen_steps_and_names_the_others(tmp_path):
    # --steps LIST (--from K: K-): a later session measures what changed since, or what an earlier one's budget left
    # out; the other steps are named, not run
    calls = tmp_path / 'calls.txt'
    env = _fake_python3(tmp_path, calls)
    every = kit('benchmark.sh', '--quick', env=env).splitlines()
    every_step = [line[2:] for line in every if line.startswith('$ python3 -m timm_attnconv.benchmark')]
    for args, chosen in [(['--from', '7'], range(7, len(every_step) + 1)),
                         (['--steps', '4-6,19,21-'], [4, 5, 6, 19] + list(range(21, len(every_step) + 1)))]:
        calls.unlink(missing_ok=True)
        printed = kit('benchmark.sh', '--quick', *args, env=env).splitlines()
        skipped = [line for line in printed if line.startswith('skipped (step ')]
        ran = [line[2:] for line in printed if line.startswith('$ python3 -m timm_attnconv.benchmark')]
        spec = '7-' if args[0] == '--from' else args[1]
        assert skipped == [f'skipped (step {k}, not among --steps {spec}): {cmd}'
                           for k, cmd in enumerate(every_step, 1) if k not in chosen]
        assert ran == [every_step[k - 1] for k in chosen]
        assert calls.read_text().count('timm_attnconv.benchmark') == len(ran)
    assert 'deit_ea_small_patch16_224:deit_small_patch16_224' in every_step[6]  # step 7: session 32's budget ended
    # steps 20 and 21: new in session 39, EA's Triton kernel against the reference update
    assert all('--evolution-layouts channels_last triton --models' in every_step[k] for k in (19, 20))
    assert len(every_step) == 25
    assert '--compile --kernels sdpa sdpa_onehot flex' in every_step[21]
    assert '--compile --models sa_quadratic_cifar sa_learned_cifar --sizes 96' in every_step[11]
    # a step that autotunes EA's Triton kernels compiles: it gets 150 s, and is left out under 60 s of budget
    printed = kit('benchmark.sh', '--quick', '--steps', '20', '--budget', '30', env=env)
    assert re.search(r'skipped \(\d+ s of the budget left, under the 60 s a compiling step gets\): .*'
                     r'--evolution-layouts channels_last triton ', printed)
    for bad_args in (['--from', 'x'], ['--steps', '4,0'], ['--steps', '3-b']):
        bad = subprocess.run(['bash', os.path.join(KIT, 'benchmark.sh'), *bad_args], env=env, capture_output=True,
                             text=True)
        assert bad.returncode == 2 and '--steps takes step numbers from 1 on and ranges' in bad.stderr, bad_args


def test_prepare_and_receive_cifar10_and_a_run_to_resume(tmp_path):
    """prepare.sh sets weights/ aside and cuts the data, and the checkpoint of a run an earlier session brought back,
    into parts; receive.sh, given one part per call (the machine deletes the parts earlier calls carried), cuts the
    stream back into its files once all arrived and checks every byte: the checkpoint lands where launch.sh resumes
    it (tests/test_transfer.py: exactly)."""
    repo, machine, src = tmp_path / 'repo', tmp_path / 'machine', tmp_path / 'cifar10'
    for folder in (repo / 'weights' / 'm.c10', machine, src):
        folder.mkdir(parents=True)
    (repo / 'weights' / 'm.c10' / 'model.safetensors').write_bytes(b'w' * 1000)
    subprocess.run('git init -q && git add -A && git -c user.email=t@t -c user.name=t commit -qm w', shell=True,
                   cwd=repo, check=True)
    data = {name: os.urandom(size) for name, size in (('train.npz', 2_500_000), ('test.npz', 700_000))}
    for name, payload in data.items():
        (src / name).write_bytes(payload)
    env = dict(os.environ, CIFAR10_DIR=str(src), PART_MIB='1')

    def script(name, *args, cwd):
        done = subprocess.run(['bash', os.path.join(os.path.abspath(KIT), name), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    (repo / '.gpu' / 'init' / 'm').mkdir(parents=True)  # training/gpu/prune.py's output stays, beside the last part
    (repo / '.gpu' / 'init' / 'm' / 'pruned.safetensors').write_bytes(b'p' * 2000)
    run = tmp_path / 'joined'  # what `transfer join` wrote from collect.sh --checkpoint in an earlier session
    run.mkdir()
    (run / 'config.json').write_text(json.dumps(dict(model='ea_aa_resnet20_cifar', epochs=100)))
    checkpoint = os.urandom(1_300_000)
    (run / 'last.pth.tar').write_bytes(checkpoint)
    # a staged folder a run starts from, and a run to resume
    said = script('prepare.sh', '--carry-weights', 'm.c10', '--carry-run', str(run), cwd=repo)
    assert '5 parts of at most 1 MiB' in said and said.endswith('carry .gpu/init with .gpu/p04: 0 MiB with the tree\n')
    assert 'receive.sh puts it in /tmp/runs/ea_aa_resnet20_cifar, launch.sh ea_aa_resnet20_cifar resumes it' in said
    assert (repo / '.gpu' / 'init' / 'm' / 'pruned.safetensors').read_bytes() == b'p' * 2000
    assert (repo / '.gpu' / 'init' / 'weights' / 'm.c10' / 'model.safetensors').read_bytes() == b'w' * 1000
    assert not (repo / 'weights').exists() and (repo / '.git' / 'gpu-aside' / 'weights').is_dir()
    assert '/.gpu/' in (repo / '.git' / 'info' / 'exclude').read_text().split()
    dest, runs = tmp_path / 'c10', tmp_path / 'runs'
    env['RUNS'] = str(runs)
    for i in range(5):
        carried = machine / '.gpu'
        subprocess.run(['rm', '-rf', str(carried)], check=True)
        carried.mkdir(exist_ok=True)
        subprocess.run(['cp', '-r', str(repo / '.gpu' / f'p0{i}'), str(carried)], check=True)
        said = script('receive.sh', str(dest), cwd=machine)
        assert ('carry the next part' in said) == (i < 4), said
    assert 'sha256 checked' in said
    assert f'checkpoint of ea_aa_resnet20_cifar ready in {runs}/ea_aa_resnet20_cifar' in said
    assert all((dest / name).read_bytes() == payload for name, payload in data.items())
    resumed = runs / 'ea_aa_resnet20_cifar' / 'last.pth.tar'
    assert resumed.read_bytes() == checkpoint
    # received again (a later call of the session): the run's own checkpoint, newer by then, stays
    resumed.write_bytes(b'epoch 60')
    said = script('receive.sh', str(dest), cwd=machine)
    assert f'{runs}/ea_aa_resnet20_cifar keeps the checkpoint it has' in said and resumed.read_bytes() == b'epoch 60'

    bad = subprocess.run(['bash', os.path.join(os.path.abspath(KIT), 'prepare.sh'), '--carry-run'], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and '--carry-run needs what to carry' in bad.stderr

    script('prepare.sh', '--restore', cwd=repo)
    assert (repo / 'weights' / 'm.c10' / 'model.safetensors').read_bytes() == b'w' * 1000
