"""`--hf-config ORG/NAME`: a Hugging Face Hub model id instead of a local folder.

Only the small files an export needs (config, generation config, tokenizer files) are
fetched, never weights. The local Hugging Face cache (`HF_HUB_CACHE`, by default
`~/.cache/huggingface/hub`) is tried first, so a model downloaded once (by transformers,
`hf download`, or an earlier run) needs no network; otherwise huggingface_hub downloads
into that cache, unless `HF_HUB_OFFLINE` is set. A download has one deadline for all it
does (`--hub-timeout`, connecting and reading, retries included): huggingface_hub's own
per-request timeouts and retries added up to minutes against a host that accepts nothing.
Every failure is one line naming the id and what to do.
"""

from __future__ import annotations

import contextlib
import math
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from ckptctl.util.errors import UsageError

DEFAULT_HUB_TIMEOUT = 20.0
"""Seconds a Hub download may take in all (`--hub-timeout`)."""
T = TypeVar("T")

def resolve_repo(repo_id: str, patterns: Sequence[str], timeout: float = DEFAULT_HUB_TIMEOUT) -> Path:
    """The local snapshot folder of Hub model `repo_id` holding the files matching `patterns`
    (a `config.json` among them): from the cache, else downloaded within `timeout` seconds."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"--hf-config {repo_id}: not a local path, and"
    cache = constants.HF_HUB_CACHE
    partial: Path | None = None
    try:
        return _with_config(Path(snapshot_download(repo_id, allow_patterns=list(patterns), local_files_only=True)),
                            repo_id)
    except LocalEntryNotFoundError as exc:  # or IncompleteSnapshotError, which says where the partial snapshot is
        snapshot = getattr(exc, "snapshot_path", None)
        if snapshot and (Path(snapshot) / "config.json").is_file():
            partial = Path(snapshot)
    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    if offline:
        if partial is not None:
            return partial
        raise UsageError(f"{where} not in the Hugging Face cache ({cache}); HF_HUB_OFFLINE is set, so it cannot be "
                         f"downloaded: unset it, or pass a local folder (or its config.json)")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise UsageError(f"--hub-timeout must be a positive number of seconds (got {timeout})")
    try:
        with _quiet_downloads():
            folder = _within(timeout, lambda: snapshot_download(repo_id, allow_patterns=list(patterns),
                                                                etag_timeout=timeout))
        return _with_config(Path(folder), repo_id)
    except _Deadline:
        if partial is not None:
            return partial
        raise UsageError(f"{where} not in the Hugging Face cache ({cache}), and the Hugging Face Hub "
                         f"({constants.ENDPOINT}) did not send it within {timeout:g} s (connecting and reading; "
                         f"--hub-timeout sets the wait); pass a local folder (or its config.json)") from None
    except UsageError:
        raise
    except RepositoryNotFoundError:  # also gated repositories
        raise UsageError(f"{where} no model of that id on the Hugging Face Hub (or it is private or gated: "
                         f"log in with `hf auth login`); pass a local folder (or its config.json)") from None
    except Exception as exc:  # no network, a proxy, the Hub down, a full cache disk: all say the same to a user
        if partial is not None:
            return partial
        raise UsageError(f"{where} not in the Hugging Face cache ({cache}), and it cannot be downloaded "
                         f"({_first_line(exc)}); pass a local folder (or its config.json)") from None


class _Deadline(Exception):
    """A download given up at its deadline (`_within`)."""


def _within(seconds: float, fn: Callable[[], T]) -> T:
    """`fn()` run in a daemon thread, given up after `seconds` (`_Deadline`): no socket option
    bounds a whole download, retries included. The thread is left to its own timeouts; it never
    keeps the process from exiting."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread as it is
            outcome.append((False, exc))

    worker = threading.Thread(target=run, name="ckptctl-hub-download", daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        raise _Deadline
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def _quiet_downloads() -> Iterator[None]:
    """huggingface_hub's tqdm bars off for a few small files (stderr stays one line per event)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _with_config(folder: Path, repo_id: str) -> Path:
    if not (folder / "config.json").is_file():
        raise UsageError(f"--hf-config {repo_id}: the Hugging Face snapshot {folder} has no config.json")
    return folder


def _first_line(exc: BaseException) -> str:
    """An exception as one short line (huggingface_hub's messages run over several)."""
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else None
    text = str(cause or exc).strip().splitlines()
    name = type(cause or exc).__name__
    return f"{name}: {text[0]}" if text else name
