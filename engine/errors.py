"""Errors that reach the user as one clear message (no traceback); declared with the contracts. Also
the kinds of failure the HTTP layer tells apart by type (never by message text)."""

from ..contracts.errors import UserError

__all__ = ["ContextOverflow", "KVPoolFull", "Overloaded", "Unavailable", "UserError", "describe"]


class Unavailable(Exception):
    """Something a request needs is gone for now (a peer): the request fails with HTTP 503, and a
    retry may succeed. Defined here so the engine and the API can name it without importing rpc."""

    retry_after = 2  # seconds, the HTTP Retry-After: about one peer-watch poll


class Overloaded(Unavailable):
    """The engine's request queue is full (`--max-queue`): shed at once rather than queue for minutes."""

    retry_after = 1


class ContextOverflow(UserError):
    """A prompt that leaves no room in a slot's context (llama-server's exceed_context_size_error:
    HTTP 400 carrying both numbers)."""

    param = "prompt"

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"
        )
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


def describe(e: BaseException) -> str:
    """`Type: message`, the one line an error is reported as."""
    return f"{type(e).__name__}: {e}"


class KVPoolFull(UserError):
    """A `--kv-unified` pool has too few free blocks: for a step (nothing of it was computed), or
    for a request beside the others (the scheduler ended it). Mid-generation it answers as
    llama-server's does: HTTP 500 saying the context size has been exceeded."""
