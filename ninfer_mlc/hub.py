"""Models named by Hugging Face Hub repo id (`org/name` or `org/name@revision`) -> a local snapshot.

Only what `ninfer compile` reads is fetched (config, generation config, tokenizer files, chat
templates, the safetensors index and the shards it names), into the standard Hugging Face cache
(HF_HOME / HF_HUB_CACHE) so other tools share the download, with huggingface_hub's progress bars.
Offline (HF_HUB_OFFLINE=1) or with the Hub unreachable, the cached snapshot is used; when there is
none, HubError names the repo. Every request has huggingface_hub's timeouts (HF_HUB_ETAG_TIMEOUT,
HF_HUB_DOWNLOAD_TIMEOUT), so a dead network fails instead of hanging.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .contract.safetensors_io import INDEX as WEIGHT_INDEX, indexed_files

# small files the compiler or the runtime reads (tokenizer.json is the one the runtime loads)
METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                  "additional_chat_templates/*.jinja")
REQUIRED_FILES = ("config.json", "tokenizer.json")


class HubError(Exception):
    """A repo id that cannot be turned into a complete local snapshot; the message names the repo."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: Optional[str] = None  # branch, tag or commit; None = the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class Snapshot:
    ref: HubRef
    path: Path  # the snapshot directory in the HF cache
    commit: str  # the resolved commit hash

    @property
    def name(self) -> str:
        return self.ref.repo_id.split("/")[-1]


def parse_ref(text: str) -> Optional[HubRef]:
    """`org/name[@revision]` as a HubRef, or None when `text` is not a repo id (e.g. a path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, _, revision = text.partition("@")
    if repo_id.count("/") != 1 or (_ and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubRef(repo_id, revision or None)


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or env


def fetch(ref: HubRef, cache_dir: Optional[str | Path] = None) -> Snapshot:
    """Download (or find in the cache) the files a compile needs; HubError names the repo otherwise.

    One quick request resolves the revision; when it fails (no network, Hub down, private repo) the
    cached snapshot is used without further requests (huggingface_hub would retry each listing
    with backoff for tens of seconds), and the failure is what the error reports if nothing is cached.
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    local_only, hub_error, revision = offline(), None, ref.revision
    if not local_only:
        try:
            revision = HfApi().model_info(ref.repo_id, revision=ref.revision, timeout=constants.HF_HUB_ETAG_TIMEOUT).sha
        except Exception as e:  # noqa: BLE001 - any failure: try the cache, report this if it has nothing
            local_only, hub_error = True, e
    try:
        meta = Path(snapshot_download(ref.repo_id, revision=revision, allow_patterns=list(METADATA_FILES)
                                      + [WEIGHT_INDEX], cache_dir=cache_dir, local_files_only=local_only))
        commit = meta.name  # snapshots/<commit>
        shards = indexed_files(meta)
        path = Path(snapshot_download(ref.repo_id, revision=commit, cache_dir=cache_dir, local_files_only=local_only,
                                      allow_patterns=shards or ["*.safetensors"],
                                      ignore_patterns=None if shards else ["*/*"]))
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the repo
        raise HubError(_explain(ref, hub_error or e, cache_dir)) from e
    check_snapshot(ref, path)
    return Snapshot(ref, path, commit)


def check_snapshot(ref: HubRef, path: Path) -> None:
    """Everything a compile needs is present (a cached snapshot may hold only part of a repo)."""
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    shards = indexed_files(path)
    if shards:
        missing += [s for s in shards if not (path / s).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        where = "the local cache" if offline() else "the repo"
        raise HubError(f"{ref}: {where} lacks {', '.join(missing[:4])}"
                       f"{f' (and {len(missing) - 4} more)' if len(missing) > 4 else ''} "
                       f"(snapshot {path}); a model needs config.json, tokenizer.json and safetensors weights")


def _explain(ref: HubRef, e: Exception, cache_dir) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache = cache_dir or constants.HF_HUB_CACHE
    if isinstance(e, GatedRepoError):
        return (f"{ref}: gated repo; accept its terms on https://huggingface.co/{ref.repo_id} and log in "
                f"(`hf auth login` or HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"{ref}: no such model on the Hugging Face Hub (or it is private: log in with `hf auth login` "
                f"or set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return f"{ref}: the repo has no revision {ref.revision!r}"
    if isinstance(e, HFValidationError):
        return f"{ref}: {e}"
    if isinstance(e, LocalEntryNotFoundError):
        return (f"{ref}: not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; download it "
                f"once with network access, or pass a model directory")
    if isinstance(e, _transport_errors()):
        return (f"{ref}: the Hugging Face Hub cannot be reached ({type(e).__name__}: {_first_line(e)}) and the "
                f"model is not in the local cache ({cache}); check the network or pass a model directory")
    return f"{ref}: download failed: {type(e).__name__}: {_first_line(e)}"


def _transport_errors() -> tuple:
    """Network failures as huggingface_hub's HTTP client raises them (httpx2 now; httpx or requests before)."""
    import importlib

    errors: list = [ConnectionError, TimeoutError]  # OfflineModeIsEnabled is a ConnectionError
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError"),
                         ("requests", "Timeout")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
