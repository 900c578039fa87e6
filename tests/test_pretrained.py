"""Pretrained weights: bundled folders, sha256 checks, clear refusals, and the real Hub download path on loopback."""
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import timm
import torch
from safetensors.torch import load_file

import timm_attnconv
from timm_attnconv.pretrained import HF_ORG, WEIGHTS_FILE, bundled_weights_dir, folder_digests, recorded_sha256

from .hub_server import HubServer

WEIGHTS = Path(__file__).resolve().parent.parent / 'weights'
PRETRAINED = timm_attnconv.list_models(pretrained=True)  # 'arch.tag' names
# read from the registry: staging weights for a model must not break the test of a model without them
WITHOUT_WEIGHTS = sorted(set(timm_attnconv.list_models()) - {name.split('.')[0] for name in PRETRAINED})
TAMPERED_REVISION = 'b' * 40
TAMPERED_CONFIG_REVISION = 'c' * 40
OTHER_ARCH_REVISION = 'd' * 40


def test_every_pretrained_cfg_has_a_bundled_folder_and_a_recorded_sha256():
    tags = PRETRAINED
    assert tags, 'no model has pretrained weights'
    assert all('.' in name for name in tags)
    records = recorded_sha256()
    for name in tags:
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg.hf_hub_id == f'{HF_ORG}/{name}'
        folder = WEIGHTS / name
        for filename in ('config.json', WEIGHTS_FILE, 'README.md', 'training_log.jsonl', 'training_curves.png'):
            assert (folder / filename).is_file(), f'{folder / filename} missing'
        assert records[cfg.hf_hub_id] == folder_digests(folder)  # every file, config and card included
        assert json.loads((folder / 'config.json').read_text())['architecture'] == name.split('.')[0]
    assert sorted(records) == sorted(f'{HF_ORG}/{n}' for n in tags), 'a recorded file has no registered cfg'


def test_each_config_carries_the_cfg_registered_for_its_tag():
    # a hf-hub: load takes its pretrained cfg from config.json: a tag staged before it was registered carried its
    # arch's default cfg there, the default tag's notes among them
    stale = []
    for name in PRETRAINED:
        written = json.loads((WEIGHTS / name / 'config.json').read_text())['pretrained_cfg']
        registered = timm.models.get_pretrained_cfg(name)
        if written.get('tag') != registered.tag or written.get('notes') != list(registered.notes or ()):
            stale.append(f'weights/{name}')
    assert not stale, f'run `python -m timm_attnconv.stage --refresh-config {" ".join(stale)}`'


def _table_rows(markdown: str, header: str) -> Dict[str, List[str]]:
    # {arch.tag: cells after the first} of the markdown table whose header row starts with `header`
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in itertools.takewhile(lambda text: text.startswith('|'), lines[start + 2:]):
        cells = [cell.strip() for cell in line.strip('|').split('|')]
        rows[re.search(r'`(\w+\.\w+)`', cells[0]).group(1)] = cells[1:]
    return rows


def test_readme_tables_show_the_accuracy_each_card_measured():
    # the top-1 and top-5 that stage measured on the test set and wrote into each card's model-index
    measured = {name: [float(v) for v in re.findall(r'value: ([0-9.]+)', (WEIGHTS / name / 'README.md').read_text())]
                for name in PRETRAINED}
    readme = _table_rows((WEIGHTS.parent / 'README.md').read_text(), '| weights | CIFAR-10 test top-1 | top-5 |')
    folders = _table_rows((WEIGHTS / 'README.md').read_text(), '| folder | CIFAR-10 test top-1 |')
    assert sorted(readme) == sorted(folders) == sorted(PRETRAINED)

    def percent(cell):
        return float(cell.strip('*%'))
    for name in PRETRAINED:
        assert [percent(readme[name][0]), percent(readme[name][1])] == measured[name][:2], f'README.md, {name}'
        assert percent(folders[name][0]) == measured[name][0], f'weights/README.md, {name}'


@pytest.mark.parametrize('name', PRETRAINED)
def test_pretrained_loads_the_bundled_file(name):
    model = timm.create_model(name, pretrained=True)
    shipped = load_file(WEIGHTS / name / WEIGHTS_FILE)
    stored_dtype = json.loads((WEIGHTS / name / 'config.json').read_text()).get('weights_dtype', 'float32')
    assert {str(v.dtype) for v in shipped.values() if v.is_floating_point()} == {f'torch.{stored_dtype}'}
    state = model.state_dict()
    assert state.keys() == shipped.keys()
    # half-precision files load into the float32 model, value for value
    assert all(torch.equal(state[k], shipped[k].to(state[k].dtype)) for k in shipped)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize('name', PRETRAINED)
def test_model_card_has_hub_metadata_and_the_recorded_digest(name):
    card = (WEIGHTS / name / 'README.md').read_text()
    front, body = card.split('---\n')[1:3]
    assert 'library_name: timm' in front and '- timm_attnconv' in front and '- cifar10' in front
    assert 'model-index:' in front and 'name: top-1 accuracy' in front
    assert recorded_sha256()[f'{HF_ORG}/{name}'][WEIGHTS_FILE] in body
    assert 'python -m timm_attnconv.train' in body and 'training_curves.png' in body


def test_a_name_without_weights_says_so_and_lists_alternatives():
    assert WITHOUT_WEIGHTS, 'every model has weights: this test needs a new subject'
    with pytest.raises(RuntimeError, match='no pretrained weights yet') as info:
        timm.create_model(WITHOUT_WEIGHTS[0], pretrained=True)
    assert all(name in str(info.value) for name in PRETRAINED)


def _tampered_copy(tmp_path: Path, name: str, mutate, filename: str = WEIGHTS_FILE, label: str = 'weights') -> Path:
    folder = tmp_path / label
    shutil.copytree(WEIGHTS / name, folder / name)
    mutate(folder / name / filename)
    return folder


def _edit_config(**changes):
    def edit(path: Path) -> None:
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if key in ('mean', 'std', 'label_names'):
                config['pretrained_cfg'][key] = value
            config[key] = value
        path.write_text(json.dumps(config, indent=2))
    return edit


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


@pytest.mark.parametrize('name', ['attnconv_resnet20_cifar.c10_2ep', 'sa_quadratic_cifar.c10'])  # fp32, fp16
@pytest.mark.parametrize('mutate', [_flip_a_byte, _truncate], ids=['tampered', 'truncated'])
def test_a_changed_weights_file_is_refused_before_loading(tmp_path, monkeypatch, mutate, name):
    monkeypatch.setenv('TIMM_ATTNCONV_WEIGHTS_DIR', str(_tampered_copy(tmp_path, name, mutate)))
    with pytest.raises(ValueError, match='sha256.*truncated, corrupt'):
        timm.create_model(name, pretrained=True)


def test_weights_dir_override_and_hub_only_mode(tmp_path, monkeypatch):
    monkeypatch.setenv('TIMM_ATTNCONV_WEIGHTS_DIR', str(tmp_path))
    assert bundled_weights_dir() == tmp_path
    monkeypatch.setenv('TIMM_ATTNCONV_WEIGHTS_DIR', '')
    assert bundled_weights_dir() is None
    # hub-only with HF_HUB_OFFLINE (conftest) and an empty cache: a clear error, not random weights
    monkeypatch.setenv('HF_HUB_CACHE', str(tmp_path))
    with pytest.raises(RuntimeError, match='could not get model.safetensors'):
        timm.create_model(PRETRAINED[0].split('.')[0], pretrained=True)


def _hub_client(env, *args):
    """The JSON line of ``hub_client.py ARGS`` in a fresh interpreter with ``env``."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name('hub_client.py')), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hub_download_path_on_a_loopback_endpoint(tmp_path):
    """The real ``huggingface_hub`` download code, in a fresh interpreter pointed at a loopback Hub."""
    name = 'sa_quadratic_cifar.c10'  # the headline: paper-size, stored in float16
    labels = json.loads((WEIGHTS / name / 'config.json').read_text())['label_names']
    revisions = {
        'main': WEIGHTS,
        TAMPERED_REVISION: _tampered_copy(tmp_path, name, _flip_a_byte),
        # reversed labels and another normalisation: would load and mislabel every image
        TAMPERED_CONFIG_REVISION: _tampered_copy(tmp_path, name, _edit_config(
            label_names=labels[::-1], mean=[0.5] * 3, std=[0.5] * 3), 'config.json', 'relabelled'),
        OTHER_ARCH_REVISION: _tampered_copy(tmp_path, name, _edit_config(architecture='attnconv_resnet20_cifar'),
                                            'config.json', 'other_arch'),
    }
    uncached = next(other for other in PRETRAINED if other.split('.')[0] != name.split('.')[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith('HF_')}
    with HubServer(HF_ORG, revisions) as hub:
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / 'cache'), HF_HUB_DISABLE_XET='1',
                   HF_HUB_DISABLE_TELEMETRY='1', HF_HUB_DISABLE_PROGRESS_BARS='1', HF_HUB_ETAG_TIMEOUT='5',
                   TIMM_ATTNCONV_WEIGHTS_DIR='', PYTHONPATH=os.pathsep.join([str(WEIGHTS.parent)] + sys.path))
        result = _hub_client(env, 'online', name, str(WEIGHTS / name / WEIGHTS_FILE), TAMPERED_REVISION,
                             TAMPERED_CONFIG_REVISION, OTHER_ARCH_REVISION)
        requests = list(hub.requests)
        # a second interpreter with the cache the first one filled, offline the way a user sets it: at import
        offline = _hub_client(dict(env, HF_HUB_OFFLINE='1'), 'offline', name, str(WEIGHTS / name / WEIGHTS_FILE),
                              uncached)
        assert hub.requests == requests, 'HF_HUB_OFFLINE=1 and still a request reached the Hub'
    assert result['registry'] == 0 and result['hf_hub'] == 0, result
    assert result['tampered'].startswith('ValueError') and 'sha256' in result['tampered']
    assert result['tampered_config'].startswith('ValueError') and 'config.json' in result['tampered_config']
    assert 'sha256' in result['tampered_config']
    assert result['other_arch'].startswith('ValueError') and "names architecture 'attnconv_resnet20_cifar'" in \
        result['other_arch'] and 'config.json' in result['other_arch']
    assert offline['cached'] == 0, offline
    assert offline['uncached'].startswith('RuntimeError') and 'HF_HUB_OFFLINE' in offline['uncached'], offline
    resolve = f'/{HF_ORG}/{name}/resolve/'
    assert ('GET', f'{resolve}main/{WEIGHTS_FILE}') in requests
    assert ('GET', f'{resolve}main/config.json') in requests  # the hf-hub: form reads config.json first
    assert ('GET', f'{resolve}{TAMPERED_REVISION}/{WEIGHTS_FILE}') in requests


def test_publish_checks_everything_up_to_the_upload_call(tmp_path, monkeypatch):
    from huggingface_hub import HfApi
    from timm_attnconv import publish

    name = PRETRAINED[0]
    folder = str(WEIGHTS / name)
    plan, = publish.publish([folder], dry_run=True)
    assert plan['repo_id'] == f'{HF_ORG}/{name}' and WEIGHTS_FILE in plan['files']

    monkeypatch.setenv('HF_HOME', str(tmp_path))  # no stored token
    monkeypatch.delenv('HF_TOKEN', raising=False)
    monkeypatch.setattr('huggingface_hub.get_token', lambda: None)
    with pytest.raises(RuntimeError, match='no Hugging Face token'):
        publish.publish([folder])

    calls = []
    monkeypatch.setattr('huggingface_hub.get_token', lambda: 'hf_test')
    monkeypatch.setattr(HfApi, 'create_repo', lambda self, repo_id, **kw: calls.append(('create', repo_id, kw)))
    monkeypatch.setattr(HfApi, 'upload_folder', lambda self, **kw: calls.append(('upload', kw)) or 'commit-url')
    plan, = publish.publish([folder])
    assert calls[0] == ('create', f'{HF_ORG}/{name}', dict(exist_ok=True, private=False))
    assert calls[1][1]['folder_path'] == folder and calls[1][1]['repo_id'] == f'{HF_ORG}/{name}'
    # --private makes a repo that already exists private too: create_repo alone leaves it public
    monkeypatch.setattr(HfApi, 'update_repo_settings', lambda self, repo_id, **kw: calls.append(('settings', kw)))
    calls.clear()
    publish.publish([folder], private=True)
    assert [c[0] for c in calls] == ['create', 'settings', 'upload'] and calls[1][1] == dict(private=True)

    with pytest.raises(ValueError, match='sha256'):
        publish.publish([str(_tampered_copy(tmp_path, name, _flip_a_byte) / name)], dry_run=True)


def test_weights_of_our_organisation_without_a_record_are_refused(tmp_path, monkeypatch):
    from timm_attnconv import pretrained
    record = tmp_path / 'record.json'
    record.write_text('{}')
    monkeypatch.setattr(pretrained, 'SHA256_RECORD', record)
    with pytest.raises(ValueError, match='no sha256 record'):
        timm.create_model(PRETRAINED[0].split('.')[0], pretrained=True)
    record.write_text('{"not json')
    with pytest.raises(ValueError, match='not valid JSON'):
        timm.create_model(PRETRAINED[0].split('.')[0], pretrained=True)


def test_a_weights_dir_that_does_not_exist_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv('TIMM_ATTNCONV_WEIGHTS_DIR', str(tmp_path / 'nope'))
    with pytest.raises(FileNotFoundError, match='is not a folder'):
        timm.create_model(PRETRAINED[0].split('.')[0], pretrained=True)
