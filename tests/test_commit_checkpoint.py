"""training/commit_checkpoint.sh in a scratch repository: the checkpoint of a training run is committed and taken out
of the tree again, the session's own index and work tree untouched; --final adds the log and the restore line."""
import os
import subprocess

import torch

from timm_attnconv.runs import read_checkpoint, save_checkpoint

SCRIPT = os.path.join(os.path.dirname(__file__), '..', 'training', 'commit_checkpoint.sh')
RUN = 'training/net_cpu'
OLD_RESTORE = f'git show 1234567:{RUN}/last.pth.tar > {RUN}/last.pth.tar  # 1 epochs + 0 steps of 3'
OTHER_RESTORE = f'git show 7654321:{RUN}_seed1/last.pth.tar > {RUN}_seed1/last.pth.tar  # finished'
GIT_ENV = dict(GIT_AUTHOR_NAME='t', GIT_AUTHOR_EMAIL='t@t', GIT_COMMITTER_NAME='t', GIT_COMMITTER_EMAIL='t@t')


def _git(repo, *args):
    return subprocess.run(['git', *args], cwd=repo, env=dict(os.environ, **GIT_ENV), capture_output=True, text=True,
                          check=True).stdout


def _checkpoint(repo, epoch, step):
    log = [dict(epoch=e, train_loss=1. / e) for e in range(1, epoch + 1)]
    save_checkpoint(str(repo / RUN), dict(config=dict(epochs=3), epoch=epoch, step_in_epoch=step, log=log,
                                          model=dict(weight=torch.full((2,), float(epoch)))))


def _commit_checkpoint(repo, *args):
    return subprocess.run(['bash', os.path.abspath(SCRIPT), RUN, *args], cwd=repo, env=dict(os.environ, **GIT_ENV),
                          capture_output=True, text=True, timeout=120)


def _scratch_repo(tmp_path):
    repo = tmp_path / 'repo'
    (repo / RUN).mkdir(parents=True)
    (repo / '.gitignore').write_text('last.pth.tar\n')
    (repo / 'training' / 'README.md').write_text(f'# runs\n\n{OTHER_RESTORE}\n{OLD_RESTORE}\n')
    (repo / 'notes.txt').write_text('one\n')
    _checkpoint(repo, 1, 0)
    (repo / RUN / 'log.jsonl').write_text('')
    _git(repo, 'init', '-q')
    _git(repo, 'add', '-A')
    _git(repo, 'commit', '-qm', 'start')
    return repo


def test_a_pair_of_commits_keeps_the_checkpoint_in_history_and_leaves_the_session_as_it_was(tmp_path):
    repo = _scratch_repo(tmp_path)
    _checkpoint(repo, 2, 5)
    (repo / 'notes.txt').write_text('two\n')
    _git(repo, 'add', 'notes.txt')  # the session's staged change
    (repo / 'notes.txt').write_text('three\n')  # and its unstaged one
    status = _git(repo, 'status', '--porcelain')
    done = _commit_checkpoint(repo)
    assert done.returncode == 0, done.stderr
    assert '2 epochs + 5 steps of 3' in done.stdout
    kept, out = _git(repo, 'rev-parse', 'HEAD~1', 'HEAD').split()
    assert _git(repo, 'log', '-1', '--format=%s', out) == f'{RUN}: 2 epochs + 5 steps of 3; checkpoint out of the ' \
                                                          f'tree (restore from {kept[:7]})\n'
    blob = subprocess.run(['git', 'show', f'{kept}:{RUN}/last.pth.tar'], cwd=repo, capture_output=True, check=True)
    assert blob.stdout == (repo / RUN / 'last.pth.tar').read_bytes()
    assert f'{RUN}/last.pth.tar' not in _git(repo, 'ls-tree', '-r', '--name-only', out)
    assert _git(repo, 'diff', '--name-only', 'HEAD~2', out) == ''  # the pair changes nothing else
    assert _git(repo, 'status', '--porcelain') == status
    assert _git(repo, 'diff', '--cached', '--name-only') == 'notes.txt\n'


def test_final_commits_the_log_and_points_the_runs_restore_line_at_the_checkpoint(tmp_path):
    repo = _scratch_repo(tmp_path)
    _checkpoint(repo, 3, 0)
    (repo / RUN / 'log.jsonl').write_text('{"epoch": 1}\n')  # behind the checkpoint, as after a kill between the two
    readme = repo / 'training' / 'README.md'
    readme.write_text(readme.read_text() + 'an edit of the session\n')
    done = _commit_checkpoint(repo, '--final')
    assert done.returncode == 0, done.stderr
    kept = _git(repo, 'rev-parse', '--short=7', 'HEAD~1').strip()
    restore = f'git show {kept}:{RUN}/last.pth.tar > {RUN}/last.pth.tar  # 3 epochs + 0 steps of 3'
    assert _git(repo, 'show', 'HEAD:training/README.md') == f'# runs\n\n{OTHER_RESTORE}\n{restore}\n'
    assert readme.read_text() == f'# runs\n\n{OTHER_RESTORE}\n{restore}\nan edit of the session\n'
    logged = _git(repo, 'show', f'HEAD:{RUN}/log.jsonl')
    assert logged == (repo / RUN / 'log.jsonl').read_text() and len(logged.splitlines()) == 3
    assert read_checkpoint(str(repo / RUN / 'last.pth.tar'))['epoch'] == 3
    assert _git(repo, 'status', '--porcelain') == ' M training/README.md\n'  # the session's edit only


def test_no_checkpoint_or_a_wrong_option_commits_nothing(tmp_path):
    repo = _scratch_repo(tmp_path)
    head = _git(repo, 'rev-parse', 'HEAD')
    assert _commit_checkpoint(repo, '--every', '60').returncode == 2
    os.remove(repo / RUN / 'last.pth.tar')
    done = _commit_checkpoint(repo)
    assert done.returncode == 1 and 'no checkpoint' in done.stderr
    assert _git(repo, 'rev-parse', 'HEAD') == head
