"""Training runs end to end on a tiny slice of CIFAR-10 (the synthetic set of conftest.py), stops cleanly, resumes
exactly, and loses no good work: not to a kill at any moment, a diverging loss, a second run on the same folder or an
altered checkpoint. ``train(TrainConfig(...))`` trains from Python what the command line trains, with its checks."""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch

from timm_attnconv import evaluate as evaluate_cli, runs, train as train_module
from timm_attnconv.data import load_cifar10, normalize
from timm_attnconv.runs import load_training_checkpoint, read_checkpoint
from timm_attnconv.stage import training_command
from timm_attnconv.train import TrainConfig, main as train_main, train

# every test here reads the synthetic CIFAR-10 as the default data folder: TINY names none
pytestmark = pytest.mark.usefixtures('synthetic_cifar10_as_default')

TINY = ['--model', 'sa_quadratic_cifar', '--model-kwargs',
        json.dumps(dict(embed_dim=16, depth=2, mlp_dim=16, num_heads=3, proj_drop_rate=0.1, attn_drop_rate=0.)),
        '--train-limit', '96', '--eval-limit', '50', '--batch-size', '32', '--epochs', '2',
        '--model-ema', '--warmup-epochs', '1']
TIMING = ('train_img_s', 'epoch_seconds')  # the only log fields that may differ between two runs of one command


class Killed(BaseException):
    """A kill at the injected point: nothing in the trainer catches it, as nothing survives a SIGKILL."""


def strict_log(run):
    """The lines of ``run/log.jsonl``, parsed as strict JSON (NaN and Infinity are not JSON), without timings."""
    def refuse(constant):
        raise ValueError(f'{constant} in log.jsonl')
    with open(run / 'log.jsonl') as f:
        return [{k: v for k, v in json.loads(line, parse_constant=refuse).items() if k not in TIMING} for line in f]


def assert_same_run(a, b):
    a, b = (torch.load(run / 'last.pth.tar', weights_only=True) for run in (a, b))
    for key in ('model', 'ema'):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f'{key}.{name} differs'
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    for index, state in a['optimizer']['state'].items():  # AdamW's moments and step count too
        assert all(torch.equal(value, b['optimizer']['state'][index][k]) for k, value in state.items()), index


@pytest.fixture(scope='module')
def whole(tmp_path_factory, synthetic_cifar10_as_default):
    """An uninterrupted TINY run: what every interrupted one must end as."""
    run = tmp_path_factory.mktemp('whole')
    result = train_main(TINY + ['--output', str(run)])
    assert result['epoch'] == 2 and not result['stopped']
    return run


def test_interrupted_run_resumes_exactly(tmp_path, whole):
    log = strict_log(whole)
    assert [e['epoch'] for e in log] == [1, 2] and 0 <= log[-1]['test_top1'] <= 100
    # it learns: the synthetic classes are separable (tests/conftest.py), 10% is chance
    assert log[1]['train_loss'] < log[0]['train_loss'] and log[1]['test_loss'] < log[0]['test_loss']
    assert log[-1]['test_top1'] > 10
    stopped = train_main(TINY + ['--output', str(tmp_path), '--max-steps', '4'])
    assert stopped['stopped'] and stopped['epoch'] == 1 and stopped['step_in_epoch'] == 1
    checkpoint = (tmp_path / 'last.pth.tar').read_bytes()
    again = train_main(TINY + ['--output', str(tmp_path), '--max-steps', '4'])  # the same command: no fifth step
    assert again == dict(stopped=True, epoch=1, step_in_epoch=1)
    assert (tmp_path / 'last.pth.tar').read_bytes() == checkpoint
    with pytest.raises(FileExistsError, match='exists and --no-resume was given'):
        train_main(TINY + ['--output', str(tmp_path), '--no-resume'])
    train_main(TINY + ['--output', str(tmp_path)])
    assert_same_run(whole, tmp_path)
    assert strict_log(tmp_path) == log


def test_sigterm_stops_at_the_next_step_with_a_checkpoint_that_resumes_exactly(tmp_path, whole, monkeypatch):
    # what `pkill -TERM` does to a GPU run before its checkpoint is collected (training/gpu/README.md, plan D): the
    # signal arrives during step 4, the run finishes that step, saves and returns; the same command resumes it
    steps = []

    def normalize_then_signal(*args, **kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return normalize(*args, **kwargs)

    monkeypatch.setattr(train_module, 'normalize', normalize_then_signal)
    handler = signal.getsignal(signal.SIGTERM)
    stopped = train_main(TINY + ['--output', str(tmp_path)])
    assert stopped['stopped'] and (stopped['epoch'], stopped['step_in_epoch']) == (1, 1) and len(steps) == 4
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's own handler is gone with it
    monkeypatch.undo()
    train_main(TINY + ['--output', str(tmp_path)])
    assert_same_run(whole, tmp_path)
    assert strict_log(tmp_path) == strict_log(whole)


@pytest.mark.parametrize('point', ['after the checkpoint, before the log', 'before the checkpoint rename'])
def test_a_kill_at_the_checkpoint_log_boundary_loses_nothing(tmp_path, whole, monkeypatch, point):
    with monkeypatch.context() as m:
        if point.startswith('after'):  # epoch 1's checkpoint is in place, its log line not yet written
            def kill(*args):
                raise Killed
            m.setattr(runs, 'write_log', kill)
        else:  # epoch 2's checkpoint is written to its temporary file, not yet renamed over epoch 1's
            renames, replace = [], os.replace

            def kill(src, dst):
                renames.append(dst)
                if renames.count(dst) == 2 and dst.endswith('last.pth.tar'):
                    raise Killed
                replace(src, dst)
            m.setattr(runs.os, 'replace', kill)
        with pytest.raises(Killed):
            train_main(TINY + ['--output', str(tmp_path)])
    train_main(TINY + ['--output', str(tmp_path)])
    assert_same_run(whole, tmp_path)
    assert strict_log(tmp_path) == strict_log(whole)


def test_a_diverging_run_stops_before_it_saves(tmp_path):
    # one step per epoch: epoch 1 warms up from a tiny lr, epoch 2 steps with lr 1e6 and its test loss turns NaN
    args = TINY + ['--output', str(tmp_path), '--train-limit', '32', '--epochs', '3', '--lr', '1e6']
    with pytest.raises(FloatingPointError, match=r'diverged in epoch 2: .*Nothing was saved.*--lr.*--clip-grad'):
        train_main(args)
    state = read_checkpoint(str(tmp_path / 'last.pth.tar'))  # intact: its digest matches
    assert state['epoch'] == 1 and train_module._non_finite(state) is None
    assert [e['epoch'] for e in strict_log(tmp_path)] == [1]
    before = (tmp_path / 'last.pth.tar').read_bytes()
    with pytest.raises(FloatingPointError, match='diverged in epoch 2'):
        train_main(args)  # the same command repeats the divergence, and again keeps epoch 1
    assert (tmp_path / 'last.pth.tar').read_bytes() == before


def test_one_run_per_output_folder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, '-c', 'import fcntl, sys, time; f = open(sys.argv[1], "a"); fcntl.flock(f, fcntl.LOCK_EX); '
                               'f.write("4242"); f.flush(); print("locked", flush=True); time.sleep(60)',
         str(tmp_path / 'train.lock')], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'locked'
        with pytest.raises(RuntimeError, match=rf"another training run \(pid 4242\) is using '{tmp_path}'"):
            train_main(TINY + ['--output', str(tmp_path), '--max-steps', '1'])
    finally:
        holder.kill()  # the OS releases a dead process's lock: nothing is left to clean up
        holder.wait()
        holder.stdout.close()
    assert train_main(TINY + ['--output', str(tmp_path), '--max-steps', '1'])['stopped']


def test_an_altered_checkpoint_is_refused(tmp_path):
    train_main(TINY + ['--output', str(tmp_path), '--max-steps', '1'])
    path = tmp_path / 'last.pth.tar'
    state = torch.load(path, weights_only=True)
    state['model']['head.bias'] += 1
    torch.save(state, path)
    for load in (lambda: train_main(TINY + ['--output', str(tmp_path)]), lambda: load_training_checkpoint(str(path))):
        with pytest.raises(ValueError, match='does not match the sha256 digest written into it: it was altered'):
            load()
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"cannot read '{path}' as a training checkpoint .*truncated or corrupt"):
        load_training_checkpoint(str(path))


def test_the_log_records_the_machine_and_a_resume_on_another_says_so(tmp_path, capsys, monkeypatch):
    train_main(TINY + ['--output', str(tmp_path), '--max-steps', '4'])  # one epoch and a step
    state = read_checkpoint(str(tmp_path / 'last.pth.tar'))
    here = dict(state['runtime'])
    assert here['processor'] and here['torch'] == torch.__version__
    for key in ('processor', 'torch'):  # as a checkpoint from before the machine was recorded: nothing to compare
        del state['runtime'][key]
    runs.save_checkpoint(str(tmp_path), state)
    capsys.readouterr()
    train_main(TINY + ['--output', str(tmp_path), '--max-steps', '5'])
    assert 'note:' not in capsys.readouterr().out
    there = dict(processor='Another CPU, AVX2', torch=here['torch'])
    monkeypatch.setattr(train_module, '_machine', lambda device: there)
    train_main(TINY + ['--output', str(tmp_path)])
    assert f"note: resumed with processor 'Another CPU, AVX2' (was {here['processor']!r}): results change by float " \
           f"rounding only" in capsys.readouterr().out
    assert [e['processor'] for e in strict_log(tmp_path)] == [here['processor'], there['processor']]


def test_a_checkpoint_from_before_digests_loads_and_resumes(tmp_path, whole):
    # written by the trainer as it was before checkpoints carried a digest, their log and the newer options
    train_main(TINY + ['--output', str(tmp_path), '--max-steps', '4'])
    path = tmp_path / 'last.pth.tar'
    state = torch.load(path, weights_only=True)
    for key in ('sha256', 'log', 'scaler', 'runtime'):
        del state[key]
    for key in ('clip_grad', 'amp', 'eval_limit', 'train_data', 'test_data'):
        del state['config'][key]
    torch.save(state, path)
    with pytest.warns(UserWarning, match='not verified'):
        assert load_training_checkpoint(str(path)).num_classes == 10
    # a missing option means its default: the run, started with --eval-limit 50, now counts as having had none
    with pytest.warns(UserWarning, match='not verified'), \
            pytest.raises(ValueError, match='eval_limit: checkpoint None vs now 50'):
        train_main(TINY + ['--output', str(tmp_path)])
    state['config']['eval_limit'] = 50
    torch.save(state, path)
    with pytest.warns(UserWarning, match='not verified'):
        train_main(TINY + ['--output', str(tmp_path)])
    assert_same_run(whole, tmp_path)
    assert strict_log(tmp_path) == strict_log(whole)  # epoch 1's line came from the old log.jsonl


def test_resume_with_other_settings_is_refused(tmp_path, synthetic_cifar10):
    run = tmp_path / 'run'
    train_main(TINY + ['--output', str(run), '--max-steps', '1'])
    other_images, same_images = tmp_path / 'other', tmp_path / 'same'
    for folder in (other_images, same_images):
        folder.mkdir()
        (folder / 'test.npz').symlink_to(os.path.join(synthetic_cifar10, 'test.npz'))
    (same_images / 'train.npz').symlink_to(os.path.join(synthetic_cifar10, 'train.npz'))
    train_images = np.load(os.path.join(synthetic_cifar10, 'train.npz'))['x'].shape[0]
    np.savez_compressed(other_images / 'train.npz', x=np.zeros((train_images, 32, 32, 3), np.uint8),
                        y=np.zeros(train_images, np.int64))  # as many images, other pixels and labels
    for change, message in [(['--lr', '0.1'], 'lr: checkpoint 0.002 vs now 0.1'),
                            (['--clip-grad', '1'], 'clip_grad: checkpoint None vs now 1.0'),
                            (['--amp', 'bf16'], "amp: checkpoint 'none' vs now 'bf16'"),
                            (['--eval-limit', '40'], 'eval_limit: checkpoint 50 vs now 40'),
                            (['--data-dir', str(other_images)], r'train_data \(--data-dir / --train-limit\)')]:
        with pytest.raises(ValueError, match=message):
            train_main(TINY + ['--output', str(run)] + change)
    # the same images elsewhere are the same run
    assert train_main(TINY + ['--output', str(run), '--data-dir', str(same_images), '--max-steps', '2'])['stopped']


def test_train_runs_from_python_as_the_command_does(tmp_path, synthetic_cifar10):
    # no argparse: a TrainConfig (a Path as output, the data folder named) trains what the same command line trains
    kwargs = dict(embed_dim=16, depth=2, mlp_dim=16, num_heads=3, proj_drop_rate=0.1, attn_drop_rate=0.)
    config = TrainConfig(model='sa_quadratic_cifar', model_kwargs=kwargs, output=tmp_path / 'python', epochs=1,
                         batch_size=32, train_limit=64, eval_limit=50, model_ema=True, data_dir=synthetic_cifar10)
    assert config.output == str(tmp_path / 'python') and config.device == 'cpu'  # as the checkpoint records them
    result = train(config)
    assert result['epoch'] == 1 and not result['stopped'] and 0 <= result['test_top1'] <= 100
    assert [e['epoch'] for e in strict_log(tmp_path / 'python')] == [1]
    train_main(['--model', 'sa_quadratic_cifar', '--model-kwargs', json.dumps(kwargs), '--epochs', '1',
                '--batch-size', '32', '--train-limit', '64', '--eval-limit', '50', '--model-ema',
                '--data-dir', synthetic_cifar10, '--output', str(tmp_path / 'command')])
    assert_same_run(tmp_path / 'python', tmp_path / 'command')
    assert strict_log(tmp_path / 'python') == strict_log(tmp_path / 'command')
    with pytest.raises(TypeError, match='train\\(\\) takes a TrainConfig, not Namespace'):
        train(train_module._parser().parse_args(['--model', 'sa_quadratic_cifar', '--output', str(tmp_path)]))


def test_the_command_line_takes_its_defaults_from_train_config():
    required = ['--model', 'sa_quadratic_tiny_cifar', '--output', 'runs/x']
    assert vars(train_module._parser().parse_args(required)) == dataclasses.asdict(
        TrainConfig(model='sa_quadratic_tiny_cifar', output='runs/x'))


@pytest.mark.parametrize('field, value, message', [
    ('epochs', 0, 'expected a whole number ≥ 1, got 0'),
    ('epochs', 2.0, 'expected a whole number ≥ 1, got 2.0'),
    ('batch_size', '128', "expected a whole number ≥ 1, got '128'"),
    ('lr', float('nan'), 'expected a finite number ≥ 0, got nan'),
    ('smoothing', 1.5, r'expected a number in \[0, 1\), got 1.5'),
    ('clip_grad', 0, 'expected a finite number > 0, got 0'),
    ('model_ema_decay', True, 'expected a number in'),
    ('amp', 'fp8', "expected one of 'none', 'bf16', 'fp16', got 'fp8'"),
    ('model', 'sa_quadratic_tiny', "unknown model 'sa_quadratic_tiny'"),
    ('model_kwargs', {'num_heads': (1, 2)}, 'expected a JSON object'),
    ('device', 'tpu', "'tpu' is not a torch device"),
    ('device', f'cuda:{torch.cuda.device_count()}', f'cuda:{torch.cuda.device_count()}: torch sees'),
    ('model_ema', 1, 'expected a bool, got 1'),
    ('opt', None, 'expected a str, got None'),
    ('output', 7, 'expected a path, got 7'),
])
def test_a_bad_train_config_value_is_refused_naming_the_field(field, value, message):
    options = dict(dict(model='sa_quadratic_tiny_cifar', output='runs/x'), **{field: value})
    with pytest.raises(ValueError, match=f'^TrainConfig {field}: {message}'):
        TrainConfig(**options)


def test_evaluate_a_training_checkpoint(tmp_path, capsys, synthetic_cifar10):
    train_main(TINY + ['--output', str(tmp_path), '--epochs', '1'])
    model = load_training_checkpoint(str(tmp_path / 'last.pth.tar'), use_ema=True)
    assert model.num_classes == 10
    result = evaluate_cli.main(['--model', 'sa_quadratic_cifar', '--checkpoint', str(tmp_path / 'last.pth.tar'),
                                '--data-dir', synthetic_cifar10, '--limit', '50',
                                '--json', str(tmp_path / 'eval.json')])
    assert result['images'] == 50 and json.loads((tmp_path / 'eval.json').read_text())['top1'] == result['top1']
    # --ema scores the run's EMA weights, without it its weights
    images, labels = load_cifar10(synthetic_cifar10, 'test')
    checkpoint = str(tmp_path / 'last.pth.tar')
    ema = evaluate_cli.main(['--model', 'sa_quadratic_cifar', '--checkpoint', checkpoint, '--ema',
                             '--data-dir', synthetic_cifar10, '--limit', '50'])
    expected = {key: dict(evaluate_cli.evaluate(load_training_checkpoint(checkpoint, use_ema=key == 'ema'),
                                                images[:50], labels[:50], progress=False), model='sa_quadratic_cifar')
                for key in ('model', 'ema')}
    assert ema == expected['ema'] and result == expected['model']
    assert ema['loss'] != result['loss']
    with pytest.raises(ValueError, match='is a checkpoint of sa_quadratic_cifar, not of aa_resnet20_cifar: pass '
                                         '--model sa_quadratic_cifar'):
        evaluate_cli.main(['--model', 'aa_resnet20_cifar', '--checkpoint', str(tmp_path / 'last.pth.tar'),
                           '--data-dir', synthetic_cifar10, '--limit', '50'])


def test_evaluate_a_weights_file(synthetic_cifar10):
    from timm_attnconv.pretrained import bundled_weights_dir
    weights = bundled_weights_dir() / 'sa_quadratic_tiny_cifar.c10' / 'model.safetensors'
    common = ['--data-dir', synthetic_cifar10, '--limit', '20']
    from_file = evaluate_cli.main(common + ['--model', 'sa_quadratic_tiny_cifar', '--checkpoint', str(weights)])
    assert from_file == dict(evaluate_cli.main(common + ['--model', 'sa_quadratic_tiny_cifar.c10', '--pretrained']),
                             model='sa_quadratic_tiny_cifar')
    with pytest.raises(ValueError, match='--ema needs a training checkpoint'):
        evaluate_cli.main(common + ['--model', 'sa_quadratic_tiny_cifar', '--checkpoint', str(weights), '--ema'])


def test_init_from_pretrained_weights(tmp_path):
    # the shipped positional model warm-starts the content model; the run records it, and it is part of the config
    args = ['--model', 'sa_learned_content_tiny_cifar', '--init-from', 'sa_learned_tiny_cifar.c10',
            '--train-limit', '8', '--eval-limit', '8', '--batch-size', '8', '--epochs', '1',
            '--output', str(tmp_path), '--max-steps', '1', '--lr', '0']
    train_main(args)
    state = torch.load(tmp_path / 'last.pth.tar', weights_only=True)
    assert state['config']['init_from'] == 'sa_learned_tiny_cifar.c10'
    assert '--init-from sa_learned_tiny_cifar.c10' in training_command(state['config'], str(tmp_path))
    import timm
    source = timm.create_model('sa_learned_tiny_cifar.c10', pretrained=True).eval()
    model = load_training_checkpoint(str(tmp_path / 'last.pth.tar'))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), source(x), atol=0.05 * source(x).abs().max())  # lr 0: still the source
    # viz's "init" rebuilds the warm start the run began at, not the random model before it
    from timm_attnconv.viz import _training_snapshots
    start = _training_snapshots(['init', str(tmp_path / 'last.pth.tar')])[0][0].state_dict()
    assert all(torch.allclose(v, start[k], atol=1e-4) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match='init_from'):
        train_main(args[:2] + args[4:])


def test_a_run_trains_a_cifar10_model_whatever_dataset_its_cfg_is_for():
    # aa_wide_resnet28_10_cifar's cfg is CIFAR-100's (the paper's dataset): its runs normalise with CIFAR-10's
    # statistics and say so in the cfg that staging writes into the weights' config.json
    from timm_attnconv.constants import CIFAR10_MEAN, CIFAR10_STD
    from timm_attnconv.train_config import initial_model
    config = dict(model='aa_wide_resnet28_10_cifar', model_kwargs={}, seed=0)
    assert timm.create_model('aa_wide_resnet28_10_cifar').pretrained_cfg['num_classes'] == 100
    for model in (initial_model(config), runs.build_model(config)):
        cfg = model.pretrained_cfg
        assert (cfg['mean'], cfg['std'], cfg['num_classes'], model.num_classes) == (CIFAR10_MEAN, CIFAR10_STD, 10, 10)
        assert cfg['label_names'][0] == 'airplane'
    # an overlay the run asked for wins where it names the same field
    asked = dict(config, model='resnet18', model_kwargs={'pretrained_cfg_overlay': {'mean': [0.5, 0.5, 0.5]}})
    assert runs.build_model(asked).pretrained_cfg['mean'] == [0.5, 0.5, 0.5]
    assert initial_model(asked).pretrained_cfg['std'] == CIFAR10_STD


def test_eval_every_and_eval_ema_choose_the_tested_epochs_only(tmp_path, whole):
    # a test reads the weights and draws no random number: testing fewer epochs trains the same weights
    assert 'ema_test_top1' not in strict_log(whole)[0] and 'ema_test_top1' in strict_log(whole)[1]
    args = TINY + ['--output', str(tmp_path), '--eval-every', '2']
    train_main(args + ['--max-steps', '4'])
    train_main(args + ['--eval-ema'])  # free to change on resume
    assert_same_run(whole, tmp_path)
    untested, tested = strict_log(tmp_path)
    assert not any(k.startswith(('test_', 'ema_test_')) for k in untested)
    assert untested == {k: v for k, v in strict_log(whole)[0].items() if not k.startswith('test_')}
    assert tested == strict_log(whole)[1]
    train_main(TINY + ['--output', str(tmp_path / 'ema'), '--epochs', '3', '--eval-every', '2', '--eval-ema',
                       '--train-limit', '32'])
    assert [sorted(k for k in entry if 'test_top1' in k) for entry in strict_log(tmp_path / 'ema')] == [
        [], ['ema_test_top1', 'test_top1'], ['ema_test_top1', 'test_top1']]


def test_the_tests_run_under_the_runs_autocast(tmp_path, monkeypatch):
    # as timm's train.py validates; staging measures the weights in float32 again
    dtypes = []

    def recording_evaluate(*args, amp_dtype=None, **kwargs):
        dtypes.append(amp_dtype)
        return {'top1': 50.0, 'top5': 100.0, 'loss': 1.0}
    monkeypatch.setattr(train_module, 'evaluate', recording_evaluate)
    train_main(TINY + ['--output', str(tmp_path), '--epochs', '1', '--train-limit', '32', '--amp', 'bf16'])
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # the weights and the EMA


def test_a_step_waits_for_the_device_only_every_log_interval(tmp_path, monkeypatch):
    # on a GPU, reading a tensor's value makes the host wait for all queued work, and copying one from the host
    # (pageable memory) waits too: count what the trainer's own code does while the epochs' batches are drawn
    from timm_attnconv.data import EpochBatches
    calls, stepping = [], [False]

    def recording(method):
        original = getattr(torch.Tensor, method)

        def call(self, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get('__name__', '')
            to_device = any(isinstance(a, (str, torch.device)) for a in args) or 'device' in kwargs
            if stepping[0] and module.startswith('timm_attnconv') and (method != 'to' or to_device):
                calls.append((method, module, caller.f_code.co_name))
            return original(self, *args, **kwargs)
        return call

    for method in ('item', 'tolist', '__bool__', '__float__', '__int__', 'cpu', 'numpy', 'to'):
        monkeypatch.setattr(torch.Tensor, method, recording(method))
    iterate = EpochBatches.iterate

    def epoch_of_steps(self, start_step=0):
        stepping[0] = True
        yield from iterate(self, start_step)
        stepping[0] = False
    monkeypatch.setattr(EpochBatches, 'iterate', epoch_of_steps)
    train_main(TINY + ['--output', str(tmp_path), '--log-interval', '2'])  # 2 epochs of 3 steps
    assert [c for c in calls if c[0] != 'to'] == [('tolist', 'timm_attnconv.train', 'progress')] * 3  # steps 2, 4, 6
    # per epoch, EpochBatches copies its order and its 3 kinds of draws to the device, then no more
    assert [c[:2] for c in calls if c[0] == 'to'] == [('to', 'timm_attnconv.data')] * 8


@pytest.mark.parametrize('log_interval', ['1', '100'])
def test_a_diverging_loss_stops_at_the_next_check_or_save(tmp_path, log_interval):
    # the first step at lr 1e6 (no warm-up) wrecks the weights; the loss check or, between checks, the save sees it
    args = TINY + ['--output', str(tmp_path), '--lr', '1e6', '--warmup-epochs', '0', '--max-steps', '2',
                   '--log-interval', log_interval]
    where = 'epoch 1 by step 2: the training loss' if log_interval == '1' else 'epoch 1, step 2:'
    with pytest.raises(FloatingPointError, match=f'diverged in {where}.*there is no checkpoint'):
        train_main(args)
    assert not (tmp_path / 'last.pth.tar').exists()


@pytest.mark.slow
def test_a_compiled_run_resumes_exactly(tmp_path):
    # torch.compile draws its dropout masks from torch's RNG too (CPU C++ compiler; minutes on 2 cores)
    args = TINY + ['--compile', '--train-limit', '64']
    train_main(args + ['--output', str(tmp_path / 'whole')])
    train_main(args + ['--output', str(tmp_path / 'resumed'), '--max-steps', '3'])
    train_main(args + ['--output', str(tmp_path / 'resumed')])
    assert_same_run(tmp_path / 'whole', tmp_path / 'resumed')
    assert strict_log(tmp_path / 'whole') == strict_log(tmp_path / 'resumed')


NO_DROPOUT = ['--model-kwargs', json.dumps(dict(embed_dim=16, depth=2, mlp_dim=16, num_heads=3, proj_drop_rate=0.,
                                                attn_drop_rate=0.))]


def torchrun(args, processes=2):
    """``python -m timm_attnconv.train args`` as torchrun launches it, on the CPU (gloo), one thread a process."""
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get('PYTHONPATH')])))
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node',
                           str(processes), '-m', 'timm_attnconv.train', '--device', 'cpu'] + args,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_torchrun_processes_train_what_one_process_does(tmp_path):
    # --batch-size is global: 2 processes of 16 images a step compute the steps of one process with 32. Without
    # dropout (LayerNorm is per image) they differ by float rounding only
    args = TINY + NO_DROPOUT + ['--train-limit', '64']
    torchrun(args + ['--output', str(tmp_path / 'ddp')])
    train_main(args + ['--output', str(tmp_path / 'one')])
    ddp, one = (torch.load(tmp_path / run / 'last.pth.tar', weights_only=True) for run in ('ddp', 'one'))
    assert ddp['config'] == dict(one['config'], world_size=2) and one['config']['world_size'] == 1
    assert len(ddp['processes']) == 2 and not torch.equal(*(p['rng'] for p in ddp['processes']))
    for key in ('model', 'ema'):
        for name, value in one[key].items():
            torch.testing.assert_close(ddp[key][name], value, rtol=0, atol=1e-6, msg=f'{key}.{name}')
    ddp_log, one_log = strict_log(tmp_path / 'ddp'), strict_log(tmp_path / 'one')
    assert [e['epoch'] for e in ddp_log] == [1, 2]  # written by rank 0 alone
    for a, b in zip(ddp_log, one_log):
        assert a['train_loss'] == pytest.approx(b['train_loss'], rel=1e-6) and a['global_step'] == b['global_step']
    with pytest.raises(ValueError, match=r'with world size 1: it was trained by 2 process\(es\), and every process '
                                         r'keeps its own random state .*torchrun --nproc_per_node 2'):
        train_main(args + ['--output', str(tmp_path / 'ddp'), '--epochs', '2'])


@pytest.mark.slow
def test_an_interrupted_torchrun_run_resumes_exactly(tmp_path):
    # with dropout: every process's RNG stream and its share of the epoch's loss come back from the checkpoint
    torchrun(TINY + ['--output', str(tmp_path / 'whole')])
    torchrun(TINY + ['--output', str(tmp_path / 'resumed'), '--max-steps', '4'])
    torchrun(TINY + ['--output', str(tmp_path / 'resumed')])
    assert_same_run(tmp_path / 'whole', tmp_path / 'resumed')
    assert strict_log(tmp_path / 'whole') == strict_log(tmp_path / 'resumed')
