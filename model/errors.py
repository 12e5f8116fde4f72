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
