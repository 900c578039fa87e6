"""Staging a training run as a Hub-layout weights folder with a recorded sha256."""
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

from timm_attnconv.pretrained import sha256_file
from timm_attnconv.stage import (
    main as stage_main, model_type, paper_top1, recipe_differences, training_command, training_options,
    warm_start_sentence)
from timm_attnconv.train import main as train_main

from .conftest import SYNTHETIC_TRAIN_IMAGES
from .test_train import TINY

WEIGHTS = Path(__file__).resolve().parent.parent / 'weights'


def test_stage_writes_a_hub_folder_and_records_its_digest(tmp_path, synthetic_cifar10, capsys):
    run = tmp_path / 'run'
    train_main(TINY + ['--output', str(run), '--epochs', '1', '--data-dir', synthetic_cifar10])
    result = stage_main([str(run), '--tag', 'test', '--out', str(tmp_path / 'weights'), '--data-dir',
                         synthetic_cifar10, '--limit', '64', '--record', str(tmp_path / 'sha.json')])
    folder = tmp_path / 'weights' / 'sa_quadratic_cifar.test'
    assert sorted(p.name for p in folder.iterdir()) == [
        'README.md', 'config.json', 'model.safetensors', 'training_curves.png', 'training_log.jsonl']
    digest = sha256_file(folder / 'model.safetensors')
    assert json.loads((tmp_path / 'sha.json').read_text()) == {'timm-attnconv/sa_quadratic_cifar.test': {
        p.name: sha256_file(p) for p in folder.iterdir()}}  # every file: config and card change behaviour too
    assert result['sha256'] == digest and result['images'] == 64
    state = torch.load(run / 'last.pth.tar', weights_only=True)
    shipped = load_file(folder / 'model.safetensors')
    chosen = state['ema'] if result['weights'] == 'EMA weights' else state['model']
    assert all(torch.equal(shipped[k], (chosen[k] if k in chosen else chosen['module.' + k]).to(shipped[k].dtype))
               for k in shipped)  # as trained, rounded to the stored dtype that `stage` measured and chose
    assert {str(v.dtype) for v in shipped.values()} == {f"torch.{result['stored_dtype']}"}
    card = (folder / 'README.md').read_text()
    assert 'library_name: timm' in card and f"value: {round(result['top1'], 2)}" in card
    assert 'Conv-likeness of the heads' in card and '| blocks.1.attn |' in card
    assert training_command(state['config'], str(run)) in card
    model = timm.create_model(f'local-dir:{folder}', pretrained=True)  # timm loads the folder as written
    assert model.num_classes == 10
    # a tag not in default_cfgs yet: config.json still names it, without the notes of the default tag's weights, and
    # stage says to register it and refresh the file
    written = json.loads((folder / 'config.json').read_text())['pretrained_cfg']
    assert written['tag'] == 'test' and 'notes' not in written
    assert timm.models.get_pretrained_cfg('sa_quadratic_cifar').notes  # what the folder would have carried
    printed = capsys.readouterr().out
    assert 'sa_quadratic_cifar.test is not in default_cfgs yet' in printed and '--refresh-config' in printed


def test_a_card_lists_staged_folders_beside_it_with_how_their_recipes_differ(tmp_path, synthetic_cifar10):
    # an EA twin's card beside its base's folder (issue: every twin against its base at equal recipe)
    run = tmp_path / 'run'
    train_main(TINY + ['--output', str(run), '--epochs', '1', '--data-dir', synthetic_cifar10])
    common = ['--out', str(tmp_path / 'weights'), '--data-dir', synthetic_cifar10, '--limit', '64', '--record',
              str(tmp_path / 'sha.json')]
    base = stage_main([str(run), '--tag', 'base'] + common)
    kwargs = json.loads(TINY[TINY.index('--model-kwargs') + 1])
    params = sum(p.numel() for p in timm.create_model('sa_quadratic_cifar', num_classes=10, **kwargs).parameters())
    row = f"| sa_quadratic_cifar.base (staged; {{}}) | {base['top1']:.2f}% | {params / 1e6:.3f}M |"

    stage_main([str(run), '--tag', 'same'] + common + ['--beside', 'sa_quadratic_cifar.base'])
    card = (tmp_path / 'weights' / 'sa_quadratic_cifar.same' / 'README.md').read_text()
    assert row.format('the same training recipe') in card
    assert '--limit 64 --beside sa_quadratic_cifar.base`' in card  # the card's stage command names it
    # what the run's config does not hold but its card's command shows: a recipe option, and a neutral one
    stage_main([str(run), '--tag', 'bf16'] + common + ['--beside', 'sa_quadratic_cifar.base',
                                                         '--extra-train-args', '--amp bf16 --channels-last'])
    card = (tmp_path / 'weights' / 'sa_quadratic_cifar.bf16' / 'README.md').read_text()
    assert row.format('its recipe differs: no `--amp` there, `--amp bf16` here') in card

    with pytest.raises(FileNotFoundError, match='--beside sa_quadratic_cifar.none: no staged folder .* stage that run'):
        stage_main([str(run), '--tag', 'x'] + common + ['--beside', 'sa_quadratic_cifar.none'])
    assert not (tmp_path / 'weights' / 'sa_quadratic_cifar.x').exists()

    # a folder staged later is added to an earlier card without its run: the card then reads as staged with it
    same = tmp_path / 'weights' / 'sa_quadratic_cifar.same'
    record = ['--record', str(tmp_path / 'sha.json')]
    stage_main(['--add-beside', str(same), '--beside', 'sa_quadratic_cifar.bf16', 'sa_quadratic_cifar.base'] + record)
    added = (same / 'README.md').read_text()
    assert json.loads((tmp_path / 'sha.json').read_text())['timm-attnconv/sa_quadratic_cifar.same']['README.md'] == \
        sha256_file(same / 'README.md')
    stage_main([str(run), '--tag', 'same'] + common + ['--beside', 'sa_quadratic_cifar.base', 'sa_quadratic_cifar.bf16'])
    assert added == (same / 'README.md').read_text()  # listed once, in the order a new stage would list them
    for argv, error, match in (
            (['--beside', 'sa_quadratic_cifar.same'], ValueError, 'does not list itself'),
            (['--beside', 'sa_quadratic_cifar.none'], FileNotFoundError, 'no staged folder .* stage that run first')):
        with pytest.raises(error, match=match):
            stage_main(['--add-beside', str(same)] + argv + record)
        assert (same / 'README.md').read_text() == added  # refused before anything was written


def test_the_stage_command_of_every_staged_card_reads_back_as_written():
    # --add-beside rewrites a card's stage command from its parsed options: they must give back what stage wrote
    from timm_attnconv.stage import _parser, _stage_command
    for card in sorted(WEIGHTS.glob('*/README.md')):
        written = re.search(r'^Staged with `(.*)`\.$', card.read_text(), re.M).group(1)
        args = _parser().parse_args(shlex.split(written)[3:])
        assert _stage_command(args.run, args.tag, args.hardware, args.extra_train_args, args.init_command, args.weights,
                              args.dtype, args.limit, args.batch_size, args.beside) == written, card.parent.name


def test_recipe_differences_read_the_training_command_of_a_card():
    # a card's Reproduce block: the command that wrote the --init-from file first, continuation lines, a quoted value
    card_command = ("python training/gpu/prune.py sa_quadratic_gen_cifar.c10 /tmp/runs/x --half\n"
                    "python -m timm_attnconv.train \\\n    --model sa_quadratic_gen_pruned_cifar \\\n"
                    "    --model-kwargs '{\"num_heads\": [7, 5]}' \\\n    --output /tmp/runs/x \\\n"
                    "    --lr 0.0001 \\\n    --model-ema \\\n    --device cuda --eval-every 10 --compile\n")
    options = training_options(card_command)
    assert options == {'--model': 'sa_quadratic_gen_pruned_cifar', '--model-kwargs': '{"num_heads": [7, 5]}',
                       '--output': '/tmp/runs/x', '--lr': '0.0001', '--model-ema': '', '--device': 'cuda',
                       '--eval-every': '10', '--compile': ''}
    here = training_options('python -m timm_attnconv.train --model other --output o --lr 0.0001 --model-ema '
                            '--model-kwargs \'{"num_heads": [7, 5]}\' --seed 7')
    assert recipe_differences(options, here) == ['no `--seed` there, `--seed 7` here']  # model, output, device: neutral
    assert recipe_differences(here, options) == ['`--seed 7` there, no `--seed` here']
    with pytest.raises(ValueError, match='no `timm_attnconv.train` command'):
        training_options('python -m timm_attnconv.evaluate --model x')


@pytest.mark.parametrize('epochs_done', [1.5, 0.5])  # from its finished epochs / stopped within its first
def test_a_run_on_a_small_data_set_counts_its_epochs_in_its_own_steps(tmp_path, synthetic_cifar10, epochs_done):
    # no --train-limit: an epoch is as many steps as the folder's images make, not the 50,000 of the real split
    from timm_attnconv.stage import _read_run
    limit = TINY.index('--train-limit')
    args = TINY[:limit] + TINY[limit + 2:] + ['--data-dir', synthetic_cifar10, '--output', str(tmp_path)]
    steps_per_epoch = SYNTHETIC_TRAIN_IMAGES // int(args[args.index('--batch-size') + 1])
    train_main(args + ['--max-steps', str(int(steps_per_epoch * epochs_done))])
    assert _read_run(str(tmp_path))['epochs_done'] == epochs_done


def test_refresh_config_writes_the_registered_cfg_of_a_folders_tag(tmp_path):
    # a tag staged before it was registered: config.json carries the arch's default cfg (another tag's notes)
    name = 'attnconv_resnet20_cifar.c10_2ep'
    folder = tmp_path / name
    shutil.copytree(WEIGHTS / name, folder)
    config = json.loads((folder / 'config.json').read_text())
    config['pretrained_cfg'].update(tag='c10', notes=['the notes of another tag'])
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    record = tmp_path / 'sha.json'
    assert stage_main(['--refresh-config', str(folder), '--record', str(record)]) == {str(folder): True}
    written = json.loads((folder / 'config.json').read_text())
    registered = timm.models.get_pretrained_cfg(name)
    assert written['pretrained_cfg']['tag'] == 'c10_2ep'
    assert written['pretrained_cfg']['notes'] == list(registered.notes)
    # what the refresh keeps (timm 1.0.28's writer leaves out the root global_pool that later releases add)
    kept = ('architecture', 'num_classes', 'model_args', 'label_names', 'weights_dtype')
    assert {k: written[k] for k in kept} == {k: config[k] for k in kept}
    assert sha256_file(folder / 'model.safetensors') == sha256_file(WEIGHTS / name / 'model.safetensors')
    assert json.loads(record.read_text()) == {f'timm-attnconv/{name}': {
        p.name: sha256_file(p) for p in folder.iterdir()}}
    assert stage_main(['--refresh-config', str(folder), '--record', str(record)]) == {str(folder): False}

    unregistered = tmp_path / 'attnconv_resnet20_cifar.c10_new'
    shutil.copytree(WEIGHTS / name, unregistered)
    with pytest.raises(ValueError, match='not registered in default_cfgs: register it there first'):
        stage_main(['--refresh-config', str(unregistered), '--record', str(record)])
    with pytest.raises(SystemExit):  # a run and folders to refresh: one or the other
        stage_main([str(folder), '--tag', 'x', '--refresh-config', str(folder)])


def test_stage_needs_a_training_run(tmp_path):
    with pytest.raises(FileNotFoundError, match='no training checkpoint'):
        stage_main([str(tmp_path), '--tag', 'x'])


def _weights_only_run(folder, model_kwargs, init_from=None):
    """A run folder as a GPU machine brings one back: EMA weights, the trainer's config and log, no checkpoint."""
    from safetensors.torch import save_file
    folder.mkdir()
    model = timm.create_model('sa_quadratic_tiny_cifar', num_classes=10, **model_kwargs)
    save_file(model.state_dict(), folder / 'ema.safetensors')
    config = dict(model='sa_quadratic_tiny_cifar', model_kwargs=model_kwargs, epochs=4, batch_size=256, opt='adamw',
                  lr=1e-3, weight_decay=0.05, sched='cosine', warmup_epochs=1, min_lr=1e-5, smoothing=0.1,
                  model_ema=True, model_ema_decay=0.999, seed=42, train_limit=None, init_from=init_from)
    (folder / 'config.json').write_text(json.dumps(config))
    (folder / 'log.jsonl').write_text(''.join(
        json.dumps(dict(epoch=e, lr=1e-3 / e, train_loss=2. / e, test_top1=10. * e, test_loss=2. / e)) + '\n'
        for e in (1, 2, 3)))
    return model


def test_a_weights_only_run_stages_in_half_precision_and_rebuilds_its_model(tmp_path, synthetic_cifar10, monkeypatch):
    from timm_attnconv import evaluate
    batches, predict_logits = [], evaluate.predict_logits  # the images of each forward pass of the evaluations

    def recording_predict_logits(model, *args):
        handle = model.register_forward_pre_hook(lambda module, inputs: batches.append(inputs[0].shape[0]))
        try:
            return predict_logits(model, *args)
        finally:
            handle.remove()
    monkeypatch.setattr(evaluate, 'predict_logits', recording_predict_logits)
    kwargs = dict(depth=2, num_heads=3)  # not the registered architecture: config.json must say so
    source = _weights_only_run(tmp_path / 'run', kwargs)
    result = stage_main([str(tmp_path / 'run'), '--tag', 'gpu', '--out', str(tmp_path / 'weights'), '--data-dir',
                         synthetic_cifar10, '--limit', '32', '--record', str(tmp_path / 'sha.json'), '--dtype',
                         'float16', '--hardware', 'one test GPU', '--extra-train-args', '--amp bf16',
                         '--batch-size', '12'])
    assert batches == [12, 12, 8] * 2  # the weights as trained, then rounded to float16
    folder = tmp_path / 'weights' / 'sa_quadratic_tiny_cifar.gpu'
    assert result['weights'] == 'EMA weights' and result['stored_dtype'] == 'float16'
    stored = load_file(folder / 'model.safetensors')
    assert {v.dtype for v in stored.values()} == {torch.float16}
    config = json.loads((folder / 'config.json').read_text())
    assert config['weights_dtype'] == 'float16' and config['model_args']['depth'] == 2
    assert config['model_args']['num_heads'] == 3

    model = timm.create_model(f'local-dir:{folder}', pretrained=True)  # rebuilt from config.json alone
    assert len(model.blocks) == 2 and model.blocks[0].attn.num_heads == 3
    state = model.state_dict()
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], v.float()) for k, v in stored.items())
    assert all(torch.equal(state[k], v.half().float()) for k, v in source.state_dict().items())

    card = (folder / 'README.md').read_text()
    assert 'one test GPU' in card and '3 of 4 epochs' in card and 'not resumable' in card
    assert 'stored as float16' in card and '--amp bf16' in card
    assert '--output training/sa_quadratic_tiny_cifar.gpu ' in card  # the weights' name: no other run's folder
    assert 'learning rate was 0.000333, 33.3% of its peak 0.001' in card
    assert (f"Staged with `python -m timm_attnconv.stage {tmp_path / 'run'} --tag gpu --dtype float16 --limit 32 "
            f"--batch-size 12 --hardware 'one test GPU' --extra-train-args '--amp bf16'`") in card


def test_the_card_shows_the_command_that_wrote_the_start_of_a_warm_started_run(tmp_path, synthetic_cifar10):
    _weights_only_run(tmp_path / 'run', {}, init_from='/tmp/runs/start/pruned.safetensors')
    args = [str(tmp_path / 'run'), '--tag', 'ft', '--out', str(tmp_path / 'weights'), '--data-dir', synthetic_cifar10,
            '--limit', '32', '--record', str(tmp_path / 'sha.json'), '--dtype', 'float32']
    prune = 'python training/gpu/prune.py sa_quadratic_gen_cifar.c10 /tmp/runs/start --half'
    stage_main(args + ['--init-command', prune])
    card = (tmp_path / 'weights' / 'sa_quadratic_tiny_cifar.ft' / 'README.md').read_text()
    assert f'```bash\n{prune}\npython -m timm_attnconv.train \\\n    --model sa_quadratic_tiny_cifar' in card
    assert '`pruned.safetensors`, which the first command under Training writes)' in card
    assert f"--init-command '{prune}'" in card
    _weights_only_run(tmp_path / 'scratch', {})
    with pytest.raises(ValueError, match="started from None: drop --init-command"):
        stage_main([str(tmp_path / 'scratch')] + args[1:] + ['--init-command', prune])


def test_a_folder_that_is_no_run_is_refused_with_what_a_run_holds(tmp_path, synthetic_cifar10):
    (tmp_path / 'ema.safetensors').write_bytes(b'')
    with pytest.raises(FileNotFoundError, match='config.json'):
        stage_main([str(tmp_path), '--tag', 'x', '--data-dir', synthetic_cifar10])


class _SignOfRedMinusGreen(torch.nn.Module):
    """Of 10 classes, class 0 where the mean red minus green is positive, else class 1 (a tie of zeros), through
    weights of magnitude 1e5: beyond float16's range (65504), well inside bfloat16's."""

    def __init__(self):
        super().__init__()
        self.pretrained_cfg = dict(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
        self.fc = torch.nn.Linear(3, 10, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[0, :2] = torch.tensor([1e5, -1e5])

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


def test_storage_dtype_is_chosen_by_measurement(synthetic_cifar10):
    from timm_attnconv.data import load_cifar10
    from timm_attnconv.evaluate import predict_logits
    from timm_attnconv.stage import choose_storage_dtype, round_weights
    images, labels = load_cifar10(synthetic_cifar10, 'test')
    images, labels = images[:64], labels[:64]
    model = _SignOfRedMinusGreen()
    logits = predict_logits(model, images, progress=False)
    storage, shipped_logits = choose_storage_dtype(model, logits, images, labels)
    float16, bfloat16 = storage['rounded']
    assert torch.equal(shipped_logits, predict_logits(round_weights(model, torch.bfloat16), images, progress=False))
    assert storage['dtype'] == 'bfloat16' and bfloat16['agreement'] == 1 and bfloat16['acceptable']
    assert float16['dtype'] == 'float16' and not float16['acceptable'] and float16['agreement'] < 0.999
    kept, kept_logits = choose_storage_dtype(model, logits, images, labels, 'float32')
    assert kept == dict(dtype='float32', float32_top1=storage['float32_top1'], images=64, rounded=[])
    assert kept_logits is logits


def test_the_card_says_what_a_warm_start_started_from():
    assert warm_start_sentence('sa_learned_tiny_cifar', None) == ''
    same_arch = warm_start_sentence('sa_learned_tiny_cifar', 'sa_learned_tiny_cifar.c10_18ep')
    assert 'fresh optimizer' in same_arch and 'content' not in same_arch
    content = warm_start_sentence('sa_learned_content_tiny_cifar', 'sa_learned_tiny_cifar.c10_18ep')
    assert 'content term initialised near zero' in content
    twin = warm_start_sentence('ea_sa_learned_content_tiny_cifar', 'sa_learned_content_tiny_cifar.c10')
    assert 'freshly initialised evolution convolutions' in twin and 'content' not in twin.split('`')[2]
    pruned = warm_start_sentence('sa_quadratic_gen_pruned_cifar', '/tmp/runs/pruned.safetensors')
    assert '`/tmp/runs/pruned.safetensors`' in pruned and '`pruned.safetensors`' in pruned
    # the paper fine-tuned its pruned model too; another model's warm start is a departure from its paper
    assert 'as the paper did: it fine-tuned the trained generalized model with its degenerate heads pruned' in pruned
    assert 'not trained from scratch as in the paper' in same_arch and 'as the paper did' not in same_arch
    written = warm_start_sentence('sa_quadratic_gen_pruned_cifar', '/tmp/runs/pruned.safetensors', 'prune.py ...')
    assert 'which the first command under Training writes' in written


@pytest.mark.parametrize('arch, attention, expected', [
    ('sa_learned_content_tiny_cifar', True, 'attention-only network'),
    ('ea_sa_learned_content_tiny_cifar', True, 'attention-only network'),
    ('aa_resnet20_cifar', True, 'convolutional network with attention'),
    ('attnconv_resnet20_cifar', False, 'convolutional network (baseline)'),
])
def test_the_card_names_the_kind_of_network(arch, attention, expected):
    assert model_type(arch, attention) == expected


@pytest.mark.parametrize('arch, expected', [
    ('sa_quadratic_cifar', 93.8), ('sa_quadratic_tiny_cifar', 93.8), ('sa_quadratic_gen_cifar', 93.4),
    ('sa_quadratic_gen_pruned_cifar', 93.4), ('sa_quadratic_16h_cifar', None), ('sa_learned_cifar', 91.8),
    ('sa_learned_content_tiny_cifar', 87.1), ('aa_resnet20_cifar', None)])
def test_each_card_compares_with_its_own_row_of_table_1(arch, expected):
    row = paper_top1(arch)
    assert (row and row[1]) == expected
