"""Where a LoRA adapter comes from: `[NAME=]SOURCE[:SCALE]` parsed, and SOURCE (a local file or folder, a gs:// object
or prefix, a Hugging Face Hub id with the weight file's name where the repository holds several) made a local file.

An adapter is opened from its header only (`open_adapter`), so the launch checks it without reading its tensors."""

from __future__ import annotations

import dataclasses
import hashlib
import os

from ..errors import LoraError
from ..config.lora_spec import DIFFUSERS_WEIGHT_NAME, LoraSpec
from .lora import check_adapter, plan_adapter, read_deltas
from .safetensors_file import SafetensorsFile


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter opened from its local file's header, checked against the transformer: its plans, its content
    identity (sha256 of the file) and its spec."""

    spec: LoraSpec
    path: str
    plans: dict
    digest: str

    @property
    def identity(self) -> dict:
        """What makes images made with it differ: the file's content and the scale (the model fingerprint's part)."""
        return {"name": self.spec.label, "sha256": self.digest, "scale": self.spec.scale}

    def deltas(self) -> dict:
        """{parameter name: LoraDelta}, the factors read from the file."""
        file = SafetensorsFile(self.path)
        return read_deltas(self.plans, file.read, self.spec.scale)


def local_file(source: str, cache_dir: str | None = None) -> str:
    """The local .safetensors file of a source; LoraError if it cannot be had or is ambiguous."""
    if source.startswith("gs://"):
        return _from_gcs(source, cache_dir)
    if os.path.isfile(source):
        return source
    if os.path.isdir(source):
        return os.path.join(source, _pick([n for n in os.listdir(source) if n.endswith(".safetensors")], source))
    from .hub import is_hub_id

    repo, _, weight = _hub_parts(source)
    if repo and is_hub_id(repo):
        return _from_hub(repo, weight, cache_dir)
    raise LoraError("LoRA source is no local file or folder, gs:// path or Hugging Face Hub id", path=source)


def _pick(names: list[str], where: str) -> str:
    if len(names) == 1:
        return names[0]
    if DIFFUSERS_WEIGHT_NAME in names:
        return DIFFUSERS_WEIGHT_NAME
    if not names:
        raise LoraError("no .safetensors LoRA file there", path=where)
    raise LoraError(f"several .safetensors files there ({sorted(names)[:5]}): name the one to read", path=where)


def _hub_parts(source: str) -> tuple[str, str, str | None]:
    """`owner/name[@rev][/file.safetensors]` -> (owner/name[@rev], '', file or None)."""
    parts = source.split("/")
    if len(parts) >= 3 and parts[-1].endswith(".safetensors"):
        return "/".join(parts[:2]), "", "/".join(parts[2:])
    return source, "", None


def _from_hub(repo: str, weight: str | None, cache_dir: str | None) -> str:
    from .hub import _import_hub, hub_cache_dir, hub_endpoint, parse_hub_id

    hub, ref = _import_hub(repo), parse_hub_id(repo)
    try:
        if weight is None:
            files = hub.HfApi(endpoint=hub_endpoint()).list_repo_files(ref.repo_id, revision=ref.revision)
            weight = _pick([f for f in files if f.endswith(".safetensors")], repo)
        return hub.hf_hub_download(ref.repo_id, weight, revision=ref.revision, cache_dir=cache_dir or hub_cache_dir(),
                                   endpoint=hub_endpoint())
    except LoraError:
        raise
    except Exception as e:  # noqa: BLE001 - every Hub failure is this adapter's one line
        raise LoraError(f"cannot fetch the LoRA from the Hub: {type(e).__name__}: {e}", path=repo) from e


def _from_gcs(uri: str, cache_dir: str | None) -> str:
    from ..storage import gcs
    from .checkpoint import default_cache_root

    bucket_name, name = gcs.split(uri)
    try:
        bucket = gcs.client().bucket(bucket_name)
        if not name.endswith(".safetensors"):
            prefix = name.rstrip("/") + "/"
            names = [b.name[len(prefix):] for b in bucket.list_blobs(prefix=prefix)]
            name = prefix + _pick([n for n in names if n.endswith(".safetensors") and "/" not in n], uri)
        blob = bucket.get_blob(name)
        if blob is None:
            raise LoraError("no such gs:// object", path=uri)
        folder = os.path.join(cache_dir or default_cache_root(), "loras", blob.crc32c.replace("/", "_") if
                              blob.crc32c else "unknown")
        dest = os.path.join(folder, os.path.basename(name))
        if not (os.path.exists(dest) and os.path.getsize(dest) == blob.size):
            os.makedirs(folder, exist_ok=True)
            blob.download_to_filename(dest + ".partial")
            os.replace(dest + ".partial", dest)
        return dest
    except LoraError:
        raise
    except Exception as e:  # noqa: BLE001 - every storage failure is this adapter's one line
        raise LoraError(f"cannot fetch the LoRA from GCS: {type(e).__name__}: {e}", path=uri) from e


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_adapter(spec: LoraSpec, parameters: dict[str, tuple[int, ...]], cache_dir: str | None = None) -> LoraAdapter:
    """The adapter `spec` names, checked from its header against the transformer's `parameters` ({name: torch
    shape}); LoraError naming the offending key otherwise."""
    path = local_file(spec.source, cache_dir)
    file = SafetensorsFile(path)
    shapes = {key: entry[1] for key, entry in file.entries.items()}
    try:
        plans = plan_adapter(shapes, file.metadata)
        check_adapter(plans, shapes, parameters)
    except LoraError as e:
        raise LoraError(str(e).split(" | ")[0], path=path, tensor=e.tensor) from None
    return LoraAdapter(spec, path, plans, file_digest(path))


def open_adapters(specs, parameters: dict[str, tuple[int, ...]], cache_dir: str | None = None) -> list[LoraAdapter]:
    """Every adapter of `specs` (LoraSpec or their `[NAME=]SOURCE[:SCALE]` text), names unique."""
    specs = [s if isinstance(s, LoraSpec) else LoraSpec.parse(s) for s in specs]
    labels = [s.label for s in specs]
    for label in labels:
        if labels.count(label) > 1:
            raise LoraError(f"two adapters named {label!r}: name them NAME=SOURCE", path=label)
    return [open_adapter(s, parameters, cache_dir) for s in specs]


def merged_deltas(adapters: list[LoraAdapter]) -> dict[str, tuple]:
    """{parameter name: (LoraDelta, ...)} of every adapter, all merged into the weights."""
    out: dict[str, tuple] = {}
    for adapter in adapters:
        for name, delta in adapter.deltas().items():
            out[name] = out.get(name, ()) + (delta,)
    return out


def check_loras(specs, config, cache_dir: str | None = None) -> tuple[dict, ...]:
    """The launch's check of the job's adapters against the checkpoint's transformer (`config`: its PipelineConfig),
    from their headers as the weights are checked: each adapter's identity (name, sha256, scale), or LoraError naming
    the key that fits no parameter."""
    from .stored_tensors import stored_tensors  # from the config alone: no JAX at launch

    parameters = stored_tensors(config)["transformer"][0]
    return tuple(a.identity for a in open_adapters(specs, parameters, cache_dir))
