"""Errors in OpenAI's shape (`{"error": {message, type, param, code}}`): the one way the head's HTTP
layer (routes and the gate in front of them) answers a request it refuses."""

from __future__ import annotations

from fastapi.responses import JSONResponse

CODES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    503: "unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.retry_after = code, retry_after

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.retry_after)


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    retry_after: int | None = None,
    **extra,
) -> JSONResponse:
    """`extra`: fields of a particular error (llama-server's exceed_context_size_error carries
    n_prompt_tokens and n_ctx)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"message": message, "type": type_, "param": param, "code": code or CODES.get(status, str(status)), **extra}
    return JSONResponse({"error": body}, status_code=status, headers=headers)
