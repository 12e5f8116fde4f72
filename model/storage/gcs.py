"""The one Google Cloud Storage client and gs:// URIs.

`client()` is how every part of the project reaches GCS: the machine's credentials (application default
credentials), or an anonymous client where there are none (public buckets still read), or the local emulator that
`STORAGE_EMULATOR_HOST` names (tests). A fresh client per call, so the endpoint is the one the environment says now.
"""

from __future__ import annotations

import logging
import os

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

SCHEME = "gs://"


def client():
    """A google-cloud-storage client: the emulator's where STORAGE_EMULATOR_HOST is set, else with this machine's
    credentials, else anonymous (logged: only public buckets can then be read)."""
    from google.cloud import storage

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or "emulator")
    try:
        return storage.Client()
    except Exception as e:  # no credentials on this machine: public buckets still work anonymously
        logger.info("no Google Cloud credentials (%s); using Cloud Storage anonymously (public buckets only)", e)
        return storage.Client.create_anonymous_client()


def is_gs(uri) -> bool:
    return isinstance(uri, str) and uri.startswith(SCHEME)


def split(uri: str) -> tuple[str, str]:
    """`gs://bucket/some/prefix/` -> ("bucket", "some/prefix"): no slash at either end of the name ("" for a whole
    bucket). CheckpointError naming the text for one that is no gs:// URI or names no bucket."""
    if not is_gs(uri):
        raise CheckpointError("not a gs:// URI", path=uri)
    bucket, _, name = uri[len(SCHEME):].partition("/")
    if not bucket:
        raise CheckpointError("gs:// URI has no bucket", path=uri)
    return bucket, name.strip("/")


def split_object(uri: str) -> tuple[str, str]:
    """`gs://bucket/a/b` -> ("bucket", "a/b"), the object name exactly as written (a trailing '/' kept: a folder's
    prefix); no check beyond the scheme's."""
    bucket, _, name = uri[len(SCHEME):].partition("/")
    return bucket, name


def join(base: str, *parts: str) -> str:
    """`base` (gs://bucket[/prefix][/]) with `parts` appended, one '/' between each: `join("gs://b/x/", "y")` ->
    "gs://b/x/y"."""
    out = base.rstrip("/")
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}"
    return out


def uri(bucket: str, name: str) -> str:
    """The gs:// URI of object `name` in `bucket`."""
    return f"{SCHEME}{bucket}/{name}"
