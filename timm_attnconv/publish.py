"""Upload staged ``weights/<arch>.<tag>/`` folders to the Hugging Face Hub (needs a token and the network).

    hf auth login            # or export HF_TOKEN=... (huggingface_hub < 0.34: huggingface-cli login)
    python -m timm_attnconv.publish weights/sa_quadratic_tiny_cifar.c10 [--dry-run]

Before anything is sent, each folder is checked: the Hub-layout files are present, every file has the sha256
recorded when it was staged, and the folder loads with ``timm.create_model('local-dir:<folder>', pretrained=True)``.
The repo id is ``<HF_ORG>/<folder name>`` unless ``--repo-id`` says otherwise.
"""
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import cli
from .constants import CONFIG_FILE, WEIGHTS_FILE
from .pretrained import HF_ORG, folder_digests, hub_id, recorded_sha256

__all__ = ['check_folder', 'publish', 'main']

REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, 'README.md')


def check_folder(folder: Path, repo_id: str) -> Dict[str, Any]:
    """Everything that can be checked offline; raises with the reason and the fix."""
    import timm
    import timm_attnconv  # noqa: F401  (the architecture must be registered to load the folder)

    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f'{folder} lacks {", ".join(missing)}: stage it with `python -m timm_attnconv.stage`')
    expected = recorded_sha256().get(hub_id(folder.name), {})
    actual = folder_digests(folder)
    changed = sorted(name for name in set(expected) | set(actual) if expected.get(name) != actual.get(name))
    if changed:
        raise ValueError(f'{folder}: {", ".join(changed)} differ from the sha256 record (or are missing from it or '
                         f'the folder): re-stage the folder (which updates the record) instead of editing it by hand')
    architecture = json.loads((folder / CONFIG_FILE).read_text())['architecture']
    if architecture != folder.name.split('.')[0]:
        raise ValueError(f'{folder}/{CONFIG_FILE} names architecture {architecture!r}, not the folder\'s')
    timm.create_model(f'local-dir:{folder}', pretrained=True)
    return dict(repo_id=repo_id, folder=str(folder), sha256=actual[WEIGHTS_FILE], files=sorted(actual))


def publish(folders: Sequence[str], repo_id: Optional[str] = None, dry_run: bool = False,
            private: bool = False) -> List[Dict[str, Any]]:
    from huggingface_hub import HfApi, get_token

    if repo_id and len(folders) != 1:
        raise cli.UsageError('--repo-id names one repo: pass a single folder with it')
    plans = [check_folder(Path(f), repo_id or hub_id(Path(f).name)) for f in folders]
    if dry_run:
        return plans
    if get_token() is None:
        raise RuntimeError('no Hugging Face token: run `hf auth login` (`huggingface-cli login` before '
                           f'huggingface_hub 0.34) or set HF_TOKEN (a token with write access to {HF_ORG}), then '
                           f'run this again')
    api = HfApi(library_name='timm')
    for plan in plans:
        api.create_repo(plan['repo_id'], exist_ok=True, private=private)
        if private:  # create_repo leaves a repo that exists as it is
            api.update_repo_settings(plan['repo_id'], private=True)
        commit = api.upload_folder(repo_id=plan['repo_id'], folder_path=plan['folder'],
                                   commit_message=f"timm_attnconv weights, sha256 {plan['sha256'][:12]}")
        plan['commit'] = str(commit)
    return plans


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    parser = cli.parser(__spec__.name, __doc__.split('\n\n')[0])
    parser.add_argument('folders', nargs='+', help='staged folders, e.g. weights/sa_quadratic_tiny_cifar.c10')
    parser.add_argument('--repo-id', default=None, help=f'target repo (default {HF_ORG}/<folder name>)')
    parser.add_argument('--private', action='store_true', help='create the repos private, or make them so')
    parser.add_argument('--dry-run', action='store_true', help='check the folders and print the plan; upload nothing')
    args = parser.parse_args(argv)
    plans = publish(args.folders, args.repo_id, args.dry_run, args.private)
    print(json.dumps(plans, indent=2))
    return plans


if __name__ == '__main__':
    cli.run(main)
