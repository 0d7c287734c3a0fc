"""Models in the Hugging Face hub cache: finding them, listing them, pulling and removing them.

Owns: every call into ``huggingface_hub`` (its cache scanner, ``snapshot_download``, its API
client), the ``ORG/NAME[@REVISION]`` id form, which files an mlx-lm folder needs, the checks a
pull makes before it writes anything (an mlx-lm model? enough disk? `plan_pull`), the download
(`fetch`) and the cleanup when it fails. Models are used in place in the cache (``<cache>/models--ORG--NAME/snapshots/<commit>``),
never copied, so mlx-lm, LM Studio and omlx share one download.
Must not: read environment variables (``huggingface_hub`` reads ``HF_HUB_CACHE``, ``HF_HOME``,
``HF_ENDPOINT``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` itself), print, or load weights.

Cache layout and API: https://huggingface.co/docs/huggingface_hub/guides/manage-cache.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omlx.errors import (
    HubAccessError,
    HubNotFoundError,
    HubUnreachableError,
    InsufficientDiskError,
    ModelImportError,
    NotAModelError,
)
from omlx.units import format_bytes

logger = logging.getLogger(__name__)

#: ``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, tag or commit hash).
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]*))?")
#: Room left free on the disk beyond the files a pull writes (file system metadata, the tree cache).
DISK_MARGIN_BYTES = 16 * 2**20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")


@dataclass(frozen=True, slots=True)
class HubRef:
    """A parsed ``ORG/NAME[@REVISION]``; ``revision`` None means the default branch."""

    repo_id: str
    revision: str | None = None

    @property
    def model_id(self) -> str:
        return self.repo_id if self.revision in (None, "main") else f"{self.repo_id}@{self.revision}"


@dataclass(frozen=True, slots=True)
class HubModel:
    """One cached revision of a hub repo that omlx can serve.

    Attributes:
        model_id: the served id (``ORG/NAME`` for the default branch, else ``ORG/NAME@REF``).
        repo_id: ``ORG/NAME``.
        commit_hash: the snapshot's commit (40 hex digits).
        path: the snapshot folder (its files are symlinks into ``blobs/``).
        size_bytes: bytes on disk of this revision's files.
    """

    model_id: str
    repo_id: str
    commit_hash: str
    path: Path
    size_bytes: int


@dataclass(frozen=True, slots=True)
class PullResult:
    """What `pull` left in the cache.

    Attributes:
        num_downloaded_bytes: bytes fetched by this call (0 when everything was cached).
        num_bytes: bytes on disk of the snapshot's files.
    """

    model: HubModel
    num_downloaded_bytes: int
    num_bytes: int


def parse_hub_id(spec: str) -> HubRef | None:
    """``ORG/NAME[@REVISION]`` -> `HubRef`; None for anything else (a path, a bare name, a repo id
    the hub cannot have: huggingface_hub's ``validate_repo_id``, e.g. a name ending in ``-``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    m = _HUB_ID.fullmatch(spec)
    if m is None or ".." in spec:
        return None
    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return HubRef(m["repo"], m["rev"])


def cache_dir(configured: str | None) -> Path:
    """The hub cache folder: ``configured`` (``hub_cache_dir`` in config.toml), else the one
    ``huggingface_hub`` uses (``HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``)."""
    if configured:
        return Path(configured).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def allow_patterns() -> list[str]:
    """The files an mlx-lm folder needs: mlx-lm's own list (weights, config, tokenizer, chat
    template), so that a pull and ``mlx_lm.load`` agree on what a complete snapshot is."""
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def unservable_reason(path: Path) -> str | None:
    """Why the folder ``path`` is not a model omlx serves (None: it is one): it needs config.json,
    safetensors weights, a tokenizer, and a ``model_type`` mlx-lm implements or omlx's encoders read."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "no readable config.json"
    if not any(path.glob("*.safetensors")):
        return "no *.safetensors weights"
    if not any((path / t).is_file() for t in _TOKENIZER_FILES) and not any(path.glob("*.tiktoken")) \
            and not (path / "vocab.txt").is_file():
        return "no tokenizer (tokenizer.json, tokenizer.model or *.tiktoken)"
    return unsupported_config_reason(config)


def unsupported_config_reason(config: dict[str, Any]) -> str | None:
    """Why a config.json describes a model omlx cannot run (None: it can)."""
    import importlib.util

    from omlx.engine.encoder import detect_task

    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if detect_task(config) != "chat":
        return None  # an embedding model or a cross-encoder: omlx's own encoders
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return "config.json names no model_type"
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")
    if importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
        return f"model_type {model_type!r} is not implemented by mlx-lm"
    return None


def find_cached(ref: HubRef, cache: Path) -> Path | None:
    """The snapshot folder of ``ref`` in the cache, without any network call (None: not cached,
    incomplete, or not a model omlx serves)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not (cache / _repo_folder(ref.repo_id)).is_dir():
        return None
    try:
        path = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=True,
                                      allow_patterns=allow_patterns()))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        logger.debug("%s is not usable from %s: %s", ref.model_id, cache, e)
        return None
    return path if unservable_reason(path) is None else None


def list_cached(cache: Path) -> list[HubModel]:
    """Every cached revision of a model repo that omlx can serve, by served id; one entry per ref
    (``main`` gives ``ORG/NAME``), and ``ORG/NAME@<commit>`` for a revision no ref names."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except (CacheNotFound, OSError) as e:
        logger.debug("cannot scan the hub cache %s: %s", cache, e)
        return []
    out: list[HubModel] = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            if unservable_reason(rev.snapshot_path) is not None:
                continue
            names = sorted(rev.refs) or [rev.commit_hash]
            for name in names:
                ref = HubRef(repo.repo_id, name)
                out.append(HubModel(ref.model_id, repo.repo_id, rev.commit_hash, rev.snapshot_path, rev.size_on_disk))
    return sorted(out, key=lambda m: m.model_id)


def remove(ref: HubRef, cache: Path) -> int:
    """Delete ``ref`` from the hub cache with huggingface_hub's own deletion strategy (blobs another
    revision still uses are kept): every revision for ``ORG/NAME``, one for ``ORG/NAME@REV`` (a ref
    or a commit hash). Returns the bytes freed (0: nothing of it was cached).
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return 0
    revs = [r.commit_hash for repo in info.repos if repo.repo_id == ref.repo_id and repo.repo_type == "model"
            for r in repo.revisions
            if ref.revision is None or ref.revision in r.refs or r.commit_hash.startswith(ref.revision)]
    if not revs:
        return 0
    strategy = info.delete_revisions(*revs)
    strategy.execute()
    repo_dir = cache / _repo_folder(ref.repo_id)
    if repo_dir.is_dir() and not any((repo_dir / "snapshots").glob("*")):
        shutil.rmtree(repo_dir, ignore_errors=True)  # refs/, .no_exist/ and trees/ of a repo now empty
    return int(strategy.expected_freed_size)


@dataclass(frozen=True, slots=True)
class PullPlan:
    """What a pull will do, decided by `plan_pull` before anything is written.

    Attributes:
        ref: what is pulled.
        cache: the hub cache it goes into.
        need_bytes: bytes still to fetch (0: every file is cached already).
        cached: the snapshot folder to use as it is, with nothing fetched (offline, or the hub
            unreachable while the model is cached); None: `fetch` downloads.
    """

    ref: HubRef
    cache: Path
    need_bytes: int
    cached: Path | None = None


def pull(ref: HubRef, cache: Path, *, on_total: Callable[[int], None] | None = None,
         on_bytes: Callable[[int], None] | None = None) -> PullResult:
    """Download ``ref`` into the hub cache (resuming: files already there are not fetched again):
    `plan_pull` (the checks, nothing written), then `fetch`. Raises what those two raise.

    Args:
        on_total: called once with the bytes to fetch, when there are any.
        on_bytes: called with each chunk's size as it is written (from download threads).
    """
    return fetch(plan_pull(ref, cache), on_total=on_total, on_bytes=on_bytes)


def plan_pull(ref: HubRef, cache: Path) -> PullPlan:
    """The checks a pull makes before it writes anything to the cache.

    It lists the revision's files (``GET /api/models/{repo}/revision/{rev}`` and ``.../tree/
    {commit}``), refuses a repo that is not an mlx-lm model (by its file list, then by its
    config.json, fetched into a temporary folder), and compares the bytes still to fetch with the
    free space on the cache's disk.

    Raises:
        HubNotFoundError: the repo or revision does not exist (or the repo is private).
        HubAccessError: the repo is gated, or the token may not read it.
        NotAModelError: the repo is not an mlx-lm model omlx can serve.
        InsufficientDiskError: the disk is too small for what is still to fetch.
        HubUnreachableError: the hub cannot be reached and the model is not cached, or
            ``HF_HUB_OFFLINE`` is set and it is not cached. Every message says what to change.
    """
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    import httpx2  # huggingface_hub 2.x's HTTP client (a dependency of it): its connection errors come through

    repo_dir = cache / _repo_folder(ref.repo_id)
    if constants.is_offline_mode():
        path = find_cached(ref, cache)
        if path is None:
            raise HubUnreachableError(f"HF_HUB_OFFLINE is set and {ref.model_id} is not in the hub cache {cache}; "
                                      "unset HF_HUB_OFFLINE to download it")
        return PullPlan(ref, cache, 0, path)
    api = HfApi()
    where = f"{constants.ENDPOINT}"
    try:
        info = api.model_info(ref.repo_id, revision=ref.revision or "main")
        commit = str(info.sha)
        files = [f for f in api.list_repo_tree(ref.repo_id, revision=commit, recursive=True) if isinstance(f, RepoFile)]
    except RevisionNotFoundError as e:
        raise HubNotFoundError(f"{ref.repo_id} has no revision {ref.revision!r} on {where} (give a branch, a tag "
                               "or a commit hash)") from e
    except GatedRepoError as e:
        raise HubAccessError(f"{ref.repo_id} is gated on {where}: accept its terms on the model's page, then set "
                             "HF_TOKEN to a token of that account") from e
    except RepositoryNotFoundError as e:
        raise HubNotFoundError(f"no model {ref.repo_id} on {where} (if it is private, set HF_TOKEN)") from e
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        if _http_status(e) in (401, 403):
            raise HubAccessError(f"{where} refuses {ref.repo_id} to this token ({e}); set HF_TOKEN to a token "
                                 "that may read it") from e
        path = find_cached(ref, cache)
        if path is not None:
            logger.warning("cannot reach %s (%s); %s is in the cache, using it", where, e, ref.model_id)
            return PullPlan(ref, cache, 0, path)
        raise HubUnreachableError(f"cannot reach {where} to fetch {ref.model_id}: {e} (set HF_ENDPOINT for a "
                                  "mirror)") from e

    wanted = {f.path: f for f in filter_repo_objects(files, allow_patterns=allow_patterns(), key=lambda f: f.path)}
    problem = _file_list_problem(ref, [f.path for f in files], list(wanted))
    if problem:
        raise NotAModelError(problem)
    with tempfile.TemporaryDirectory(prefix=".omlx-pull-") as tmp:
        try:
            config = json.loads(Path(hf_hub_download(ref.repo_id, "config.json", revision=commit, local_dir=tmp)).read_text())
        except GatedRepoError as e:
            raise HubAccessError(f"{ref.repo_id} is gated on {where}: accept its terms on the model's page, then set "
                                 "HF_TOKEN to a token of that account") from e
        except ValueError as e:
            raise NotAModelError(f"{ref.repo_id}'s config.json is not JSON: {e}") from e
        except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
            if _http_status(e) in (401, 403):
                raise HubAccessError(f"{where} refuses {ref.repo_id}'s files to this token ({e}); set HF_TOKEN to a "
                                     "token that may read them") from e
            raise HubUnreachableError(f"cannot read {ref.repo_id}'s config.json from {where}: {e}") from e
    reason = unsupported_config_reason(config)
    if reason:
        raise NotAModelError(f"{ref.repo_id} is not a model omlx can serve: {reason}")

    blobs = repo_dir / "blobs"
    need = sum(int(f.size or 0) for f in wanted.values() if not (blobs / _etag(f)).exists())
    free = free_bytes(cache)
    if need + DISK_MARGIN_BYTES > free:
        raise InsufficientDiskError(f"not enough disk space for {ref.model_id}: it needs {_mb(need)} "
                                    f"(+{_mb(DISK_MARGIN_BYTES)} margin) in {cache}, which has {_mb(free)} free; free "
                                    "some space or point HF_HUB_CACHE at a larger disk (nothing was written)")
    return PullPlan(ref, cache, need)


def fetch(plan: PullPlan, *, on_total: Callable[[int], None] | None = None,
          on_bytes: Callable[[int], None] | None = None) -> PullResult:
    """Fetch what `plan_pull` planned: ``snapshot_download`` of the files mlx-lm needs
    (`allow_patterns`). A failure that leaves an unusable snapshot (the disk filled up anyway, the
    files are not a servable model) removes what this call created; a dropped connection keeps the
    finished files, so pulling again resumes. An exception raised by ``on_total`` or ``on_bytes``
    (e.g. to cancel) goes through unchanged and keeps the finished files too.

    Args:
        on_total: called once with ``plan.need_bytes``, when there are any.
        on_bytes: called with each chunk's size as it is written (from download threads).

    Raises:
        HubAccessError: the hub refuses the files to this token (a gated repo).
        InsufficientDiskError: the disk filled up (the partial download is removed).
        NotAModelError: the snapshot is not a model omlx can serve (it is removed).
        HubUnreachableError: the connection broke off, or the hub answered an error.
        ModelImportError: any other failure to write the snapshot.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError

    import httpx2

    ref, cache = plan.ref, plan.cache
    if plan.cached is not None:
        return _result(ref, plan.cached, 0)
    where = f"{constants.ENDPOINT}"
    repo_dir = cache / _repo_folder(ref.repo_id)
    existed = repo_dir.exists()
    if on_total is not None and plan.need_bytes:
        on_total(plan.need_bytes)
    try:
        path = Path(snapshot_download(ref.repo_id, revision=ref.revision or "main", cache_dir=cache,
                                      allow_patterns=allow_patterns(), tqdm_class=_byte_bar(on_bytes)))
    except (HfHubHTTPError, httpx2.HTTPError) as e:  # before OSError: HfHubHTTPError is one
        if isinstance(e, GatedRepoError) or _http_status(e) in (401, 403):
            raise HubAccessError(f"{where} refuses {ref.model_id}'s files to this token ({e}); if it is gated, accept "
                                 "its terms on the model's page, then set HF_TOKEN to a token of that account") from e
        raise HubUnreachableError(f"fetching {ref.model_id} failed: {e}; run the same command again to resume "
                                  "(finished files are kept)") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            _cleanup(repo_dir, existed)
            raise InsufficientDiskError(f"the disk under {cache} filled up while fetching {ref.model_id}: "
                                        f"{e.strerror}; free some space and pull again (the partial download was "
                                        "removed)") from e
        if isinstance(e, (LocalEntryNotFoundError, ConnectionError)):
            raise HubUnreachableError(f"lost the connection to {where} while fetching {ref.model_id}: {e}; run the "
                                      "same command again to resume (finished files are kept)") from e
        raise ModelImportError(f"fetching {ref.model_id} failed: {e}; run the same command again to resume") from e
    reason = unservable_reason(path)
    if reason:
        _cleanup(repo_dir, existed)
        raise NotAModelError(f"{ref.repo_id} is not a model omlx can serve: {reason} (the download was removed)")
    return _result(ref, path, plan.need_bytes)


def _http_status(e: BaseException) -> int | None:
    """The HTTP status of a huggingface_hub or httpx error that carries a response (None: no response)."""
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def snapshot_bytes(path: Path) -> int:
    """Bytes on disk of a folder's files, following symlinks (a snapshot's files point into ``blobs/``)."""
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            pass
    return total


def _result(ref: HubRef, path: Path, downloaded: int) -> PullResult:
    size = snapshot_bytes(path)
    return PullResult(HubModel(ref.model_id, ref.repo_id, path.name, path, size), downloaded, size)


def _file_list_problem(ref: HubRef, all_files: list[str], wanted: list[str]) -> str | None:
    """Why a repo's file list is not an mlx-lm model (None: it may be one), with what to do instead."""
    names = set(wanted)
    if "config.json" in names and any(n.endswith(".safetensors") for n in names) and (
            any(n in names for n in _TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)
            or "vocab.txt" in names):
        return None
    head = f"{ref.repo_id} is not an mlx-lm model"
    ggufs = [n for n in all_files if n.endswith(".gguf")]
    if ggufs:
        return (f"{head}: it holds GGUF files ({', '.join(sorted(ggufs)[:3])}); download one and run "
                "`omlx models import FILE.gguf`")
    if any(fnmatch.fnmatch(n, "*.bin") or n.endswith(".pt") for n in all_files):
        return (f"{head}: it has PyTorch weights only; convert it with `mlx_lm.convert --hf-path {ref.repo_id} -q` "
                "or pull an MLX conversion (e.g. from mlx-community)")
    missing = [what for what, ok in (
        ("config.json", "config.json" in names),
        ("*.safetensors weights", any(n.endswith(".safetensors") for n in names)),
        ("a tokenizer", any(n in names for n in _TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)))
        if not ok]
    return f"{head}: it has no {', no '.join(missing)} (files: {', '.join(sorted(all_files)[:8]) or 'none'})"


def _etag(f: Any) -> str:
    """The blob name huggingface_hub stores a file under: its LFS sha256, else its git blob id."""
    return f.lfs.sha256 if f.lfs is not None else f.blob_id


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _cleanup(repo_dir: Path, existed: bool) -> None:
    """Remove what a failed pull created: the whole repo folder, and its lock folder, when this
    pull made it (the cache-wide ``CACHEDIR.TAG`` stays: it marks the folder as a cache)."""
    if not existed:
        shutil.rmtree(repo_dir, ignore_errors=True)
        shutil.rmtree(repo_dir.parent / ".locks" / repo_dir.name, ignore_errors=True)
        logger.info("removed the partial download %s", repo_dir)


def _mb(n: int) -> str:
    return format_bytes(n, "MB", 1)  # one unit across the disk-space message


def _byte_bar(on_bytes: Callable[[int], None] | None) -> type:
    """A tqdm class for ``snapshot_download`` that shows nothing and hands the bytes written
    (its aggregate "huggingface_hub.snapshot_download" bar) to ``on_bytes``."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Bar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._forward = kwargs.get("name") == "huggingface_hub.snapshot_download"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._forward and on_bytes is not None and n:
                on_bytes(int(n))
            return super().update(n)

    return _Bar
