"""Errors that reach the user as one clear message (no traceback)."""


class UserError(Exception):
    """Bad input from the user: a model file, a flag, a prompt, a split. The CLI prints it and exits 2."""
