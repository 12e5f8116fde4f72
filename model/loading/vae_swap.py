"""`--vae SOURCE` / `LoadSettings.vae`: another VAE in place of the checkpoint's, such as FLUX.2's small decoder
(`full_encoder_small_decoder.safetensors` with its `config.json`, whose `decoder_block_out_channels` make the decoder
narrower than the encoder).

SOURCE is a local folder or gs:// prefix holding `config.json` and one safetensors file (or
`diffusion_pytorch_model.safetensors` among several), a `.safetensors` file (local or gs://) with `config.json`
beside it, or a Hugging Face Hub id `owner/name[@revision]` of such a repository. It is seen as a component folder
(`vae_view`: links to the two files), and the checkpoint as a folder whose `vae/` is that view (`with_vae`: links to
the checkpoint's other folders), so the config reader, the header checks and the loader read it exactly as a
checkpoint's own VAE. `vae_identity` is its content identity (the config's bytes and the weights' crc32c), which goes
into the model fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from ..errors import CheckpointError
from .cache_paths import cache_root

CONFIG = "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"  # the name diffusers gives a component's one weight file


@dataclasses.dataclass(frozen=True)
class VaeFiles:
    """A VAE's config and weight files, local; `folder`: a component folder in diffusers' layout that holds them
    (read as it is: shards, variants), else None (one file, seen through `vae_view`)."""

    config: str
    weights: tuple[str, ...]
    folder: str | None = None


def _local_source(source: str, cache_dir: str | None) -> str:
    """A local path for SOURCE: itself, a copy of a gs:// prefix (the file's folder for a gs:// file) or a Hub
    snapshot (its config and safetensors files only)."""
    if source.startswith("gs://"):
        from .checkpoint import resolve_checkpoint

        is_file = source.lower().endswith(".safetensors")
        folder = resolve_checkpoint(source.rsplit("/", 1)[0] if is_file else source, cache_dir=cache_dir)
        return os.path.join(folder, source.rsplit("/", 1)[1]) if is_file else folder
    from .hub import is_hub_id, parse_hub_id

    if not os.path.exists(source) and is_hub_id(source):
        from huggingface_hub import snapshot_download

        ref = parse_hub_id(source)
        try:
            return snapshot_download(ref.repo_id, revision=ref.revision,
                                     allow_patterns=[CONFIG, "*.safetensors"])
        except Exception as e:  # noqa: BLE001 - any download failure is this source's
            raise CheckpointError(f"--vae cannot be fetched from the Hugging Face Hub: {type(e).__name__}: {e}",
                                  path=source) from e
    return source


def vae_files(source: str, cache_dir: str | None = None) -> VaeFiles:
    """The config and weight file of a VAE SOURCE; CheckpointError naming what is missing or ambiguous."""
    path = _local_source(source, cache_dir)
    if os.path.isfile(path):
        if not path.lower().endswith(".safetensors"):
            raise CheckpointError("--vae must be a folder or a .safetensors file (with config.json beside it)",
                                  path=source)
        config = os.path.join(os.path.dirname(path), CONFIG)
        weights = path
    elif os.path.isdir(path):
        config = os.path.join(path, CONFIG)
        found = sorted(n for n in os.listdir(path) if n.lower().endswith(".safetensors"))
        diffusers = [n for n in found if n.startswith(WEIGHTS.split(".")[0])]
        if diffusers and os.path.isfile(config):  # a component folder as diffusers saves one: read as it is
            return VaeFiles(os.path.abspath(config), tuple(os.path.abspath(os.path.join(path, n)) for n in diffusers),
                            os.path.abspath(path))
        if len(found) != 1:
            example = os.path.join(source, found[0] if found else "vae.safetensors")
            raise CheckpointError(f"--vae folder holds {len(found)} safetensors files ({', '.join(found) or 'none'}); "
                                  f"name the one to use, e.g. --vae={example}", path=source)
        weights = os.path.join(path, found[0])
    else:
        raise CheckpointError("--vae does not exist (a folder, a .safetensors file, gs:// or a Hub id owner/name)",
                              path=source)
    if not os.path.isfile(config):
        raise CheckpointError(f"--vae has no {CONFIG} beside its weights (the VAE's diffusers config, e.g. "
                              f"AutoencoderKLFlux2's)", path=config)
    return VaeFiles(os.path.abspath(config), (os.path.abspath(weights),))


def vae_identity(files: VaeFiles) -> str:
    """The VAE's content identity: sha256 of its config's bytes and its weights' crc32c (read once per machine)."""
    from .content_ids import file_crc32c

    with open(files.config, "rb") as f:
        config = f.read()
    crcs = file_crc32c(list(files.weights))
    text = json.dumps({"config_sha256": hashlib.sha256(config).hexdigest(),
                       "weights": [[crcs[w], os.path.getsize(w)] for w in files.weights]}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _links(folder: str, targets: dict[str, str]) -> str:
    """`folder` holding a link per name to its target, made once (atomically: built aside, then renamed)."""
    if os.path.isdir(folder):
        return folder
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    building = f"{folder}.{os.getpid()}.tmp"
    os.makedirs(building, exist_ok=True)
    for name, target in targets.items():
        if not os.path.lexists(os.path.join(building, name)):
            os.symlink(target, os.path.join(building, name))
    try:
        os.rename(building, folder)
    except OSError:  # made meanwhile by another process: theirs is the same
        import shutil

        shutil.rmtree(building, ignore_errors=True)
    return folder


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def vae_view(files: VaeFiles) -> str:
    """A component folder holding the VAE as a checkpoint's vae/ does: config.json and its weight file(s)."""
    if files.folder is not None:
        return files.folder
    folder = os.path.join(cache_root(), "vae-views", _key(files.config, *files.weights))
    return _links(folder, {CONFIG: files.config, WEIGHTS: files.weights[0]})


def with_vae(root: str, files: VaeFiles) -> str:
    """A checkpoint folder that is `root` with its vae/ replaced by the VAE of `files` (links; `root` untouched)."""
    root = os.path.abspath(root)
    targets = {name: os.path.join(root, name) for name in os.listdir(root) if name != "vae"}
    targets["vae"] = vae_view(files)
    return _links(os.path.join(cache_root(), "vae-checkpoints", _key(root, files.config, *files.weights)), targets)
