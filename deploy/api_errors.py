"""The API's errors: OpenAI's error body ({"error": {"message", "type", "param", "code"}}) with an HTTP status."""

STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}
# Every error carries a code: the status's default below unless a more precise one
# is given (context_length_exceeded, unsupported_parameter, unknown_parameter, invalid_body, json_too_deep,
# too_many_messages, model_not_found, queue_full, unhealthy, shutting_down, replica_unavailable: a pipeline replica
# died under the request, or the ingress did and Serve's proxy answers, deploy/replica_errors.py).
ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 500: "internal_error", 503: "unavailable"}
UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or ERROR_CODES.get(status, "error")
        self.type = type or STATUS_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
