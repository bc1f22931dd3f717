"""Errors that reach the user as one clear message (no traceback); declared with the contracts."""

from ..contracts.errors import UserError

__all__ = ["UserError"]
