"""A stand-in Hugging Face Hub for tests: a threading http.server on 127.0.0.1 with just the endpoints that
huggingface_hub 2.4.0's `snapshot_download` of a model repository calls.

- `GET /api/models/{owner}/{name}/revision/{rev}`: the repository's info at a revision (`sha`, `siblings`);
- `GET /api/models/{owner}/{name}/tree/{commit}?recursive=...`: the file listing (one page, no Link header);
- `HEAD|GET /{owner}/{name}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length`;
  safetensors files answer as LFS files do on the Hub: a 302 to a second origin (the "CDN", another port) with
  `X-Linked-Etag` / `X-Linked-Size`, the bytes served there.

Errors are answered the way the Hub answers them (huggingface_hub maps them by `X-Error-Code`): a gated repository
401 `GatedRepo` (403 when a token is sent), an unknown repository 401 `RepoNotFound`, an unknown revision 404
`RevisionNotFound`. Every request is recorded in `requests` as (method, path, Authorization header or None).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import urllib.parse

HUB_COMMITS = {"main": "1" * 40, "v1": "2" * 40}  # the test repository's branch and tag (tests/conftest.py)


class Repo:
    """A repository: the files of `folder` (the same at every revision) plus `extra` ({path: bytes}), its
    revisions ({branch or tag: commit}); `gated` answers 401/403."""

    def __init__(self, folder: str, *, revisions: dict[str, str], gated: bool = False,
                 extra: dict[str, bytes] | None = None):
        files = dict(extra or {})  # files a real repository holds beside the checkpoint (images, other formats)
        for top, _, names in os.walk(folder):
            for name in names:
                full = os.path.join(top, name)
                with open(full, "rb") as f:
                    files[os.path.relpath(full, folder).replace(os.sep, "/")] = f.read()
        self.files = files
        self.revisions = dict(revisions)
        for commit in set(revisions.values()):
            self.revisions[commit] = commit
        self.gated = gated

    def commit(self, revision: str) -> str | None:
        return self.revisions.get(revision)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_lfs(path: str) -> bool:
    return path.endswith(".safetensors")


class StandInHub:
    """Serves `repos` ({"owner/name": Repo}); `endpoint` is what HF_ENDPOINT gets."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}
        for repo in repos.values():
            for path, data in repo.files.items():
                if _is_lfs(path):
                    self._blobs[_sha256(data)] = data
        self._hub = self._serve(self._hub_handler())
        self._cdn = self._serve(self._cdn_handler())
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn = f"http://127.0.0.1:{self._cdn.server_address[1]}"

    @staticmethod
    def _serve(handler) -> http.server.ThreadingHTTPServer:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def stop(self) -> None:
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def _record(self, method: str, path: str, auth: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, auth))

    # ----------------------------------------------------------------------------------------------- handlers
    def _hub_handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, str(value))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, message: str, head: bool):
                body = json.dumps({"error": message}).encode()
                self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                          "X-Error-Message": message}, head)

            def _answer(self, head: bool):
                url = urllib.parse.urlsplit(self.path)
                path = urllib.parse.unquote(url.path)
                auth = self.headers.get("Authorization")
                hub._record(self.command, self.path, auth)
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo_id = "/".join(parts[2:4] if api else parts[0:2])
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(401 if auth is None else 404, "RepoNotFound", "Repository not found", head)
                if repo.gated:
                    return self._error(401 if auth is None else 403, "GatedRepo",
                                       "Access to model is restricted and you are not in the authorized list. "
                                       "Visit the model page to ask for access.", head)
                if api and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    revision = "/".join(parts[5:])
                    commit = repo.commit(revision)
                    if commit is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                    if parts[4] == "revision":
                        info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
                                "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
                        return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"},
                                          head)
                    tree = [{"type": "file", "path": p, "size": len(d), "oid": _sha1(d)}
                            | ({"lfs": {"oid": _sha256(d), "size": len(d), "pointerSize": 134}} if _is_lfs(p) else {})
                            for p, d in sorted(repo.files.items())]
                    return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    # the revision is one path segment (huggingface_hub quotes a '/' in it as %2F)
                    revision, file_path = parts[3], "/".join(parts[4:])
                    commit = repo.commit(revision)
                    if commit is None:
                        return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
                    data = repo.files.get(file_path)
                    if data is None:
                        return self._error(404, "EntryNotFound", f"{file_path} does not exist", head)
                    if _is_lfs(file_path):
                        return self._send(302, b"", {"X-Repo-Commit": commit, "ETag": f'"{_sha1(data)}"',
                                                     "X-Linked-Etag": f'"{_sha256(data)}"',
                                                     "X-Linked-Size": len(data),
                                                     "Location": f"{hub.cdn}/blobs/{_sha256(data)}"}, head)
                    return self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{_sha1(data)}"',
                                                  "Content-Type": "application/octet-stream"}, head)
                return self._error(404, "EntryNotFound", f"no endpoint {path}", head)

        return Handler

    def _cdn_handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._record("CDN " + self.command, self.path, self.headers.get("Authorization"))
                data = hub._blobs.get(self.path.rsplit("/", 1)[-1])
                status, body = (200, data) if data is not None else (404, b"not found")
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler
