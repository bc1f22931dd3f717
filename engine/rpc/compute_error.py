"""The one error a compute command answers with (status ERROR): the worker refuses the command."""


class ComputeError(Exception):
    """A compute command this worker refuses; the message goes back to the head verbatim."""
