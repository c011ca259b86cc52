"""User-facing errors: one line that names the problem, never a traceback."""


class RaymoeError(ValueError):
    """Bad input (model file, request or flag) that the user can fix."""


class ModelFormatError(RaymoeError):
    """A model file or directory that cannot be read as the model it claims to be."""


class RequestError(RaymoeError):
    """A single request that cannot be served (bad prompt, bad sampling values)."""


def unwrap(error: Exception) -> Exception:
    """The user-facing error inside a Ray task error (its `cause`, however deep), if there is one."""
    cause = getattr(error, "cause", None)
    while cause is not None and not isinstance(cause, RaymoeError) and getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return cause if isinstance(cause, RaymoeError) else error


def check_json_size(value, name: str, limit: int):
    """RequestError unless the request field `name` holds JSON values of at most `limit` bytes."""
    import json
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError) as e:
        raise RequestError(f"{name} must hold JSON values ({' '.join(str(e).split())})") from None
    if size > limit:
        raise RequestError(f"{name} is {size} bytes as JSON; at most {limit} are allowed")
