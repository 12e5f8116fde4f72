"""The fault-injecting proxy (tests/support/fault_proxy.py) itself: it classifies GCS requests, is transparent without rules,
injects each fault the way a client sees it, and the real clients (google-cloud-storage through Beam's GCS
filesystem) ride over a 30% fault rate with every byte intact while the proxy counts faults and retries."""

import os
import time

import pytest
import requests

from fault_proxy import FaultProxy, FaultRule, classify, data_path_faults, in_front_of


@pytest.fixture
def fast_gcs_retries(monkeypatch):
    """Beam's GCS retry policy (same predicate: what is retried) with short back-off, so faults cost tenths of a
    second instead of seconds in CI."""
    from apache_beam.io.gcp import gcsio_retry

    fast = gcsio_retry.DEFAULT_RETRY_WITH_THROTTLING_COUNTER.with_delay(initial=0.02, maximum=0.2, multiplier=2)
    monkeypatch.setattr(gcsio_retry, "DEFAULT_RETRY_WITH_THROTTLING_COUNTER", fast.with_timeout(30))
    return fast


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
    with in_front_of(gcs_emulator, monkeypatch, seed=7) as p:
        yield p


def test_classify_gcs_requests():
    up = {"u1": "folder/images/a.png"}
    cases = [
        ("GET", "/download/storage/v1/b/bk/o/in%2Fp.jsonl?alt=media", b"", "read", ("bk/in/p.jsonl",)),
        ("GET", "/storage/v1/b/bk/o/models%2Fx%2Fconfig.json?fields=name", b"", "read", ("bk/models/x/config.json",)),
        ("GET", "/storage/v1/b/bk/o?prefix=out%2Fimages%2F&pageToken=x", b"", "list", ("bk/out/images/",)),
        ("POST", "/upload/storage/v1/b/bk/o?uploadType=resumable", b'{"name": "out/images/a.png"}', "upload",
         ("bk/out/images/a.png",)),
        ("POST", "/upload/storage/v1/b/bk/o?uploadType=multipart&name=out%2Fsummary.json", b"--x", "upload",
         ("bk/out/summary.json",)),
        ("PUT", "/upload/storage/v1/b/bk/o?uploadType=resumable&upload_id=u1", b"\x89PNG", "upload",
         ("bk/folder/images/a.png",)),
        ("POST", "/storage/v1/b/bk/o/tmp%2Fa/copyTo/b/bk/o/manifest%2Fm.jsonl", b"", "copy",
         ("bk/tmp/a", "bk/manifest/m.jsonl")),
        ("DELETE", "/storage/v1/b/bk/o/tmp%2Fa", b"", "delete", ("bk/tmp/a",)),
        ("POST", "/batch/storage/v1",
         b"--b\r\nContent-Type: application/http\r\n\r\nPOST /storage/v1/b/bk/o/t%2F1/copyTo/b/bk/o/manifest%2Fm-1"
         b"?prettyPrint=false HTTP/1.1\r\n\r\n--b\r\n\r\nDELETE https://h/storage/v1/b/bk/o/t%2F1 HTTP/1.1\r\n--b--",
         "batch", ("bk/t/1", "bk/manifest/m-1", "bk/t/1")),
        ("GET", "/storage/v1/b/bk?projection=noAcl", b"", "bucket", ()),
    ]
    for method, path, body, kind, names in cases:
        info = classify(method, path, body, up)
        assert (info.kind, info.names) == (kind, names), (method, path, info)


def test_transparent_without_rules(proxy, gcs_emulator, gcs_bucket):
    from apache_beam.io.filesystems import FileSystems

    b = f"gs://{gcs_bucket}"
    payloads = {f"{b}/images/x{i}.png": bytes([i]) * (1000 + i) for i in range(3)}
    for uri, data in payloads.items():
        with FileSystems.create(uri) as f:
            f.write(data)
    assert sorted(m.path for m in FileSystems.match([f"{b}/images/*.png"])[0].metadata_list) == sorted(payloads)
    FileSystems.rename([f"{b}/images/x0.png"], [f"{b}/manifest/m.jsonl"])
    for uri, data in payloads.items():
        target = uri if not uri.endswith("x0.png") else f"{b}/manifest/m.jsonl"
        assert gcs_emulator.read_bytes(target) == data  # read straight from the emulator, not through the proxy
    s = proxy.stats()
    assert s["injected_total"] == 0 and s["retries_total"] == 0
    assert s["requests"]["upload"] >= 3 and s["requests"]["batch"] >= 1 and s["requests"]["list"] >= 1


def test_each_fault_reaches_the_client_as_it_would_from_gcs(proxy, gcs_emulator, gcs_bucket):
    gcs_emulator.upload_bytes(f"gs://{gcs_bucket}/in/p.txt", b"hello")
    url = f"{proxy.url}/download/storage/v1/b/{gcs_bucket}/o/in%2Fp.txt?alt=media"
    with requests.Session() as s:
        for action, check in [
            ("503", lambda r: r.status_code == 503 and "fault-proxy" in r.text),
            ("429", lambda r: r.status_code == 429 and r.headers.get("Retry-After") == "0"),
        ]:
            proxy.set_rules([FaultRule(fraction=1.0, actions=(action,), limit=1)])
            assert check(s.get(url, timeout=10)), action
            assert s.get(url, timeout=10).content == b"hello"  # the rule's limit is spent: forwarded again
        proxy.set_rules([FaultRule(fraction=1.0, actions=("reset",), limit=1)])
        with pytest.raises(requests.ConnectionError):
            s.get(url, timeout=10)
        proxy.set_rules([FaultRule(fraction=1.0, actions=("delay",), delay_s=0.5, limit=1)])
        start = time.monotonic()
        assert s.get(url, timeout=10).content == b"hello"
        assert time.monotonic() - start >= 0.5
        # reset_after: the emulator applied the write, only the answer is lost.
        proxy.set_rules([FaultRule(fraction=1.0, actions=("reset_after",), kinds={"upload"}, limit=1)])
        with pytest.raises(requests.ConnectionError):
            s.post(f"{proxy.url}/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name=w.bin", data=b"xyz",
                   timeout=10)
    assert gcs_emulator.read_bytes(f"gs://{gcs_bucket}/w.bin") == b"xyz"
    s = proxy.stats()
    assert s["injected_by_action"] == {"503": 1, "429": 1, "reset": 1, "delay": 1, "reset_after": 1}
    assert s["retries"]["read"] == 3  # each read fault was followed by the same request again


def test_real_clients_ride_over_30_percent_faults(proxy, gcs_emulator, gcs_bucket, fast_gcs_retries):
    from apache_beam.io.filesystems import FileSystems

    b = f"gs://{gcs_bucket}"
    proxy.set_rules([FaultRule(fraction=0.3, actions=("503", "429", "reset", "delay"), delay_s=0.05)])
    payloads = {f"{b}/images/y{i}.png": os.urandom(3000 + i) for i in range(12)}
    for uri, data in payloads.items():
        with FileSystems.create(uri) as f:
            f.write(data)
        with FileSystems.open(uri) as f:
            assert f.read() == data
    FileSystems.rename([f"{b}/images/y0.png", f"{b}/images/y1.png"], [f"{b}/manifest/a", f"{b}/manifest/b"])
    listed = {m.path for m in FileSystems.match([f"{b}/**"])[0].metadata_list}
    expected = (set(payloads) - {f"{b}/images/y0.png", f"{b}/images/y1.png"}) | {f"{b}/manifest/a",
                                                                                   f"{b}/manifest/b"}
    assert listed == expected
    proxy.clear_rules()
    for uri, data in payloads.items():
        target = {f"{b}/images/y0.png": f"{b}/manifest/a", f"{b}/images/y1.png": f"{b}/manifest/b"}.get(uri, uri)
        assert gcs_emulator.read_bytes(target) == data
    s = proxy.stats()
    failing, retried, unretried = data_path_faults(s)  # each fault on the data path was retried
    assert failing >= 5, s
    assert (retried, unretried) == (failing, []), s


def test_name_filter_limits_faults_to_matching_objects(proxy, gcs_bucket, fast_gcs_retries):
    from apache_beam.io.filesystems import FileSystems

    b = f"gs://{gcs_bucket}"
    proxy.set_rules([FaultRule(fraction=1.0, kinds={"upload"}, name=r"/images/", actions=("503",), limit=3)])
    with FileSystems.create(f"{b}/other/z.bin") as f:
        f.write(b"z")
    assert proxy.stats()["injected_total"] == 0
    with FileSystems.create(f"{b}/images/z.png") as f:
        f.write(b"z")
    log = proxy.injected_log()
    assert len(log) == 3 and all(kind == "upload" and names == (f"{gcs_bucket}/images/z.png",)
                                 for kind, _a, names in log), log


def test_cut_drops_the_connection_part_way_through_long_bodies_only(proxy, gcs_emulator, gcs_bucket):
    """A "cut" rule: bodies no longer than `cut_after_bytes` go through (done before the cut), the first
    `skip_first` longer ones too, and every later one loses its connection part-way and never reaches the emulator."""
    proxy.set_rules([FaultRule(fraction=1.0, kinds={"upload"}, name=r"/w\d\.bin$", actions=("cut",),
                               cut_after_bytes=1000, skip_first=1)])
    url = f"{proxy.url}/upload/storage/v1/b/{gcs_bucket}/o?uploadType=media&name="
    with requests.Session() as s:
        assert s.post(url + "w1.bin", data=b"s" * 1000, timeout=10).ok  # not longer than the cut
        assert s.post(url + "w2.bin", data=b"k" * 5000, timeout=10).ok  # skipped
        with pytest.raises(requests.ConnectionError):
            s.post(url + "w3.bin", data=b"c" * 300_000, timeout=10)
    assert gcs_emulator.read_bytes(f"gs://{gcs_bucket}/w2.bin") == b"k" * 5000
    assert set(gcs_emulator.list_blobs(f"gs://{gcs_bucket}/")) == {"w1.bin", "w2.bin"}
    assert proxy.stats()["injected"] == {"upload/cut": 1}
