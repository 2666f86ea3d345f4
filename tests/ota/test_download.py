"""edgeserve.ota.download against a real (fault-injecting) HTTP server on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from bundle_server import BundleServer
from tls_certs import self_signed

from edgeserve.ota import download as download_module
from edgeserve.ota.download import DownloadError, download
from edgeserve.ota.url_policy import UrlPolicy

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
SIZE = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def payload() -> bytes:
    return os.urandom(SIZE)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(dest.name + "."))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []

    def __call__(self, done: int, total: int | None) -> None:
        self.calls.append((done, total))


def test_plain_download(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/bundle.tar", payload)
    dest = tmp_path / "bundle.tar"
    progress = Recorder()
    digest = download(url, dest, expected_sha256=sha(payload), progress=progress)
    assert digest == sha(payload)
    assert dest.read_bytes() == payload
    assert leftovers(dest) == []  # no .part, no .part.meta
    [request] = bundle_server.requests("/bundle.tar")
    assert request.range is None and request.status == 200
    assert progress.calls[-1] == (SIZE, SIZE)
    assert [done for done, _ in progress.calls] == sorted(done for done, _ in progress.calls)
    assert len(progress.calls) <= 12  # throttled: a fast transfer reports a few times, not per chunk


def test_no_expected_hash_still_returns_the_hash_of_the_file(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    url = bundle_server.add("/b", payload)
    assert download(url, tmp_path / "b") == sha(payload)


def test_dropped_connection_is_resumed(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, drop_after=1_500_000, times=2)
    dest = tmp_path / "b"
    assert download(url, dest, expected_sha256=sha(payload), backoff_s=0.01) == sha(payload)
    assert dest.read_bytes() == payload
    requests = bundle_server.requests("/b")
    assert [(r.range, r.status) for r in requests] == [
        (None, 200),
        ("bytes=1500000-", 206),
        ("bytes=3000000-", 206),
    ]
    etag = bundle_server.etag("/b")
    assert all(r.if_range == etag for r in requests[1:])
    assert leftovers(dest) == []


def test_drops_that_make_progress_do_not_use_up_attempts(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    # Every request is cut after 1 MB; with 2 attempts the download still completes because each try
    # grows the .part.
    url = bundle_server.add("/b", payload, drop_after=1_000_000)
    dest = tmp_path / "b"
    assert download(url, dest, expected_sha256=sha(payload), attempts=2, backoff_s=0.01) == sha(payload)
    assert len(bundle_server.requests("/b")) == 5


def test_drops_without_progress_use_up_attempts(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    # The server ignores Range and always cuts at 1 MB: no try gets further than the last one.
    url = bundle_server.add("/b", payload, drop_after=1_000_000, ignore_range=True)
    with pytest.raises(DownloadError, match="after 3 attempts"):
        download(url, tmp_path / "b", attempts=3, backoff_s=0.01)
    assert len(bundle_server.requests("/b")) == 3


_KILLED_CHILD = """
import sys
from pathlib import Path
from edgeserve.ota.download import download
download(sys.argv[1], Path(sys.argv[2]), stall_timeout_s=30, attempts=1)
"""


def test_part_left_by_a_killed_process_is_resumed(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    cut = 2_500_000
    url = bundle_server.add("/b", payload, stall_after=cut, stall_s=20, times=1)
    dest = tmp_path / "b"
    part = tmp_path / "b.part"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, url, str(dest)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 15
        while not (part.exists() and part.stat().st_size == cut):
            assert child.poll() is None, "the child ended before it was killed"
            assert time.monotonic() < deadline, "the child never reached the stall"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert part.stat().st_size == cut
    assert json.loads((tmp_path / "b.part.meta").read_text())["url"] == url

    assert download(url, dest, expected_sha256=sha(payload)) == sha(payload)
    assert dest.read_bytes() == payload
    last = bundle_server.requests("/b")[-1]
    assert (last.range, last.if_range, last.status) == (f"bytes={cut}-", bundle_server.etag("/b"), 206)
    assert leftovers(dest) == []


def test_server_errors_then_recovers(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, fail_first=2, status=500)
    dest = tmp_path / "b"
    assert download(url, dest, expected_sha256=sha(payload), backoff_s=0.01) == sha(payload)
    assert [r.status for r in bundle_server.requests("/b")] == [500, 500, 200]


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_retryable_statuses_use_up_attempts(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path, status: int
) -> None:
    url = bundle_server.add("/b", payload, fail_first=100, status=status)
    with pytest.raises(DownloadError, match=f"after 3 attempts: HTTP {status}") as info:
        download(url, tmp_path / "b", attempts=3, backoff_s=0.01)
    assert url in str(info.value)
    assert len(bundle_server.requests("/b")) == 3


def test_wrong_bytes_fail_the_hash_and_leave_nothing(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    url = bundle_server.add("/b", payload, corrupt=True)
    dest = tmp_path / "b"
    with pytest.raises(DownloadError, match="sha256 mismatch") as info:
        download(url, dest, expected_sha256=sha(payload))
    assert "\n" not in str(info.value)
    assert not dest.exists()
    assert leftovers(dest) == []


def test_stall_is_retried_and_completes(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, stall_after=1_000_000, stall_s=10, times=1)
    dest = tmp_path / "b"
    # No clock: the resumed second request below is what shows the stall was cut short, not waited out.
    assert download(url, dest, expected_sha256=sha(payload), stall_timeout_s=0.5, backoff_s=0.01) == sha(
        payload
    )
    assert [(r.range, r.status) for r in bundle_server.requests("/b")] == [
        (None, 200),
        ("bytes=1000000-", 206),
    ]


def _leave_part(server: BundleServer, path: str, data: bytes, dest: Path, cut: int = 1_000_000) -> None:
    """A first run that is cut after `cut` bytes and gives up: `<dest>.part` + meta stay behind."""
    url = server.add(path, data, drop_after=cut, times=1)
    with pytest.raises(DownloadError, match="after 1 attempts"):
        download(url, dest, attempts=1)
    assert (dest.parent / (dest.name + ".part")).stat().st_size == cut


def test_server_ignoring_range_restarts_from_zero(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/b", payload, dest)
    url = bundle_server.add("/b", payload, ignore_range=True)
    progress = Recorder()
    assert download(url, dest, expected_sha256=sha(payload), progress=progress) == sha(payload)
    assert dest.read_bytes() == payload
    [request] = bundle_server.requests("/b")[1:]
    assert (request.range, request.status) == ("bytes=1000000-", 200)
    assert progress.calls[0] == (0, SIZE)  # started over, not from the 1 MB prefix


def test_changed_file_is_not_spliced(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/b", payload, dest)
    old_etag = bundle_server.etag("/b")
    new = os.urandom(SIZE)
    url = bundle_server.add("/b", new)
    assert download(url, dest, expected_sha256=sha(new)) == sha(new)
    assert dest.read_bytes() == new
    [request] = bundle_server.requests("/b")[1:]
    # If-Range carried the old ETag, so the server answered with the whole new file.
    assert (request.range, request.if_range, request.status) == ("bytes=1000000-", old_etag, 200)


def test_changed_file_on_a_server_ignoring_if_range_is_not_spliced(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/b", payload, dest)
    new = os.urandom(SIZE)
    url = bundle_server.add("/b", new, ignore_if_range=True)
    assert download(url, dest, expected_sha256=sha(new), backoff_s=0.01) == sha(new)
    assert dest.read_bytes() == new
    # The 206 came with a different ETag: dropped, and the next try starts from 0.
    assert [(r.range, r.status) for r in bundle_server.requests("/b")[1:]] == [
        ("bytes=1000000-", 206),
        (None, 200),
    ]


def test_part_for_another_bundle_is_not_resumed(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/old", payload, dest)
    url = bundle_server.add("/new", payload)
    assert download(url, dest, expected_sha256=sha(payload)) == sha(payload)
    [request] = bundle_server.requests("/new")
    assert request.range is None


def test_complete_part_is_verified_after_416(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/b", payload, dest)
    (tmp_path / "b.part").write_bytes(payload)  # as if every byte had arrived before the process died
    url = bundle_server.add("/b", payload)
    assert download(url, dest, expected_sha256=sha(payload)) == sha(payload)
    [request] = bundle_server.requests("/b")[1:]
    assert (request.range, request.status) == (f"bytes={SIZE}-", 416)


def test_part_bigger_than_the_file_restarts_once(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    dest = tmp_path / "b"
    _leave_part(bundle_server, "/b", payload, dest)
    (tmp_path / "b.part").write_bytes(payload + b"trailing junk")
    url = bundle_server.add("/b", payload)
    assert download(url, dest, expected_sha256=sha(payload)) == sha(payload)
    assert dest.read_bytes() == payload
    assert [(r.range, r.status) for r in bundle_server.requests("/b")[1:]] == [
        (f"bytes={SIZE + 13}-", 416),
        (None, 200),
    ]


def test_not_found_fails_at_once(bundle_server: BundleServer, tmp_path: Path) -> None:
    url = bundle_server.url("/missing.tar")
    # "At once" is one request and no backoff (a retry would be a second request), not a time bound.
    with pytest.raises(DownloadError, match="not found") as info:
        download(url, tmp_path / "b", attempts=5, backoff_s=1.0)
    assert "HTTP 404" in str(info.value) and url in str(info.value)
    assert len(bundle_server.requests("/missing.tar")) == 1
    assert leftovers(tmp_path / "b") == []


def test_forbidden_fails_at_once(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, status=403)
    with pytest.raises(DownloadError, match="HTTP 403"):
        download(url, tmp_path / "b", attempts=5, backoff_s=1.0)
    assert len(bundle_server.requests("/b")) == 1


def test_max_bytes_refuses_a_large_content_length(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    url = bundle_server.add("/b", payload)
    dest = tmp_path / "b"
    with pytest.raises(DownloadError, match=f"{SIZE} bytes is more than the limit of 1000000"):
        download(url, dest, max_bytes=1_000_000)
    assert len(bundle_server.requests("/b")) == 1
    assert not dest.exists() and leftovers(dest) == []


def test_max_bytes_refuses_a_stream_that_runs_over(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path
) -> None:
    url = bundle_server.add("/b", payload, chunked=True)  # no Content-Length to judge by
    dest = tmp_path / "b"
    with pytest.raises(DownloadError, match="more than the limit of 1000000 bytes arrived"):
        download(url, dest, max_bytes=1_000_000)
    assert not dest.exists() and leftovers(dest) == []


def test_max_bytes_allows_an_exact_fit(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, chunked=True)
    assert download(url, tmp_path / "b", max_bytes=SIZE) == sha(payload)


def test_cancel_mid_transfer_keeps_the_part_for_a_resume(
    bundle_server: BundleServer, payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(download_module, "PROGRESS_INTERVAL_S", 0.0)  # a call per chunk
    url = bundle_server.add("/b", payload)
    dest = tmp_path / "b"
    cancel = threading.Event()

    def progress(done: int, total: int | None) -> None:
        if done >= 1_000_000:
            cancel.set()

    with pytest.raises(DownloadError, match="cancelled"):
        download(url, dest, progress=progress, cancel=cancel)
    kept = (tmp_path / "b.part").stat().st_size
    assert 1_000_000 <= kept < SIZE
    assert not dest.exists()

    assert download(url, dest, expected_sha256=sha(payload)) == sha(payload)
    assert bundle_server.requests("/b")[-1].range == f"bytes={kept}-"


def test_cancel_during_backoff(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload, fail_first=100, status=503)
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(DownloadError, match="cancelled"):
            download(url, tmp_path / "b", backoff_s=3600.0, cancel=cancel)
    finally:
        timer.cancel()
    # The backoff is an hour: ending well inside it shows the cancel cut it short, however slow the box.
    assert time.monotonic() - started < 1800
    assert len(bundle_server.requests("/b")) == 1


def test_cancel_before_start(bundle_server: BundleServer, payload: bytes, tmp_path: Path) -> None:
    url = bundle_server.add("/b", payload)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(DownloadError, match="cancelled"):
        download(url, tmp_path / "b", cancel=cancel)
    assert bundle_server.requests("/b") == []


def test_connection_refused_is_retried_then_fails(tmp_path: Path) -> None:
    server = BundleServer().start()
    url = server.url("/b")
    server.stop()  # nothing listens on that port any more
    with pytest.raises(DownloadError, match="after 2 attempts: cannot connect"):
        download(url, tmp_path / "b", attempts=2, backoff_s=0.01)


@pytest.mark.parametrize("form", ["file-url", "plain-path", "path-object-string"])
def test_local_sources(payload: bytes, tmp_path: Path, form: str) -> None:
    source = tmp_path / "usb" / "bundle tar"  # a space: file URLs are percent-encoded
    source.parent.mkdir()
    source.write_bytes(payload)
    url = {"file-url": source.as_uri(), "plain-path": str(source), "path-object-string": os.fspath(source)}[
        form
    ]
    dest = tmp_path / "out" / "bundle.tar"
    progress = Recorder()
    assert download(url, dest, expected_sha256=sha(payload), progress=progress) == sha(payload)
    assert dest.read_bytes() == payload
    assert progress.calls[-1] == (SIZE, SIZE)
    assert leftovers(dest) == []


def test_local_source_errors(payload: bytes, tmp_path: Path) -> None:
    source = tmp_path / "bundle.tar"
    source.write_bytes(payload)
    dest = tmp_path / "out.tar"
    with pytest.raises(DownloadError, match="not found"):
        download((tmp_path / "missing.tar").as_uri(), dest)
    with pytest.raises(DownloadError, match="more than the limit"):
        download(str(source), dest, max_bytes=10)
    with pytest.raises(DownloadError, match="sha256 mismatch"):
        download(str(source), dest, expected_sha256="0" * 64)
    assert not dest.exists() and leftovers(dest) == []


def test_imports_nothing_heavy() -> None:
    # It runs inside the supervisor, which must stay small.
    code = (
        "import sys, edgeserve.ota.download; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'grpc', 'aiohttp', 'zmq'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="not a sha256"):
        download("http://127.0.0.1:9/x", tmp_path / "b", expected_sha256="abc")
    with pytest.raises(DownloadError, match="unsupported URL scheme"):
        download("ftp://example.invalid/x", tmp_path / "b")


# --- https -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("cryptography")
    return self_signed(tmp_path_factory.mktemp("tls"), "edgeserve test", ["127.0.0.1"], ca=True)


def test_https_with_ca_file(tls_files: tuple[Path, Path], payload: bytes, tmp_path: Path) -> None:
    cert_file, key_file = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    with BundleServer(ssl_context=context) as server:
        url = server.add("/b", payload, drop_after=1_000_000, times=1)
        assert url.startswith("https://")
        dest = tmp_path / "b"
        assert download(url, dest, expected_sha256=sha(payload), ca_file=cert_file, backoff_s=0.01) == sha(
            payload
        )
        assert [r.range for r in server.requests("/b")] == [None, "bytes=1000000-"]

        # Without the CA the system trust store rejects the self-signed certificate: no retries.
        with pytest.raises(DownloadError, match="certificate"):
            download(url, tmp_path / "c", attempts=5, backoff_s=1.0)
        assert len(server.requests("/b")) == 2


def test_https_under_the_url_policy_still_checks_the_certificate(
    tls_files: tuple[Path, Path], payload: bytes, tmp_path: Path
) -> None:
    """The policy's own connection (to the checked address) keeps TLS: SNI and the certificate check use
    the URL's host name, not the address connected to."""
    cert_file, key_file = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    lab = UrlPolicy(allow_loopback=True)
    with BundleServer(ssl_context=context) as server:
        url = server.add("/b", payload)
        assert download(
            url, tmp_path / "b", expected_sha256=sha(payload), ca_file=cert_file, url_policy=lab
        ) == sha(payload)
        with pytest.raises(DownloadError, match="certificate"):  # the certificate names 127.0.0.1 only
            download(url.replace("127.0.0.1", "localhost"), tmp_path / "c", ca_file=cert_file, url_policy=lab)
        with pytest.raises(DownloadError, match=r"127\.0\.0\.1 is a loopback address") as info:
            download(url, tmp_path / "d", ca_file=cert_file, url_policy=UrlPolicy())
        assert info.value.reason == "url"
        assert len(server.requests("/b")) == 1


def test_local_sources_under_the_url_policy(payload: bytes, tmp_path: Path) -> None:
    source = tmp_path / "b.tar"
    source.write_bytes(payload)
    with pytest.raises(DownloadError, match="allow_file_urls") as info:
        download(source.as_uri(), tmp_path / "out", url_policy=UrlPolicy())
    assert info.value.reason == "url" and leftovers(tmp_path / "out") == []
    assert download(source.as_uri(), tmp_path / "out", url_policy=UrlPolicy(allow_file=True)) == sha(payload)
