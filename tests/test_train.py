"""Training runs end to end on a tiny slice of CIFAR-10, stops cleanly and resumes exactly."""
import json

import pytest
import torch

from timm_attnconv import evaluate as evaluate_cli
from timm_attnconv.stage import training_command
from timm_attnconv.train import load_training_checkpoint, main as train_main

from .test_data import DATA_DIR, needs_data

TINY = ['--model', 'sa_quadratic_cifar', '--model-kwargs',
        json.dumps(dict(embed_dim=16, depth=2, mlp_dim=16, num_heads=3, proj_drop_rate=0.1, attn_drop_rate=0.)),
        '--data-dir', DATA_DIR, '--train-limit', '96', '--eval-limit', '50', '--batch-size', '32', '--epochs', '2',
        '--model-ema', '--warmup-epochs', '1']


@needs_data
def test_interrupted_run_resumes_exactly(tmp_path):
    whole = train_main(TINY + ['--output', str(tmp_path / 'whole')])
    assert whole['epoch'] == 2 and not whole['stopped']
    log = [json.loads(line) for line in open(tmp_path / 'whole' / 'log.jsonl')]
    assert [e['epoch'] for e in log] == [1, 2] and 0 <= log[-1]['test_top1'] <= 100

    stopped = train_main(TINY + ['--output', str(tmp_path / 'split'), '--max-steps', '4'])
    assert stopped['stopped'] and stopped['epoch'] == 1 and stopped['step_in_epoch'] == 1
    train_main(TINY + ['--output', str(tmp_path / 'split')])

    a = torch.load(tmp_path / 'whole' / 'last.pth.tar', weights_only=True)
    b = torch.load(tmp_path / 'split' / 'last.pth.tar', weights_only=True)
    for key in ('model', 'ema'):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f'{key}.{name} differs after resume'
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()


@needs_data
def test_resume_with_other_settings_is_refused(tmp_path):
    train_main(TINY + ['--output', str(tmp_path), '--max-steps', '1'])
    with pytest.raises(ValueError, match="lr: checkpoint 0.002 vs now 0.1"):
        train_main(TINY + ['--output', str(tmp_path), '--lr', '0.1'])


@needs_data
def test_evaluate_a_training_checkpoint(tmp_path, capsys):
    train_main(TINY + ['--output', str(tmp_path), '--epochs', '1'])
    model = load_training_checkpoint(str(tmp_path / 'last.pth.tar'), use_ema=True)
    assert model.num_classes == 10
    result = evaluate_cli.main(['--model', 'sa_quadratic_cifar', '--checkpoint', str(tmp_path / 'last.pth.tar'),
                                '--data-dir', DATA_DIR, '--limit', '50', '--json', str(tmp_path / 'eval.json')])
    assert result['images'] == 50 and json.load(open(tmp_path / 'eval.json'))['top1'] == result['top1']


@needs_data
def test_init_from_pretrained_weights(tmp_path):
    # the shipped positional model warm-starts the content model; the run records it, and it is part of the config
    args = ['--model', 'sa_learned_content_tiny_cifar', '--init-from', 'sa_learned_tiny_cifar.c10',
            '--data-dir', DATA_DIR, '--train-limit', '8', '--eval-limit', '8', '--batch-size', '8', '--epochs', '1',
            '--output', str(tmp_path), '--max-steps', '1', '--lr', '0']
    train_main(args)
    state = torch.load(tmp_path / 'last.pth.tar', weights_only=True)
    assert state['config']['init_from'] == 'sa_learned_tiny_cifar.c10'
    assert '--init-from sa_learned_tiny_cifar.c10' in training_command(state['config'], str(tmp_path))
    import timm
    source = timm.create_model('sa_learned_tiny_cifar', pretrained=True).eval()
    model = load_training_checkpoint(str(tmp_path / 'last.pth.tar'))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), source(x), atol=0.05 * source(x).abs().max())  # lr 0: still the source
    with pytest.raises(ValueError, match='init_from'):
        train_main(args[:2] + args[4:])
