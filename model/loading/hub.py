"""Hugging Face Hub model ids as checkpoints: `owner/name` or `owner/name@revision` -> a local snapshot folder.

An existing local path always wins; otherwise a string of the Hub id grammar (HUB_ID: no leading `./`, no scheme) is
a Hub id; `with_revision` adds a revision given on its own (the job's --model_revision). Its snapshot is downloaded
with huggingface_hub's `snapshot_download` into the standard Hub cache (`hub_cache_dir`: $HF_HUB_CACHE, else
$HF_HOME/hub, else ~/.cache/huggingface/hub, as huggingface_hub, diffusers and `hf download` use it: a model fetched
by any of them is not fetched again), and only the files the pipeline reads: `model_index.json`, and in the
component folders their configs, the tokenizer files and the safetensors of the chosen variant (the same choice as a
local folder's, `model.loading.weight_files.select_weight_files`); root-level single-file checkpoints, other variants,
pickle weights, images and cards are never fetched.

`HF_TOKEN` (or a token saved by `hf auth login`) is sent as huggingface_hub sends it; `HF_ENDPOINT` names the Hub;
`HF_HUB_OFFLINE=1` uses the cached snapshot without any request, or fails saying none is cached. Every failure is a
typed `HubError` (model/errors.py) naming the id and the endpoint. huggingface_hub is imported only here, only for
Hub ids: without it a Hub id fails with HubDependencyError naming the package to install.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import re

from ..errors import (CheckpointError, HubDependencyError, HubError, HubGatedRepoError, HubNetworkError,
                      HubOfflineError, HubRepoNotFoundError, HubRevisionNotFoundError, UnsafeWeightsError)
from .weight_files import select_weight_files, weight_file_variant

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
REVISION = re.compile(r"[\w./-]+")  # a branch, tag or commit, as HUB_ID allows after '@'
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
HUB_PACKAGE = "huggingface_hub==2.4.0"
# The folders of a diffusers-layout FLUX.2 [klein] repository that the pipeline reads (model/config/configs.py).
COMPONENT_FOLDERS = ("transformer", "text_encoder", "vae", "scheduler", "tokenizer")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_TRUE = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class HubRef:
    """A parsed Hub id: `repo_id` (owner/name) and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def text(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclasses.dataclass(frozen=True)
class HubSnapshot:
    """A resolved Hub id: the local snapshot folder and the commit it holds."""

    ref: HubRef
    commit: str
    path: str

    @property
    def folder_name(self) -> str:
        """`owner--name@commit`: one name per repository and commit (the Dataflow copy's folder)."""
        return f"{self.ref.repo_id.replace('/', '--')}@{self.commit}"


def parse_hub_id(value) -> HubRef | None:
    """The Hub id `value` spells, or None: an existing local path, a URI, or a path starting with `.`, `/` or `~` is
    never one."""
    if not isinstance(value, str) or "://" in value or value.startswith((".", "/", "~")) or os.path.exists(value):
        return None
    if not HUB_ID.fullmatch(value):
        return None
    repo_id, _, revision = value.partition("@")
    if any(part in (".", "..") for part in repo_id.split("/")):
        return None
    return HubRef(repo_id, revision or None)


def is_hub_id(value) -> bool:
    return parse_hub_id(value) is not None


def with_revision(model: str | None, revision: str | None, name: str = "--model_revision") -> str | None:
    """`model` with the revision given on its own (`name`, as the caller calls it): `owner/name@revision`. Unchanged
    when `revision` is None, or names the revision `model` already has; ValueError when `model` is not a Hub id or
    names another revision, or `revision` is not one a Hub id can hold."""
    if revision is None:
        return model
    if not isinstance(revision, str) or not REVISION.fullmatch(revision):
        raise ValueError(f"{name} must be a branch, tag or commit (letters, digits, _ . / -), got {revision!r}")
    ref = parse_hub_id(model)
    if ref is None:
        given = "no --model is given" if model is None else f"--model={model!r} is not one"
        raise ValueError(f"{name}={revision!r} is the revision of a Hugging Face Hub id (--model=owner/name), and "
                         f"{given}")
    if ref.revision is not None and ref.revision != revision:
        raise ValueError(f"--model={model!r} asks for revision {ref.revision!r} and {name}={revision!r} for another; "
                         f"give one")
    return f"{ref.repo_id}@{revision}"


def hub_cache_dir() -> str:
    """The standard Hugging Face Hub cache, as the environment says now (huggingface_hub reads it once, at import):
    $HF_HUB_CACHE (or the older $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    def expand(path: str) -> str:
        return os.path.expandvars(os.path.expanduser(path))

    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return expand(cache)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(expand(home), "hub")


def hub_endpoint() -> str:
    """The Hub the requests go to: `$HF_ENDPOINT` as set now, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_mode(hub=None) -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it when imported."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in _TRUE or bool(hub is not None and hub.constants.is_offline_mode())


def needed_files(paths, variant: str | None, where: str) -> list[str]:
    """Of a repository's file paths, those the pipeline reads: model_index.json, and in each component folder every
    file but weights of other variants and pickle weights (refused, as on gs://, when a folder has only those)."""
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        folder, name = posixpath.split(path)
        by_folder.setdefault(folder, []).append(name)
    if "model_index.json" not in by_folder.get("", []):
        raise CheckpointError("the repository has no model_index.json at its root: not a diffusers-layout "
                              "checkpoint", path=where)
    files = ["model_index.json"]
    for folder in COMPONENT_FOLDERS:
        names = by_folder.get(folder, [])
        chosen = set(select_weight_files(names, variant, f"{where}/{folder}"))
        has_safetensors = any(n.lower().endswith(".safetensors") for n in names)
        for name in sorted(names):
            if name.lower().endswith(PICKLE_SUFFIXES):
                if not has_safetensors:
                    raise UnsafeWeightsError("pickle-based weight file refused (only safetensors are loaded)",
                                             path=f"{where}/{folder}/{name}")
                continue
            if weight_file_variant(name) is None or name in chosen:
                files.append(f"{folder}/{name}")
    return files


def _import_hub(model: str):
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (offline_mode reads it)
    except ImportError as e:
        raise HubDependencyError(f"{model!r} is a Hugging Face Hub id, which needs the huggingface_hub package: "
                                 f"pip install '{HUB_PACKAGE}' (or this project's [hub] extra)", model=model) from e
    return huggingface_hub


def resolve_hub(model: str, variant: str | None = None, *, cache_dir: str | None = None,
                files=None) -> HubSnapshot:
    """Download (or find cached) the snapshot of the Hub id `model` that the pipeline needs; HubError if it cannot.
    `files(paths, variant, where)`: which of the repository's files to fetch (default `needed_files`: a diffusers
    layout; the score model's CLIP repository names its own)."""
    ref = parse_hub_id(model)
    if ref is None:
        raise CheckpointError("not a Hugging Face Hub id (owner/name or owner/name@revision)", path=model)
    hub = _import_hub(model)
    from huggingface_hub import errors as hub_errors
    from huggingface_hub.hf_api import RepoFile

    endpoint, cache = hub_endpoint(), cache_dir or hub_cache_dir()
    revision = ref.revision or DEFAULT_REVISION
    where = f"{endpoint}/{ref.repo_id}@{revision}"
    offline = offline_mode(hub)
    paths = None
    if not offline:
        try:
            api = hub.HfApi(endpoint=endpoint)
            commit = api.repo_info(ref.repo_id, revision=revision).sha
            paths = [f.path for f in api.list_repo_tree(ref.repo_id, recursive=True, revision=commit)
                     if isinstance(f, RepoFile)]
        except Exception as e:  # noqa: BLE001 - sorted by _hub_error; the unreachable Hub falls back to the cache
            error = _hub_error(e, ref, endpoint, cache, hub_errors)
            if not isinstance(error, HubNetworkError):
                raise error from e
            paths = _cached_paths(hub, ref, revision, cache, hub_errors)
            if paths is None:
                raise error from e
            logger.warning("%s; using the cached snapshot of %s", error, ref.text)
            offline = True
    else:
        paths = _cached_paths(hub, ref, revision, cache, hub_errors)
        if paths is None:
            raise HubOfflineError(f"offline mode (HF_HUB_OFFLINE) and no cached snapshot of {ref.text} under {cache}: "
                                  f"run once with network access to cache it, or unset HF_HUB_OFFLINE", model=model)
    files = (files or needed_files)(paths, variant, where)
    try:
        path = hub.snapshot_download(ref.repo_id, revision=revision, cache_dir=cache, allow_patterns=files,
                                     local_files_only=offline, endpoint=endpoint)
    except Exception as e:  # noqa: BLE001 - every failure becomes a typed HubError
        raise _hub_error(e, ref, endpoint, cache, hub_errors, offline=offline) from e
    snapshot = HubSnapshot(ref=ref, commit=os.path.basename(os.path.normpath(path)), path=path)
    logger.info("Hub model %s is commit %s, in %s", ref.text, snapshot.commit, path)
    return snapshot


def _cached_paths(hub, ref: HubRef, revision: str, cache: str, hub_errors) -> list[str] | None:
    """The file listing that an earlier download cached for this revision (no request), or None."""
    try:
        return [f.path for f in hub.get_cached_repo_tree(ref.repo_id, revision=revision, cache_dir=cache)]
    except (hub_errors.CachedRepoTreeNotFoundError, OSError):
        return None


def _hub_error(e: Exception, ref: HubRef, endpoint: str, cache: str, hub_errors, offline: bool = False) -> Exception:
    """huggingface_hub's (or the network's) exception as the HubError that says what to do."""
    model = ref.text
    if isinstance(e, (HubError, CheckpointError)):
        return e
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hub_errors.GatedRepoError) or status == 403:
        return HubGatedRepoError(
            f"{ref.repo_id} is a gated repository ({status} from {endpoint}): accept its licence on "
            f"{endpoint}/{ref.repo_id} while logged in, then set HF_TOKEN to a read token of that account (or run "
            f"`hf auth login`)", model=model, endpoint=endpoint)
    if isinstance(e, hub_errors.RevisionNotFoundError):
        return HubRevisionNotFoundError(f"{ref.repo_id} has no revision {ref.revision or DEFAULT_REVISION!r} on "
                                        f"{endpoint}: give a branch, tag or commit of the repository",
                                        model=model, endpoint=endpoint)
    if isinstance(e, hub_errors.RepositoryNotFoundError):
        return HubRepoNotFoundError(
            f"no repository {ref.repo_id} on {endpoint} (check the id; a private repository needs HF_TOKEN set to a "
            f"token that can read it, or `hf auth login`)", model=model, endpoint=endpoint)
    if offline or isinstance(e, hub_errors.OfflineModeIsEnabled):
        return HubOfflineError(f"offline mode and no complete cached snapshot of {model} under {cache} "
                               f"({type(e).__name__}: {e}): run once with network access, or unset HF_HUB_OFFLINE",
                               model=model)
    if isinstance(e, hub_errors.HfHubHTTPError) and status is not None and status < 500 and status != 429:
        return HubError(f"the Hub at {endpoint} refused {model}: {type(e).__name__}: {e}", model=model,
                        endpoint=endpoint)
    # connection refused, DNS, timeout, proxy, 5xx, 429, or a file that stopped half-way
    return HubNetworkError(f"cannot download {model} from the Hugging Face Hub at {endpoint}: {type(e).__name__}: "
                           f"{e} (check the network, a proxy, or HF_ENDPOINT)", model=model, endpoint=endpoint)
