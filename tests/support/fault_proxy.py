"""A fault-injecting HTTP proxy of our own, in front of the local GCS emulator, on 127.0.0.1 only.

Point `STORAGE_EMULATOR_HOST` at `proxy.url` and every GCS request of google-cloud-storage and of Beam's GCS
filesystem (this process and its subprocesses) goes through it. For a configurable fraction of the requests that
match a rule it answers 503 or 429, resets the connection (before the request reaches the emulator, after the
emulator has applied it so that only the response is lost, or part-way through the request body: a write cut on the
wire) or delays the response; everything else is forwarded unchanged. It counts every request by kind, every fault it injected, and the retries that followed them.

Request kinds (GCS JSON API, as the clients send it):
    read    GET object metadata or media (prompts, checkpoint shards, images read back)
    list    GET a bucket's object listing (globs, `--skip_existing`, checkpoint listing)
    upload  POST/PUT under /upload/ (image writes, manifest/error shards, summary.json; resumable chunks)
    copy    copyTo / rewriteTo of one object
    delete  DELETE of one object
    batch   POST /batch/storage/v1 (Beam's rename = copy_batch + delete_batch: manifest finalisation)
    bucket  bucket metadata / creation;  other  anything else
Every request also gets the object names it touches (decoded from the path, query, upload body or batch parts), so
a rule can be limited to, e.g., `images/` uploads or `manifest/` finalisation.

Bounded by design: it binds 127.0.0.1 only; each client connection serves at most `max_requests_per_connection`
requests and is dropped after `idle_timeout_s` of silence; request bodies above `max_body_bytes` are refused; every
upstream call has a timeout; the whole proxy stops answering (503) after `max_requests` requests.

    with FaultProxy(emulator.host, seed=1) as proxy:
        proxy.add_rule(FaultRule(fraction=0.1, kinds={"read", "upload", "batch"}))
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
        ...
        print(proxy.stats())
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import http.client
import json
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable

ACTIONS = ("503", "429", "reset", "reset_after", "cut", "delay")
DEFAULT_ACTIONS = ("503", "429", "reset", "delay")
KINDS = ("read", "list", "upload", "copy", "delete", "batch", "bucket", "other")

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "content-length"}
_NAME_IN_BODY = re.compile(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_BATCH_LINE = re.compile(rb"^(GET|POST|PUT|DELETE|PATCH)\s+(\S+)", re.M)
_HEAD_BYTES = 1 << 16  # of a request body, read before deciding: enough for the names classify() looks for


@dataclasses.dataclass
class FaultRule:
    """Inject a fault into `fraction` of the requests that match `kinds` (None: every kind) and whose object
    names match `name` (a regex searched in "bucket/object"; None: any). The action is drawn from `actions`
    (uniformly). `delay_s` is the delay of a "delay" action. With `cut_after_bytes` the rule matches only requests
    whose body is longer than that (a shorter one is through before the cut), and a "cut" action reads that many
    bytes of the body, then drops the connection (at least the up to 64 KiB read to classify the request). The
    first `skip_first` matching requests pass untouched (a link that fails part-way through an upload's chunks);
    `limit` caps the faults this rule injects."""

    fraction: float = 0.1
    kinds: Iterable[str] | None = None
    name: str | None = None
    actions: Iterable[str] = DEFAULT_ACTIONS
    delay_s: float = 0.3
    cut_after_bytes: int | None = None
    skip_first: int = 0
    limit: int | None = None
    injected: int = 0
    skipped: int = 0

    def __post_init__(self):
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        self.kinds = None if self.kinds is None else frozenset(self.kinds)
        bad = (set(self.kinds or ()) - set(KINDS)) | (set(self.actions) - set(ACTIONS))
        if bad:
            raise ValueError(f"unknown kinds/actions {sorted(bad)}; kinds: {KINDS}, actions: {ACTIONS}")
        self.actions = tuple(self.actions)
        self._name_re = re.compile(self.name) if self.name else None

    def matches(self, kind: str, names: list[str], body_bytes: int = 0) -> bool:
        if self.kinds is not None and kind not in self.kinds:
            return False
        if self.cut_after_bytes is not None and body_bytes <= self.cut_after_bytes:
            return False
        if self.limit is not None and self.injected >= self.limit:
            return False
        if self._name_re is not None and not any(self._name_re.search(n) for n in names):
            return False
        if self.skipped < self.skip_first:
            self.skipped += 1
            return False
        return True


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    method: str
    path: str  # without the query
    query: dict
    kind: str
    names: tuple  # "bucket/object" (or "bucket/prefix" for a listing) of everything the request touches


def classify(method: str, raw_path: str, body: bytes = b"", upload_names: dict | None = None) -> RequestInfo:
    """What a GCS JSON API request does and which objects it touches."""
    parsed = urllib.parse.urlsplit(raw_path)
    path = parsed.path
    query = urllib.parse.parse_qs(parsed.query)
    unq = urllib.parse.unquote

    def obj_names(p: str) -> list[str]:
        m = re.match(r"^(?:/storage/v1|/download/storage/v1)?/b/([^/]+)/o/(.+)$", p)
        if not m:
            return []
        bucket, rest = m.group(1), m.group(2)
        m2 = re.match(r"^(.+)/(?:copyTo|rewriteTo)/b/([^/]+)/o/(.+)$", rest)
        if m2:
            return [f"{bucket}/{unq(m2.group(1))}", f"{m2.group(2)}/{unq(m2.group(3))}"]
        return [f"{bucket}/{unq(rest)}"]

    if path.startswith("/batch/"):
        names = []
        for m in _BATCH_LINE.finditer(body[:1 << 20]):
            sub = urllib.parse.urlsplit(m.group(2).decode("latin-1")).path
            names.extend(obj_names(sub[sub.find("/storage/v1"):] if "/storage/v1" in sub else sub))
        return RequestInfo(method, path, query, "batch", tuple(names))
    m = None
    if method in ("POST", "PUT"):
        m = re.match(r"^/upload/storage/v1/b/([^/]+)/o$", path) or re.match(r"^(?:/storage/v1)?/b/([^/]+)/o$", path)
    if m and (path.startswith("/upload/") or "uploadType" in query):
        bucket = m.group(1)
        name = (query.get("name") or [None])[0]
        if name is None:
            found = _NAME_IN_BODY.search(body[:1 << 16])
            if found:
                try:
                    name = json.loads(b'"' + found.group(1) + b'"')
                except ValueError:
                    name = found.group(1).decode("utf-8", "replace")
        upload_id = (query.get("upload_id") or [None])[0]
        if name is None and upload_id and upload_names is not None:
            name = upload_names.get(upload_id)
        return RequestInfo(method, path, query, "upload", (f"{bucket}/{name}",) if name else (f"{bucket}/",))
    if re.match(r"^(?:/storage/v1)?/b/[^/]+/o$", path) and method == "GET":
        bucket = path.rstrip("/").split("/")[-2]
        prefix = (query.get("prefix") or [""])[0]
        return RequestInfo(method, path, query, "list", (f"{bucket}/{prefix}",))
    names = obj_names(path)
    if names:
        if "/copyTo/" in path or "/rewriteTo/" in path:
            kind = "copy"
        elif method == "GET":
            kind = "read"
        elif method == "DELETE":
            kind = "delete"
        else:
            kind = "other"
        return RequestInfo(method, path, query, kind, tuple(names))
    if re.match(r"^(?:/storage/v1)?/b(/[^/]+)?$", path):
        return RequestInfo(method, path, query, "bucket", ())
    return RequestInfo(method, path, query, "other", ())


def data_path_faults(stats: dict) -> tuple[int, int, list]:
    """(faults that fail a request, retries seen after them, faults never retried), leaving out delays and
    bucket-metadata GETs: google-cloud-storage fetches bucket metadata in a background thread that retries on its
    own clock (default back-off from 1 s), so such a retry may still be asleep when the figures are taken."""
    failing = sum(n for key, n in stats["injected"].items()
                  if not key.endswith("/delay") and not key.startswith("bucket/"))
    retried = stats["retries_total"] - stats["retries"].get("bucket", 0)
    return failing, retried, [u for u in stats["unretried"] if u[0] != "bucket"]


class FaultProxy:
    """A threaded HTTP proxy on 127.0.0.1 in front of `upstream` (e.g. "http://127.0.0.1:9023")."""

    def __init__(self, upstream: str, *, seed: int = 0, rules: Iterable[FaultRule] = (), upstream_timeout_s: float = 60.0,
                 idle_timeout_s: float = 30.0, max_requests_per_connection: int = 1000,
                 max_requests: int = 2_000_000, max_body_bytes: int = 256 << 20):
        u = urllib.parse.urlsplit(upstream if "://" in upstream else "http://" + upstream)
        if u.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the fault proxy only fronts a local emulator, got {upstream!r}")
        self.upstream_host, self.upstream_port = "127.0.0.1", u.port or 80
        self.upstream_timeout_s = upstream_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_requests_per_connection = max_requests_per_connection
        self.max_requests = max_requests
        self.max_body_bytes = max_body_bytes
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = list(rules)
        self._upload_names: dict[str, str] = {}
        self._requests = collections.Counter()        # kind -> requests seen
        self._injected = collections.Counter()        # (kind, action) -> faults injected
        self._forwarded = collections.Counter()       # kind -> requests forwarded to the emulator
        self._upstream_errors = collections.Counter()  # kind -> status >= 500 answered by the emulator itself
        # signature -> (faults not yet retried, kind, object names)
        self._pending: dict[str, tuple[int, str, frozenset]] = {}
        self._retries = collections.Counter()         # kind -> re-sent requests after a fault of ours
        self._log: collections.deque = collections.deque(maxlen=2000)  # last (kind, action, names) injected
        self._total = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ configuration
    def add_rule(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            self._rules.append(rule)
        return rule

    def set_rules(self, rules: Iterable[FaultRule]) -> None:
        with self._lock:
            self._rules = list(rules)

    def clear_rules(self) -> None:
        self.set_rules(())

    # ------------------------------------------------------------------------------------------ figures
    def stats(self) -> dict:
        """requests/forwarded/injected/retries by kind, plus totals; a snapshot (plain dicts)."""
        with self._lock:
            injected_by_action = collections.Counter()
            injected_by_kind = collections.Counter()
            for (kind, action), n in self._injected.items():
                injected_by_action[action] += n
                injected_by_kind[kind] += n
            return {
                "requests": dict(self._requests),
                "forwarded": dict(self._forwarded),
                "injected": {f"{k}/{a}": n for (k, a), n in sorted(self._injected.items())},
                "injected_by_action": dict(injected_by_action),
                "injected_by_kind": dict(injected_by_kind),
                "injected_total": sum(self._injected.values()),
                "retries": dict(self._retries),
                "retries_total": sum(self._retries.values()),
                "unretried_faults": sum(n for n, _, _ in self._pending.values()),
                "unretried": sorted((kind, sorted(names)) for _, kind, names in self._pending.values()),
                "upstream_5xx": dict(self._upstream_errors),
                "requests_total": self._total,
            }

    def injected_log(self) -> list[tuple]:
        with self._lock:
            return list(self._log)

    def reset_stats(self) -> None:
        with self._lock:
            for c in (self._requests, self._injected, self._forwarded, self._upstream_errors, self._pending,
                      self._retries):
                c.clear()
            self._log.clear()
            self._total = 0

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        assert self._server is not None, "proxy not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FaultProxy":
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        server = _Server(("127.0.0.1", 0), Handler)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ decisions
    def _decide(self, info: RequestInfo, signature: str, body_bytes: int = 0) -> tuple[str | None, FaultRule | None]:
        """Count the request; pick the fault to inject (or None) and the rule it comes from."""
        with self._lock:
            self._total += 1
            self._requests[info.kind] += 1
            retried = self._retried_signature(info, signature)
            if retried is not None:
                n, kind, names = self._pending.pop(retried)
                if n > 1:
                    self._pending[retried] = (n - 1, kind, names)
                self._retries[info.kind] += 1
            if self._total > self.max_requests:
                return "503", None
            for rule in self._rules:
                if rule.matches(info.kind, list(info.names), body_bytes) and self._rng.random() < rule.fraction:
                    action = self._rng.choice(rule.actions)
                    rule.injected += 1
                    self._injected[(info.kind, action)] += 1
                    self._log.append((info.kind, action, info.names))
                    if action != "delay":
                        n = self._pending.get(signature, (0,))[0]
                        self._pending[signature] = (n + 1, info.kind, frozenset(info.names))
                    return action, rule
            return None, None

    def _retried_signature(self, info: RequestInfo, signature: str) -> str | None:
        """The pending fault this request retries: the same request again, or failing that a request of the same
        kind on one of the same objects (clients may retry differently: a read resumed at another offset, a batch
        re-sent with only the calls that failed). Called under the lock."""
        if signature in self._pending:
            return signature
        names = frozenset(info.names)
        if names:
            for pending, (_, kind, pending_names) in self._pending.items():
                if kind == info.kind and names & pending_names:
                    return pending
        return None

    def _note_forwarded(self, kind: str, status: int) -> None:
        with self._lock:
            self._forwarded[kind] += 1
            if status >= 500:
                self._upstream_errors[kind] += 1

    def _note_upload_location(self, location: str | None, names: tuple) -> None:
        if not location or not names:
            return
        upload_id = (urllib.parse.parse_qs(urllib.parse.urlsplit(location).query).get("upload_id") or [None])[0]
        if upload_id:
            with self._lock:
                if len(self._upload_names) > 100_000:
                    self._upload_names.clear()
                self._upload_names[upload_id] = names[0].split("/", 1)[1]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request, client_address):  # resets and client hang-ups are expected here
        pass


class _ProxyHandler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def setup(self):
        super().setup()
        self.connection.settimeout(self.owner.idle_timeout_s)
        self._served = 0

    def handle(self):
        # BaseHTTPRequestHandler.handle loops while the client keeps the connection alive: bound it in count.
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection and self._served < self.owner.max_requests_per_connection:
            self.handle_one_request()

    # every method the GCS clients use goes through one path
    def do_GET(self):
        self._proxy()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

    def _read_body(self, head_only: bool = False) -> bytes | None:
        """The request body (None: too large or malformed); with `head_only`, of a Content-Length body only its
        first _HEAD_BYTES (the rest is read by _read_rest). A chunked body is always read whole."""
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        limit = self.owner.max_body_bytes
        self._body_left = 0
        if "chunked" in te:
            out = bytearray()
            for _ in range(1_000_000):  # bounded number of chunks
                size_line = self.rfile.readline(1024)
                if not size_line:
                    return None
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                if len(out) + size > limit:
                    return None
                out += self.rfile.read(size)
                self.rfile.readline(1024)
            return None
        length = int(self.headers.get("Content-Length") or 0)
        if length > limit:
            return None
        first = min(length, _HEAD_BYTES) if head_only else length
        self._body_left = length - first
        return self.rfile.read(first) if first else b""

    def _read_rest(self, at_most: int | None = None) -> bytes:
        """What _read_body(head_only=True) left unread (at most `at_most` bytes of it)."""
        n = self._body_left if at_most is None else max(0, min(self._body_left, at_most))
        self._body_left -= n
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        """Abort the TCP connection (RST), as a dropped load balancer connection looks to the client."""
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        try:
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _error(self, status: int, reason: str) -> None:
        body = json.dumps({"error": {"code": status, "message": f"fault-proxy: {reason}",
                                     "errors": [{"message": reason, "reason": reason}]}}).encode()
        headers = [("Content-Type", "application/json; charset=UTF-8")]
        if status == 429:
            headers.append(("Retry-After", "0"))
        self._send(status, headers, body)

    def _proxy(self) -> None:
        self._served += 1
        owner = self.owner
        body = self._read_body(head_only=True)
        if body is None:
            self.close_connection = True
            self._error(413, "request body too large or malformed")
            return
        if (self.headers.get("Connection") or "").lower() == "close":
            self.close_connection = True
        info = classify(self.command, self.path, body, owner._upload_names)
        # What a retry of this request looks like: same method, path and query, same objects (bodies differ between
        # attempts: multipart boundaries are random).
        signature = hashlib.sha1("\0".join((self.command, self.path) + info.names).encode()).hexdigest()
        action, rule = owner._decide(info, signature, len(body) + self._body_left)
        if action == "cut":  # the client got part of the body onto the wire, then the connection dropped
            self._read_rest((rule.cut_after_bytes or 0) - len(body))
            self._reset()
            return
        body += self._read_rest()
        if action == "503":
            self._error(503, "injected 503 Service Unavailable")
            return
        if action == "429":
            self._error(429, "injected 429 Too Many Requests")
            return
        if action == "reset":
            self._reset()
            return
        if action == "delay":
            time.sleep(min(rule.delay_s, 30.0))

        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(owner.upstream_host, owner.upstream_port, timeout=owner.upstream_timeout_s)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, resp_headers = resp.status, resp.getheaders()
        except (OSError, http.client.HTTPException) as e:
            owner._note_forwarded(info.kind, 502)
            self.close_connection = True
            self._error(502, f"upstream error {type(e).__name__}")
            return
        finally:
            conn.close()
        owner._note_forwarded(info.kind, status)
        # Object metadata carries absolute links (mediaLink, selfLink) to the host that stored the object; objects
        # uploaded straight to the emulator would send the client's downloads around the proxy. Point them here.
        # (Only in API responses: object contents, alt=media downloads, are passed through byte for byte.)
        upstream_addr = f"127.0.0.1:{owner.upstream_port}".encode()
        is_media = info.path.startswith("/download/") or (info.query.get("alt") or [""])[0] == "media"
        if not is_media and upstream_addr in data:
            data = data.replace(upstream_addr, f"127.0.0.1:{self.server.server_address[1]}".encode())
        resp_headers = [(k, v.replace(upstream_addr.decode(), f"127.0.0.1:{self.server.server_address[1]}"))
                        for k, v in resp_headers]
        if info.kind == "upload":
            owner._note_upload_location(dict((k.lower(), v) for k, v in resp_headers).get("location"), info.names)
        if action == "reset_after":  # the emulator applied the request; the client never hears back
            self._reset()
            return
        self._send(status, resp_headers, data)


@contextlib.contextmanager
def in_front_of(emulator, monkeypatch, *, seed: int = 0):
    """A FaultProxy in front of the GCS `emulator`, with STORAGE_EMULATOR_HOST pointing at it for one test (the
    emulator fixture's own client is made first, so it keeps talking to the emulator directly)."""
    emulator.client()
    with FaultProxy(emulator.host, seed=seed) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy


def rules_for(rate: float, *, seed_kinds: Iterable[str] = ("read", "list", "upload", "copy", "delete", "batch"),
              actions: Iterable[str] = DEFAULT_ACTIONS, delay_s: float = 0.2) -> list[FaultRule]:
    """One rule per request kind at the same `rate`, so the injected figures come out per class."""
    return [FaultRule(fraction=rate, kinds={k}, actions=actions, delay_s=delay_s) for k in seed_kinds]


__all__ = ["FaultProxy", "FaultRule", "RequestInfo", "classify", "rules_for", "ACTIONS", "DEFAULT_ACTIONS", "KINDS"]
