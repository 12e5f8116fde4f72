"""A real local GCS for tests: gcp-storage-emulator served in-process on 127.0.0.1 (random free port).

Everything talks to it through the real clients: google-cloud-storage and Beam's GCS filesystem both read
`STORAGE_EMULATOR_HOST`. gcp-storage-emulator (not fake-gcs-server) because Beam's file sinks finalize through GCS
batch requests (copy_batch/delete_batch), which it supports.

`start_emulator()` also makes the environment safe and fast for it (see docs/beam-notes.md):
- `NO_GCE_CHECK=true` and an empty `GOOGLE_APPLICATION_CREDENTIALS`, so nothing probes the metadata server and
  no real credentials are sent to the emulator;
- Beam's credential cache is seeded ("no credentials") in this process, and through a `sitecustomize.py` put on
  `PYTHONPATH` in every Python subprocess (multi-process DirectRunner workers, `python -m pipeline.run`), which
  otherwise each spend ~20 s in Beam's credential retry loop before connecting anonymously.

The emulator ignores generation preconditions; `start_emulator()` adds `ifGenerationMatch` to object uploads and
deletes (412 when it does not hold, checked and applied atomically) as GCS has it, which compile leases rely on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import uuid

_SITECUSTOMIZE = '''\
# Written by tests/support/gcs_emulator.py: when a process talks to the local GCS emulator, seed Beam's credential cache
# as soon as Beam's auth module is imported (lazily, so processes that never import Beam pay nothing).
import os
import sys

if os.environ.get("STORAGE_EMULATOR_HOST"):
    import importlib.abc
    import importlib.util

    _TARGET = "apache_beam.internal.gcp.auth"

    class _SeedBeamCredentials(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_seed(module):
                exec_module(module)
                module._Credentials._credentials_init = True
                module._Credentials._credentials = None

            spec.loader.exec_module = exec_and_seed
            return spec

    sys.meta_path.insert(0, _SeedBeamCredentials())
'''


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_beam_credentials() -> None:
    """Make Beam treat this process as having no credentials (it then connects anonymously, as the emulator wants)."""
    from apache_beam.internal.gcp import auth

    auth._Credentials._credentials_init = True
    auth._Credentials._credentials = None


class GcsEmulator:
    """A running emulator plus helpers that use the real google-cloud-storage client."""

    def __init__(self, server, host: str, sitecustomize_dir: str, saved_env: dict):
        self._server = server
        self.host = host  # e.g. http://127.0.0.1:41234
        self.sitecustomize_dir = sitecustomize_dir
        self._saved_env = saved_env
        self._client = None

    # -- clients and buckets
    def client(self):
        if self._client is None:
            from google.cloud import storage

            self._client = storage.Client(project="test-project")
        return self._client

    def new_bucket(self, prefix: str = "test") -> str:
        """Create a fresh bucket with a unique name; returns the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(name)
        return name

    # -- objects
    def upload_bytes(self, uri: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        bucket, name = split(uri)
        self.client().bucket(bucket).blob(name).upload_from_string(data, content_type=content_type)

    def upload_dir(self, local_dir: str, uri: str) -> int:
        """Copy a local folder tree to `gs://bucket/prefix`; returns the number of objects written."""
        bucket, prefix = split(uri)
        b = self.client().bucket(bucket)
        n = 0
        for root, _dirs, files in os.walk(local_dir):
            for fname in sorted(files):
                path = os.path.join(root, fname)
                rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
                b.blob(f"{prefix.rstrip('/')}/{rel}" if prefix else rel).upload_from_filename(path)
                n += 1
        return n

    def read_bytes(self, uri: str) -> bytes:
        bucket, name = split(uri)
        return self.client().bucket(bucket).blob(name).download_as_bytes()

    def list_blobs(self, uri_prefix: str) -> dict:
        """{object name: blob} under `gs://bucket/prefix`."""
        bucket, prefix = split(uri_prefix)
        return {b.name: b for b in self.client().list_blobs(bucket, prefix=prefix)}

    def corrupt_object(self, uri: str, data: bytes) -> None:
        """Replace an object's stored bytes *without* updating its metadata (crc32c/md5 keep describing the old
        bytes): what bit rot or a truncated copy looks like from a client. Uses the emulator's storage directly."""
        bucket, name = split(uri)
        storage = self._server._storage
        storage._store.write_bytes(storage._object_path(bucket, name), data)

    # -- lifecycle
    def __enter__(self) -> "GcsEmulator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.stop()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def split(uri: str) -> tuple[str, str]:
    assert uri.startswith("gs://"), uri
    bucket, _, name = uri[len("gs://"):].partition("/")
    return bucket, name


_preconditions = threading.Lock()


def _with_generation_match(handler, name_of):
    """`handler` that first checks the request's `ifGenerationMatch` against the object's generation (0: absent)."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound

    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        with _preconditions:
            bucket = request.params["bucket_name"]
            try:
                generation = str(storage.get_file_obj(bucket, name_of(request)).get("generation") or "0")
            except NotFound:
                generation = "0"
            if generation != str(wanted[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                                                  "specified did not hold."}})
                return None
            return handler(request, response, storage, *args, **kwargs)

    return checked


def _add_generation_preconditions() -> None:
    """Make the emulator's object insert and delete honour `ifGenerationMatch` (once per process)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if getattr(objects, "_generation_match", False):
        return

    def upload_name(request):
        if "name" in request.query:
            return request.query["name"][0]
        return (request.data.get("meta") or {}).get("name") if isinstance(request.data, dict) else None

    insert = _with_generation_match(objects.insert, upload_name)
    delete = _with_generation_match(objects.delete, lambda request: request.params["object_id"])
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler is objects.insert:
                handlers[method] = insert
            elif handler is objects.delete:
                handlers[method] = delete
    objects.insert = insert  # the router's fallback for uploads posted without the /upload prefix
    objects._generation_match = True


def start_emulator() -> GcsEmulator:
    """Start an in-memory emulator and point this process (and its future subprocesses) at it; `stop()` or a
    `with` block ends it and restores the environment."""
    import logging

    from gcp_storage_emulator.server import create_server

    # Its per-request warnings ("Content handled as string") would flood the logs of any failing test.
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    _add_generation_preconditions()
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    # Its serving thread is not a daemon: a process that ends without stop() (an exception, a script that forgot)
    # would wait on it forever after its last line.
    server._api.daemon = True
    server.start()
    host = f"http://127.0.0.1:{port}"

    site_dir = tempfile.mkdtemp(prefix="gcs-emulator-site-")
    with open(os.path.join(site_dir, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)

    env = {
        "STORAGE_EMULATOR_HOST": host,
        "NO_GCE_CHECK": "true",
        "GOOGLE_APPLICATION_CREDENTIALS": "",
        "GOOGLE_CLOUD_PROJECT": "test-project",
        "PYTHONPATH": os.pathsep.join(p for p in (site_dir, os.environ.get("PYTHONPATH")) if p),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    seed_beam_credentials()
    return GcsEmulator(server, host, site_dir, saved)
