"""Typed errors of the model package; each carries the offending value so callers can report it."""


class ModelError(Exception):
    """Base class of every error raised by `model`."""


class CheckpointError(ModelError):
    """The checkpoint folder or one of its files is missing, unreadable or inconsistent."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        self.path = path
        self.tensor = tensor
        parts = [message]
        if tensor is not None:
            parts.append(f"tensor={tensor!r}")
        if path is not None:
            parts.append(f"file={path!r}")
        super().__init__(" | ".join(parts))


class UnsafeWeightsError(CheckpointError):
    """A pickle-based weight file (.bin/.pt/.ckpt/.pth) was found where safetensors are required."""


class LoraError(CheckpointError):
    """A LoRA adapter cannot be applied to this transformer: a key that maps to no parameter, a shape that does not
    match, a text-encoder adapter (only transformer adapters are read), or an unreadable source."""


class HubError(CheckpointError):
    """A Hugging Face Hub model id (`owner/name[@revision]`) cannot be turned into a local snapshot. `model` is the
    id as given, `endpoint` the Hub it was asked of (None when no request was made)."""

    def __init__(self, message: str, *, model: str, endpoint: str | None = None):
        self.model = model
        self.endpoint = endpoint
        self.path = model
        self.tensor = None
        ModelError.__init__(self, message)


class HubDependencyError(HubError):
    """The huggingface_hub package, needed only for Hub ids, is not installed."""


class HubRepoNotFoundError(HubError):
    """The Hub has no such repository, or it is private and no token that can read it was sent."""


class HubGatedRepoError(HubError):
    """The repository is gated: its licence must be accepted on the Hub, and a token of that account sent."""


class HubRevisionNotFoundError(HubError):
    """The repository exists but has no such branch, tag or commit."""


class HubOfflineError(HubError):
    """Offline mode (HF_HUB_OFFLINE) and no complete cached snapshot of the id."""


class HubNetworkError(HubError):
    """The Hub endpoint cannot be reached (or answers with a server error) and no cached snapshot can stand in."""


class ConfigError(ModelError):
    """A config.json value is missing, malformed or describes something this implementation cannot run."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None, value=None):
        self.path = path
        self.key = key
        self.value = value
        parts = [message]
        if key is not None:
            parts.append(f"key={key!r} value={value!r}")
        if path is not None:
            parts.append(f"file={path!r}")
        super().__init__(" | ".join(parts))


class RequestError(ModelError, ValueError):
    """A generate() argument or a job's request is invalid (size, seed, prompt count...); `field` names the
    parameter when there is one, `value` is what it was given."""

    def __init__(self, message: str, *, value=None, field: str | None = None):
        self.value = value
        self.field = field
        super().__init__(message)


class ReferenceImageError(RequestError):
    """A reference image (image-conditioned generation) cannot be used: wrong type or shape, too small, too
    elongated, or a call whose prompts' reference sets do not share one shape signature.

    `index` is the image's position in its prompt's reference list (None when the problem is the lists
    themselves), `prompt_index` the prompt's position, `reason` a short code ("type", "shape", "dtype",
    "too_small", "aspect_ratio", "count", "signature", "size"), `value` the offending value (a size, a ratio, a
    type name, the signatures)."""

    def __init__(self, message: str, *, reason: str, index: int | None = None, prompt_index: int | None = None,
                 value=None):
        self.index = index
        self.prompt_index = prompt_index
        self.reason = reason
        where = [f"reference {index}" if index is not None else None,
                 f"prompt {prompt_index}" if prompt_index is not None else None]
        where = ", ".join(w for w in where if w)
        super().__init__(f"{message} ({where})" if where else message, value=value, field="reference_images")


class NonFiniteImageError(ModelError):
    """`generate()` produced images whose values are not finite (NaN or inf: overflow, broken weights, a kernel
    fault); such pixels are not an image. `images`: {index in the call: model.engine.results.NonFinite}.
    `generate_result()` reports them per image instead of raising."""

    def __init__(self, images: dict):
        self.images = dict(images)
        first = min(self.images)
        super().__init__(f"{len(self.images)} image(s) of the call have non-finite values (first: image {first}, "
                         f"{self.images[first].describe()})")
