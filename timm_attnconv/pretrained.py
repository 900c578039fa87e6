"""Where pretrained weights come from, and the check that they are the files we measured.

Every weight file has a Hub repo ``<HF_ORG>/<arch>.<tag>`` (Hub layout: ``config.json``, ``model.safetensors``,
``README.md``). A clone of this repository carries the same folders in ``weights/<arch>.<tag>/``; those are used first,
so a fresh clone loads weights with no network. Otherwise ``huggingface_hub`` downloads them (honouring
``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``). Either way the file's sha256 must equal the one recorded in
``weights_sha256.json`` when it was staged; anything else is refused before a single tensor is loaded. The record
holds every file of a staged folder: a ``hf-hub:`` load, which takes its preprocessing, labels and architecture from
the repo's ``config.json``, has that file verified too. A repo of this package's organisation without a record is
refused, not trusted.

``TIMM_ATTNCONV_WEIGHTS_DIR`` overrides the bundled folder; set it to an empty string to always use the Hub.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from .constants import CONFIG_FILE, WEIGHTS_FILE

__all__ = ['HF_ORG', 'WEIGHTS_FILE', 'CONFIG_FILE', 'hub_id', 'bundled_weights_dir', 'recorded_sha256', 'sha256_file',
           'folder_digests', 'record_folder', 'verify_file', 'locate_weights', 'resolve_pretrained_kwargs',
           'SHA256_RECORD']

HF_ORG = 'timm-attnconv'
WEIGHTS_DIR_ENV = 'TIMM_ATTNCONV_WEIGHTS_DIR'
SHA256_RECORD = Path(__file__).with_name('weights_sha256.json')


def hub_id(arch_tag: str) -> str:
    """``'sa_quadratic_tiny_cifar.c10'`` → ``'timm-attnconv/sa_quadratic_tiny_cifar.c10'``."""
    return f'{HF_ORG}/{arch_tag}'


def bundled_weights_dir() -> Optional[Path]:
    """The ``weights/`` folder of a clone (or ``$TIMM_ATTNCONV_WEIGHTS_DIR``); None when there is none."""
    configured = os.environ.get(WEIGHTS_DIR_ENV)
    if configured is not None:
        if configured and not os.path.isdir(configured):
            raise FileNotFoundError(f'{WEIGHTS_DIR_ENV}={configured!r} is not a folder: point it at a folder of '
                                    f'staged weights (like weights/ of a clone), or set it empty to use the Hub only')
        return Path(configured) if configured else None
    folder = Path(__file__).resolve().parent.parent / 'weights'
    return folder if folder.is_dir() else None


def recorded_sha256(record: Optional[os.PathLike] = None) -> Dict[str, Dict[str, str]]:
    """``{hub id: {file name: sha256}}`` for every file of every folder staged by ``python -m timm_attnconv.stage``
    (``record``: the package's ``weights_sha256.json`` unless another file is named)."""
    record = record or SHA256_RECORD
    if not os.path.isfile(record):
        return {}
    with open(record) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f'{str(record)!r} is not valid JSON ({e}): restore it (`git checkout` it in a clone, or '
                             f'reinstall timm_attnconv)') from e


def sha256_file(path: os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def folder_digests(folder: os.PathLike) -> Dict[str, str]:
    """``{file name: sha256}`` of every file in a staged weights folder."""
    return {p.name: sha256_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def record_folder(folder: os.PathLike, record: Optional[os.PathLike] = None) -> Dict[str, str]:
    """Record the sha256 of every file of the staged ``folder`` (named ``<arch>.<tag>``) in ``record``."""
    digests = folder_digests(folder)
    records = dict(recorded_sha256(record), **{hub_id(Path(folder).name): digests})
    Path(record or SHA256_RECORD).write_text(json.dumps(dict(sorted(records.items())), indent=2) + '\n')
    return digests


def verify_file(path: os.PathLike, repo_id: str, filename: str = WEIGHTS_FILE) -> None:
    """Raise ``ValueError`` if ``path`` is not the ``filename`` recorded for ``repo_id`` (truncated, tampered, stale).

    Repos of other organisations (e.g. a user's fine-tune on the Hub) have nothing to compare against and pass;
    a repo of ours without a record does not.
    """
    repo = repo_id.split('@')[0]
    files = recorded_sha256().get(repo)
    if files is None and not repo.startswith(f'{HF_ORG}/'):
        return
    expected = (files or {}).get(filename)
    if expected is None:
        raise ValueError(
            f'{filename} of {repo_id} has no sha256 record in {SHA256_RECORD.name}: these are not weights this release '
            f'of timm_attnconv staged, so they are not loaded. Update timm_attnconv, or load the file yourself with '
            f'pretrained_cfg_overlay=dict(file=...).')
    actual = sha256_file(path)
    if actual != expected:
        raise ValueError(
            f'{filename} {str(path)!r} of {repo_id} has sha256 {actual}, but {expected} was recorded when it was '
            f'staged ({SHA256_RECORD.name}): the file is truncated, corrupt or from another release. Delete it and '
            f'download it again (remove it from the Hugging Face cache, or `git checkout` the weights/ folder).')


def locate_weights(repo_id: str, filename: str = WEIGHTS_FILE, prefer_bundled: bool = True) -> str:
    """Path of ``filename`` of Hub repo ``repo_id``: the bundled copy if there is one, else downloaded; verified."""
    name = repo_id.split('@')[0].split('/')[-1]
    bundled = bundled_weights_dir() if prefer_bundled else None
    if bundled is not None and (bundled / name / filename).is_file():
        path = str(bundled / name / filename)
    else:
        path = _download(repo_id, filename)
    verify_file(path, repo_id, filename)
    return path


def _download(repo_id: str, filename: str) -> str:
    from huggingface_hub import constants, hf_hub_download
    repo, _, revision = repo_id.partition('@')
    try:
        return hf_hub_download(repo, filename, revision=revision or None, library_name='timm')
    except Exception as e:  # the Hub's errors, connection errors and offline-cache misses all end here
        offline = ' (HF_HUB_OFFLINE is set and the file is not in the cache)' if constants.HF_HUB_OFFLINE else ''
        raise RuntimeError(
            f'could not get {filename} of {repo} from {constants.ENDPOINT}{offline}: {type(e).__name__}: {e}. '
            f'Check the network or HF_ENDPOINT, or load from a clone of timm_attnconv, whose weights/ folder holds '
            f'the files (or point {WEIGHTS_DIR_ENV} at such a folder).') from e


def _pretrained_names() -> List[str]:
    # read from timm's registry, not from .models: the models import this module
    from timm.models import get_pretrained_cfg, list_pretrained
    return [name for name in list_pretrained()
            if (get_pretrained_cfg(name).hf_hub_id or '').startswith(f'{HF_ORG}/')]


def resolve_pretrained_kwargs(variant: str, pretrained: bool, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Builder kwargs with ``pretrained_cfg_overlay`` pointing timm at the verified local weights file.

    timm itself would download from ``hf_hub_id`` without a checksum and without looking at a clone's ``weights/``;
    a user-supplied ``file`` / ``url`` / ``state_dict`` is left to timm. A name without weights is refused here, with
    the names that have some, rather than failing later with timm's generic message.
    """
    if not pretrained:
        return kwargs
    from timm.models import resolve_pretrained_cfg
    cfg = resolve_pretrained_cfg(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
    if cfg.state_dict is not None or cfg.file or cfg.url:
        return kwargs
    if not cfg.hf_hub_id:
        alternatives = ', '.join(_pretrained_names()) or 'none yet'
        raise RuntimeError(
            f'{variant} has no pretrained weights yet (none of the papers released usable ones and this package has '
            f'not trained this configuration). Models with weights: {alternatives}. Use pretrained=False for '
            f'random init, or pretrained_cfg_overlay=dict(file=...) to load your own checkpoint.')
    if cfg.source == 'hf-hub':  # timm built this model from the repo's config.json: check it is the staged one
        _check_hub_config(variant, cfg.hf_hub_id)
    path = locate_weights(cfg.hf_hub_id, cfg.hf_hub_filename or WEIGHTS_FILE,
                          prefer_bundled=cfg.source != 'hf-hub')
    overlay = dict(kwargs.get('pretrained_cfg_overlay') or {}, file=path, source=None)
    return dict(kwargs, pretrained_cfg_overlay=overlay)


def _check_hub_config(variant: str, repo_id: str) -> None:
    """Refuse a ``hf-hub:`` repo of ours whose ``config.json`` names another architecture or is not the staged one."""
    repo = repo_id.split('@')[0]
    if not repo.startswith(f'{HF_ORG}/'):
        return
    arch = repo.split('/')[-1].split('.')[0]
    if arch != variant:
        raise ValueError(f'{CONFIG_FILE} of {repo_id} names architecture {variant!r}, but the repo holds {arch!r} '
                         f'weights: that config belongs to another model. Use timm.create_model({arch!r}, '
                         f'pretrained=True), whose files are verified.')
    locate_weights(repo_id, CONFIG_FILE, prefer_bundled=False)
