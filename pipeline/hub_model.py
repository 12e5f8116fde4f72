"""What a Hugging Face Hub id given as `--model` becomes at launch: the checkpoint location the workers load.

The launch resolves the id once (model/loading/hub.py: download into the local cache, or the cached snapshot offline); a
failure is a UsageError (exit status 2) that says what to do. On a local runner the workers share this machine and
load the local snapshot folder. On Dataflow no worker talks to the Hub: the launch copies the snapshot to
`{--model_cache or --temp_location}/flux2-klein-models/{owner}--{name}@{commit}/` on gs:// (skipped when a copy of
that commit is already complete there, which its marker object, written last, says) and the workers get that prefix.
"""

from __future__ import annotations

import json
import logging
import os
import time

from model import HubError, HubSnapshot, ModelError, join_gs_uri, resolve_hub, split_gs_uri

from .errors import UsageError

logger = logging.getLogger(__name__)

MODELS_FOLDER = "flux2-klein-models"
SNAPSHOT_MARKER = ".flux2-hub-snapshot.json"
_UPLOAD_THREADS = 8
UPLOAD_RETRY = None  # the retry policy of each file's upload; None: google-cloud-storage's DEFAULT_RETRY


def hub_model(model: str, variant: str | None, *, local_runner: bool, model_cache: str | None,
              temp_location: str | None) -> str:
    """The location the workers load for the Hub id `model`: the local snapshot folder on a local runner, its
    gs:// copy on a remote one. UsageError naming the option for anything that stops it."""
    base = None
    if not local_runner:  # checked before any download
        base = model_cache or temp_location
        if not (base or "").startswith("gs://"):
            given = f"--model_cache={model_cache!r}" if model_cache else f"--temp_location={temp_location!r}"
            raise UsageError(f"--model={model!r} is a Hugging Face Hub id: the launch copies it for the workers to "
                             f"a gs:// prefix, and {given} is not one; give --model_cache=gs://BUCKET/models or a "
                             f"gs:// --temp_location")
    try:
        snapshot = resolve_hub(model, variant)
    except HubError as e:
        raise UsageError(f"--model={model!r}: {e}") from e
    except ModelError as e:
        raise UsageError(f"--model={model!r} cannot be used as a FLUX.2 [klein] checkpoint: {e}") from e
    if local_runner:
        return snapshot.path
    try:
        return copy_snapshot_to_gcs(snapshot, base)
    except Exception as e:  # noqa: BLE001 - any storage failure stops the launch with the prefix named
        raise UsageError(f"--model={model!r}: cannot copy the snapshot to {base}/{MODELS_FOLDER}/ for the workers: "
                         f"{type(e).__name__}: {e}") from e


def copy_snapshot_to_gcs(snapshot: HubSnapshot, base: str) -> str:
    """Copy the snapshot's files under `{base}/flux2-klein-models/{owner}--{name}@{commit}`, the marker last;
    nothing is copied when the marker is already there. Returns that gs:// prefix."""
    from model import gcs_client, upload_files

    uri = join_gs_uri(base, MODELS_FOLDER, snapshot.folder_name)
    bucket_name, prefix = split_gs_uri(uri)
    bucket = gcs_client().bucket(bucket_name)
    marker = bucket.blob(f"{prefix}/{SNAPSHOT_MARKER}")
    if marker.exists():
        logger.info("%s is already at %s", snapshot.ref.text, uri)
        return uri
    files = []
    for top, _, names in os.walk(snapshot.path):  # the snapshot's files are links into huggingface_hub's blobs
        files += sorted(os.path.relpath(os.path.join(top, n), snapshot.path).replace(os.sep, "/") for n in names)
    start = time.monotonic()
    # once every upload has ended, the first failure is raised (the marker is then never written)
    upload_files(bucket, files, source_directory=snapshot.path, prefix=prefix, threads=_UPLOAD_THREADS,
                 retry=UPLOAD_RETRY)
    total = sum(os.path.getsize(os.path.join(snapshot.path, rel)) for rel in files)
    marker.upload_from_string(json.dumps({
        "repo_id": snapshot.ref.repo_id, "revision": snapshot.ref.revision, "commit": snapshot.commit,
        "files": len(files), "bytes": total, "copied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }), content_type="application/json")
    logger.info("copied %s (commit %s, %d files, %.1f MB) to %s for the workers in %.1f s", snapshot.ref.text,
                   snapshot.commit, len(files), total / 1e6, uri, time.monotonic() - start)
    return uri
