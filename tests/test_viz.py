"""The figures are written, have the panels they claim, and are not blank."""
import numpy as np
import pytest
import timm
import torch
from PIL import Image

from timm_attnconv.viz import main, plot_attention, plot_centers


def _pixels(path):
    return np.asarray(Image.open(path).convert('L'), dtype=np.float32)


def test_center_plot_has_one_panel_per_layer_and_rows_per_model(tmp_path):
    models = [timm.create_model('sa_quadratic_gen_cifar', embed_dim=16, mlp_dim=16, depth=d) for d in (3, 2)]
    panels = plot_centers(models, str(tmp_path / 'c.png'), titles=['a', 'b'])
    assert panels == 5
    pixels = _pixels(tmp_path / 'c.png')
    assert pixels.shape[1] > pixels.shape[0] and pixels.std() > 10  # a wide figure with content


@pytest.mark.parametrize('name,kwargs,size,rows', [('sa_quadratic_tiny_cifar', {}, 32, 6),
                                                   ('aa_resnet20_cifar', {}, 32, 6),
                                                   ('deit_ea_tiny_patch16_224', dict(depth=2), 224, 2)])
def test_attention_plot_draws_every_head_of_every_layer(tmp_path, name, kwargs, size, rows):
    model = timm.create_model(name, **kwargs).eval()
    images = torch.randint(0, 256, (2, 3, size, size), dtype=torch.uint8)
    panels = plot_attention(model, images, (size // 2, size // 2), str(tmp_path / 'a.png'))
    heads = {'sa_quadratic_tiny_cifar': 9, 'aa_resnet20_cifar': 4, 'deit_ea_tiny_patch16_224': 3}[name]
    assert panels == rows * heads
    assert _pixels(tmp_path / 'a.png').std() > 10


def test_cli_and_refusals(tmp_path):
    assert main(['centers', '--model', 'sa_quadratic_tiny_cifar', '--out', str(tmp_path / 'x.png')]) == 6
    with pytest.raises(ValueError, match='no quadratic-encoding attention heads'):
        main(['centers', '--model', 'aa_resnet20_cifar', '--out', str(tmp_path / 'y.png')])
    with pytest.raises(ValueError, match='no attention layers'):
        plot_attention(timm.create_model('attnconv_resnet20_cifar'), torch.zeros(1, 3, 32, 32, dtype=torch.uint8),
                       (4, 4), str(tmp_path / 'z.png'))


@pytest.mark.usefixtures('synthetic_cifar10_as_default')  # the data test_train.TINY trains on
def test_training_time_grid_starts_at_the_runs_initialisation(tmp_path):
    from timm_attnconv.runs import load_training_checkpoint, load_weights, read_checkpoint, save_checkpoint
    from timm_attnconv.train import main as train_main
    from timm_attnconv.viz import _training_snapshots
    from .test_train import TINY
    run, frozen = tmp_path / 'run', tmp_path / 'frozen'
    train_main(TINY + ['--output', str(run), '--max-steps', '1'])
    # with a zero learning rate a step leaves the weights as the run started them
    train_main(TINY + ['--output', str(frozen), '--max-steps', '1', '--lr', '0', '--warmup-epochs', '0'])
    ckpt = str(run / 'last.pth.tar')
    models, titles = _training_snapshots(['init', ckpt])
    assert titles == ['initialisation', 'epoch 0 + 1 steps']
    start = load_training_checkpoint(str(frozen / 'last.pth.tar')).state_dict()
    assert all(torch.equal(v, start[k]) for k, v in models[0].state_dict().items())  # the seed rebuilds the start
    trained = load_training_checkpoint(ckpt).state_dict()
    assert any(not torch.equal(v, trained[k]) for k, v in models[0].state_dict().items())  # one step moved it
    assert main(['centers', '--model', 'sa_quadratic_cifar', '--checkpoints', 'init', ckpt,
                 '--out', str(tmp_path / 'grid.png')]) == 2 * 2  # two rows of two layers
    with pytest.raises(ValueError, match='needs at least one checkpoint'):
        _training_snapshots(['init'])
    # --ema draws the run's EMA weights (TINY keeps them), not its weights
    (ema,), titles = _training_snapshots([ckpt], ema=True)
    expected = load_weights(read_checkpoint(ckpt), 'ema').state_dict()
    assert titles == ['epoch 0 + 1 steps, EMA']
    assert all(torch.equal(v, expected[k]) for k, v in ema.state_dict().items())
    # a checkpoint of the same run written by an earlier trainer (fewer keys in its config) shares the start; one
    # with another seed does not
    state = torch.load(ckpt, weights_only=True)
    earlier = {k: v for k, v in state['config'].items() if k not in ('amp', 'train_data', 'test_data', 'world_size')}
    for name, config in [('earlier', earlier), ('reseeded', dict(state['config'], seed=7))]:
        (tmp_path / name).mkdir()
        save_checkpoint(str(tmp_path / name), dict(state, config=config))
    models, _ = _training_snapshots(['init', ckpt, str(tmp_path / 'earlier' / 'last.pth.tar')])
    assert all(torch.equal(v, start[k]) for k, v in models[0].state_dict().items())
    with pytest.raises(ValueError, match='ambiguous: the checkpoints come from runs that start differently'):
        _training_snapshots(['init', ckpt, str(tmp_path / 'reseeded' / 'last.pth.tar')])
