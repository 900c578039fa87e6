"""Staging a training run as a Hub-layout weights folder with a recorded sha256."""
import json

import pytest
import timm
import torch
from safetensors.torch import load_file

from timm_attnconv.pretrained import sha256_file
from timm_attnconv.stage import main as stage_main, training_command
from timm_attnconv.train import main as train_main

from .test_data import DATA_DIR, needs_data
from .test_train import TINY


@needs_data
def test_stage_writes_a_hub_folder_and_records_its_digest(tmp_path):
    run = tmp_path / 'run'
    train_main(TINY + ['--output', str(run), '--epochs', '1'])
    result = stage_main([str(run), '--tag', 'test', '--out', str(tmp_path / 'weights'), '--data-dir', DATA_DIR,
                         '--limit', '64', '--record', str(tmp_path / 'sha.json')])
    folder = tmp_path / 'weights' / 'sa_quadratic_cifar.test'
    assert sorted(p.name for p in folder.iterdir()) == [
        'README.md', 'config.json', 'model.safetensors', 'training_curves.png', 'training_log.jsonl']
    digest = sha256_file(folder / 'model.safetensors')
    assert json.loads((tmp_path / 'sha.json').read_text()) == {'timm-attnconv/sa_quadratic_cifar.test': digest}
    assert result['sha256'] == digest and result['images'] == 64
    state = torch.load(run / 'last.pth.tar', weights_only=True)
    shipped = load_file(folder / 'model.safetensors')
    chosen = state['ema'] if result['weights'] == 'EMA weights' else state['model']
    assert all(torch.equal(shipped[k], chosen[k.removeprefix('module.')] if k in chosen else chosen['module.' + k])
               for k in shipped)
    card = (folder / 'README.md').read_text()
    assert 'library_name: timm' in card and f"value: {round(result['top1'], 2)}" in card
    assert 'Conv-likeness of the heads' in card and '| blocks.1.attn |' in card
    assert training_command(state['config'], str(run)) in card
    model = timm.create_model(f'local-dir:{folder}', pretrained=True)  # timm loads the folder as written
    assert model.num_classes == 10


def test_stage_needs_a_training_run(tmp_path):
    with pytest.raises(FileNotFoundError, match='no training checkpoint'):
        stage_main([str(tmp_path), '--tag', 'x'])
