"""What an image was made from, as two short digests stored with it (manifest rows, sidecar rows, image text), so
that `--skip_existing` can tell a kept image from a stale one without reading the image.

    request fingerprint   the generation fields of one image task that decide its pixels: prompt, seed, size,
                          steps, guidance, the references' sha256 and processed sizes
    model fingerprint     the checkpoint by content (its configs' bytes, the name, size and crc32c of each other
                          file: `model.loading.checkpoint.checkpoint_digest`, so any changed tensor changes it), dtype,
                          max_sequence_length and the text encoder's output layers, and a --vae's content identity

Each is the sha256 of a canonical JSON object, cut to FINGERPRINT_HEX hex digits. Both are recorded through the
image-identity record (transforms/identity.py); a task computes its request fingerprint once
(`ImageTask.request_fingerprint`). Pure functions: no Beam, no I/O.
"""

from __future__ import annotations

import hashlib
import json

FINGERPRINT_HEX = 32  # 128 bits: collisions are out of reach for any number of images a job holds
VERSION = 1  # bumped if what a fingerprint covers changes, so old rows read as different


def _digest(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX]


def request_fingerprint(task) -> str:
    """The fingerprint of an ImageTask: every request field that changes its pixels (the model's defaults for
    steps/guidance a request leaves unset are covered by the model fingerprint)."""
    r = task.request
    fields = {
        "v": VERSION,
        "prompt": r.prompt,
        "seed": int(task.seed),
        "height": int(r.height),
        "width": int(r.width),
        "num_inference_steps": None if r.num_inference_steps is None else int(r.num_inference_steps),
        "guidance_scale": None if r.guidance_scale is None else float(r.guidance_scale),
        "reference_sha256": list(r.reference_sha256),
        "reference_sizes": [list(s) for s in r.reference_signature],
    }
    if r.lora:  # the per-record adapter by content and scale; images without one keep the fingerprint they had
        fields["lora"] = {"sha256": r.lora_sha256, "scale": float(r.lora_scale)}
    return _digest(fields)


def model_fingerprint(checkpoint_digest: str, *, dtype: str, max_sequence_length: int,
                      text_encoder_out_layers=(), quantize: str = "none", loras=(), vae: str | None = None,
                      scoring: dict | None = None) -> str:
    """The fingerprint of the model a job loads: its checkpoint's digest and the load settings that change pixels
    (an int8 model's images are another model's: a resume never mixes them with bf16 ones). `loras`: the merged LoRA
    adapters' identities ({name, sha256, scale}, model.loading.lora_source): another adapter or scale is another
    model. `scoring` (`scoring_identity`): what scored the images, so that a resume with another score model, labels
    or heads never keeps rows whose scores another setting computed."""
    settings = {
        "v": VERSION,
        "checkpoint": checkpoint_digest,
        "dtype": dtype,
        "max_sequence_length": int(max_sequence_length),
        "text_encoder_out_layers": [int(k) for k in text_encoder_out_layers],
    }
    if quantize != "none":  # unquantized models keep the fingerprint they always had (their outputs still resume)
        settings["quantize"] = quantize
    if loras:  # models without adapters keep the fingerprint they always had
        settings["loras"] = [{"sha256": lora["sha256"], "scale": float(lora["scale"])} for lora in loras]
    if vae:  # --vae: the swapped VAE's content identity (model/loading/vae_swap.py vae_identity)
        settings["vae"] = vae
    if scoring:  # unscored outputs keep theirs too
        settings["scoring"] = scoring
    return _digest(settings)


def scoring_identity(score_settings, rules=()) -> dict | None:
    """What scores a job's images (model.config.score_settings.ScoreSettings), as the model fingerprint records it, and
    the score filters' rules where a resume cannot apply them again to kept images (`rules`: WebDataset shards are
    packed whole); None without --score_model."""
    if score_settings is None:
        return None
    identity = {"score_model": score_settings.model, "labels": list(score_settings.labels),
                "heads": [list(h) for h in score_settings.heads]}
    if rules:
        identity["rules"] = [r.text for r in rules]
    return identity
