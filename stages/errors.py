"""User-facing errors: one line that names the problem, never a traceback."""


class RaymoeError(ValueError):
    """Bad input (model file, request or flag) that the user can fix."""


class ModelFormatError(RaymoeError):
    """A model file or directory that cannot be read as the model it claims to be."""


class RequestError(RaymoeError):
    """A single request that cannot be served (bad prompt, bad sampling values)."""
