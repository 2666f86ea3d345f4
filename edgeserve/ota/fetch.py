"""An install's bundle file: a local file read where it lies, or a download into `ota/downloads/`.

A download belongs to the install that started it (its name is in the journal record): it is deleted
when that install ends, committed or not, so refused bundles never pile up; the free space is checked
(statvfs, with the policy's margin) before the download starts and again once the server declares its
size. Fleet-initiated installs go through the URL policy (url_policy.py); an operator's do not.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

from edgeserve.fsutil import sha256_file
from edgeserve.ota import archive
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.policy import Policy, check_disk
from edgeserve.ota.store import DOWNLOADING, Store
from edgeserve.ota.url_policy import UrlPolicy, UrlRefused, check_url

Report = Callable[[str, float | None, str], None]


def is_url(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def download_name(source: str) -> str | None:
    """The file a URL downloads to in ota/downloads (the same URL resumes the same file); None for a path."""
    return hashlib.sha256(source.encode()).hexdigest()[:24] + ".esb" if is_url(source) else None


def fetch(store: Store, source: str, report: Report, *, sha256: str | None, cancel: threading.Event | None,
          policy: Policy, url_policy: UrlPolicy | None) -> Path:  # fmt: skip
    """The bundle file for `source`; BundleRefused (reason "url", "disk", "hash", "size", "download")
    otherwise. `url_policy` None: an operator's install, no URL rules."""
    report(DOWNLOADING, 0.0, source)
    name = download_name(source)
    if name is None:
        if url_policy is not None:
            try:
                check_url(source, url_policy)
            except UrlRefused as exc:
                raise BundleRefused("url", str(exc)) from None
        path = Path(source.removeprefix("file://"))
        if not path.is_file():
            raise BundleRefused("download", f"no bundle file at {path}")
        if sha256 is not None and sha256_file(path) != sha256.lower():
            raise BundleRefused("hash", f"{path} does not have the expected sha256")
        report(DOWNLOADING, 1.0, f"{path} ({path.stat().st_size} bytes)")
        return path

    from edgeserve.ota.download import DownloadError, download

    store.clear_downloads({name})  # one install at a time (the store lock): anything else is stale
    what = f"downloading {source}"
    check_disk(store.downloads, 0, policy, what)
    target = store.downloads / name
    cap = policy.max_unpacked_bytes + archive.MAX_MANIFEST_BYTES
    try:
        download(source, target, expected_sha256=sha256, max_bytes=cap, cancel=cancel, url_policy=url_policy,
                 space_check=lambda need: check_disk(store.downloads, need, policy, what),
                 progress=lambda done, total: report(DOWNLOADING, done / total if total else None,
                                                     f"{done} bytes"))  # fmt: skip
    except DownloadError as exc:
        raise BundleRefused(exc.reason, str(exc)) from None
    return target
