"""A training run leaves a GPU machine in parts small enough for its calls and comes back as a run folder that
``stage`` reads, with the weights byte for byte as exported."""
import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save

from timm_attnconv.runs import read_checkpoint
from timm_attnconv.stage import _read_run
from timm_attnconv.train import main as train_main
from timm_attnconv.transfer import export, join, main as transfer_main

from .test_train import TINY, assert_same_run, strict_log

# every run here trains on the synthetic CIFAR-10 as the default data folder: TINY names none
pytestmark = pytest.mark.usefixtures('synthetic_cifar10_as_default')


@pytest.fixture(scope='module')
def run(tmp_path_factory, synthetic_cifar10_as_default):
    folder = tmp_path_factory.mktemp('run')
    train_main(TINY + ['--output', str(folder), '--epochs', '1'])
    return folder


def export_calls(run, tmp_path, **limits):
    """Export the run call by call, as the device tool returns them, into one folder per call."""
    calls, start = [], 0
    while start is not None:
        out = tmp_path / f'call{len(calls)}' / 'run'
        start = export(str(run), str(out), start, **limits)['next']
        calls.append(out)
    return calls


def test_a_run_exported_in_parts_joins_into_a_folder_stage_reads(run, tmp_path):
    # parts of 4 KiB, at most 5 files and 20,000 bytes a call: the tiny run needs several calls
    calls = export_calls(run, tmp_path, part_bytes=4096, max_files=5, max_bytes=20_000)
    assert len(calls) > 2
    for out in calls:
        files = list(out.iterdir())
        assert len(files) <= 5 and sum(f.stat().st_size for f in files) <= 20_000
        assert all(f.stat().st_size <= 4096 for f in files if '.part' in f.name)
    with pytest.raises(FileNotFoundError, match=r'parts missing .*: ema\.safetensors\.part'):
        join(str(tmp_path / 'joined'), [str(c) for c in calls[:-1]])
    digests = join(str(tmp_path / 'joined'), [str(c) for c in calls])

    state = read_checkpoint(str(run / 'last.pth.tar'))
    joined = _read_run(str(tmp_path / 'joined'))  # what `python -m timm_attnconv.stage` reads
    assert joined['config'] == json.loads(json.dumps(state['config'])) and joined['log'] == state['log']
    assert joined['epochs_done'] == 1 and not joined['resumable']
    for key in ('model', 'ema'):
        weights = {k.removeprefix('module.'): v for k, v in state[key].items()}
        assert joined[key].keys() == weights.keys()
        assert all(torch.equal(joined[key][k], v) and joined[key][k].dtype == torch.float32 for k, v in weights.items())
        # byte for byte the float32 safetensors file of the checkpoint's weights
        data = (tmp_path / 'joined' / f'{key}.safetensors').read_bytes()
        assert data == save(weights) and digests[f'{key}.safetensors'] == hashlib.sha256(data).hexdigest()


def test_the_ema_alone_takes_half_the_parts_and_joins_into_a_folder_stage_reads(run, tmp_path):
    both = export_calls(run, tmp_path / 'both', part_bytes=4096)
    ema = export_calls(run, tmp_path / 'ema', part_bytes=4096, weights='ema')
    count = lambda calls: sum(1 for call in calls for f in call.iterdir() if '.part' in f.name)
    assert count(both) == 2 * count(ema) and all('ema.safetensors.part' in f.name
                                                  for call in ema for f in call.iterdir() if '.part' in f.name)
    join(str(tmp_path / 'joined'), [str(c) for c in ema])
    assert sorted(os.listdir(tmp_path / 'joined')) == ['config.json', 'ema.safetensors', 'log.jsonl', 'manifest.json']
    joined, state = _read_run(str(tmp_path / 'joined')), read_checkpoint(str(run / 'last.pth.tar'))
    assert joined['model'] is None and all(torch.equal(joined['ema'][k.removeprefix('module.')], v)
                                           for k, v in state['ema'].items())
    with pytest.raises(ValueError, match='the manifests .* differ: .* or from exports of different --weights'):
        join(str(tmp_path / 'mixed'), [str(both[0]), str(ema[0])])


def test_damaged_or_mixed_parts_are_refused(run, tmp_path):
    calls = export_calls(run, tmp_path, part_bytes=4096, max_files=5, max_bytes=20_000)
    part = next(calls[0].glob('*.part00'))
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"'{part}' does not match the sha256 in manifest.json: it was damaged"):
        join(str(tmp_path / 'joined'), [str(c) for c in calls])
    manifest = json.loads((calls[1] / 'manifest.json').read_text())
    manifest['epoch'] += 1  # the run went on between two calls
    (calls[1] / 'manifest.json').write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match='the manifests .* differ: the parts come from different checkpoints'):
        join(str(tmp_path / 'joined'), [str(c) for c in calls])
    assert not (tmp_path / 'joined').exists()
    whole = export_calls(run, tmp_path / 'again')  # intact parts, but the run config lost on the way
    for call in whole:
        (call / 'config.json').unlink()
    with pytest.raises(FileNotFoundError, match=r'no config\.json in .*: every export call writes one'):
        join(str(tmp_path / 'joined'), [str(c) for c in whole])
    assert not (tmp_path / 'joined').exists()


def test_collect_and_join_commands_and_a_fine_tune_from_the_joined_weights(run, tmp_path, capsys):
    # the tiny run fits one call of the device tool: one export writes every part
    transfer_main(['export', str(run), str(tmp_path / 'out' / 'run')])
    assert 'every part is out' in capsys.readouterr().out
    transfer_main(['join', str(tmp_path / 'joined'), str(tmp_path / 'out' / 'run')])
    assert sorted(os.listdir(tmp_path / 'joined')) == [
        'config.json', 'ema.safetensors', 'log.jsonl', 'manifest.json', 'model.safetensors']
    # --init-from a weights file (pruned weights start their fine-tune so); at lr 0 the step keeps them
    weights = str(tmp_path / 'joined' / 'model.safetensors')
    train_main(TINY + ['--output', str(tmp_path / 'tune'), '--init-from', weights, '--lr', '0', '--warmup-epochs',
                       '0', '--max-steps', '1'])
    tuned = torch.load(tmp_path / 'tune' / 'last.pth.tar', weights_only=True)
    assert tuned['config']['init_from'] == weights
    source = read_checkpoint(str(run / 'last.pth.tar'))['model']
    assert all(torch.equal(tuned['model'][k], v) for k, v in source.items())


def test_weights_taken_mid_epoch_are_staged_as_taken_and_an_older_checkpoint_exports_its_log(tmp_path):
    # a run stopped 1 step into its second epoch (3 steps an epoch): its weights come back as 1⅓ epochs, not 1
    stopped = tmp_path / 'stopped'
    train_main(TINY + ['--output', str(stopped), '--max-steps', '4'])
    join(str(tmp_path / 'joined'), [str(c) for c in export_calls(stopped, tmp_path / 'weights')])
    assert _read_run(str(tmp_path / 'joined'))['epochs_done'] == pytest.approx(1 + 1 / 3)
    # a checkpoint from before checkpoints carried their log (and a digest): its log.jsonl goes with the weights
    state = read_checkpoint(str(stopped / 'last.pth.tar'))
    older = tmp_path / 'older'
    older.mkdir()
    torch.save({k: v for k, v in state.items() if k not in ('log', 'sha256')}, older / 'last.pth.tar')
    (older / 'log.jsonl').write_text((stopped / 'log.jsonl').read_text())
    with pytest.warns(UserWarning, match='before training checkpoints carried a sha256 digest'):
        calls = export_calls(older, tmp_path / 'older_weights')
    assert [json.loads(line) for line in (calls[0] / 'log.jsonl').read_text().splitlines()] == state['log']


def test_a_checkpoint_exported_in_parts_resumes_exactly_where_it_was_joined(tmp_path):
    # a run stopped mid-epoch on one machine goes on from the joined checkpoint on another and ends as a run that
    # was never stopped
    whole, stopped, resumed = tmp_path / 'whole', tmp_path / 'stopped', tmp_path / 'resumed'
    train_main(TINY + ['--output', str(whole)])
    train_main(TINY + ['--output', str(stopped), '--max-steps', '4'])
    calls = export_calls(stopped, tmp_path, part_bytes=16_384, checkpoint=True)
    parts = [f.name for call in calls for f in call.glob('*.part*')]
    assert len(calls) == 2 and len(parts) > 5 and all(name.startswith('last.pth.tar.part') for name in parts)
    digests = join(str(resumed), [str(c) for c in calls])
    data = (resumed / 'last.pth.tar').read_bytes()
    assert data == (stopped / 'last.pth.tar').read_bytes() and digests == {
        'last.pth.tar': hashlib.sha256(data).hexdigest()}
    assert _read_run(str(resumed))['resumable']  # stage reads it as the run it is, 1 step into epoch 2
    train_main(TINY + ['--output', str(resumed)])
    assert_same_run(whole, resumed)
    assert strict_log(resumed) == strict_log(whole)
    with pytest.raises(ValueError, match='--checkpoint exports the whole training state, .*: drop --weights ema'):
        export(str(stopped), str(tmp_path / 'bad'), weights='ema', checkpoint=True)
    # the finished run's weights joined over the checkpoint an earlier session brought back: stage would read the
    # stale checkpoint, so join refuses; the finished checkpoint replaces it
    weights = export_calls(resumed, tmp_path / 'weights', weights='ema')
    with pytest.raises(ValueError, match='holds a training checkpoint .* join them into another folder'):
        join(str(stopped), [str(c) for c in weights])
    join(str(stopped), [str(c) for c in export_calls(resumed, tmp_path / 'final', checkpoint=True)])
    assert_same_run(whole, stopped)
