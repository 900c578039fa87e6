"""The launcher runs a script that only knows timm as ``python script.py`` would."""
import sys

import pytest

from timm_attnconv import run

SCRIPT = '''
import sys
import timm
import helper_module  # found beside the script, as with `python script.py`

assert __name__ == '__main__'
model = timm.create_model(sys.argv[1], num_classes=3)
print('created', sys.argv[1], sum(p.numel() for p in model.parameters()), helper_module.VALUE)
sys.exit(int(sys.argv[2]))
'''


def test_launcher_runs_an_unmodified_script(tmp_path, capsys, monkeypatch):
    (tmp_path / 'script.py').write_text(SCRIPT)
    (tmp_path / 'helper_module.py').write_text('VALUE = 42\n')
    monkeypatch.setattr(sys, 'argv', list(sys.argv))
    monkeypatch.setattr(sys, 'path', list(sys.path))
    try:
        with pytest.raises(SystemExit) as exit_info:
            run.main([str(tmp_path / 'script.py'), 'sa_quadratic_tiny_cifar', '7'])
    finally:
        sys.modules.pop('helper_module', None)  # the script's import, which no later test should find
    assert exit_info.value.code == 7
    assert 'created sa_quadratic_tiny_cifar' in capsys.readouterr().out


def test_launcher_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main([str(tmp_path / 'missing.py')])
    assert exit_info.value.code == 2 and 'no such script' in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run.main([])
    assert exit_info.value.code == 2
