"""A RichLog whose lines wrap at its own width and are written again when that width changes."""

from __future__ import annotations

from collections.abc import Callable

from rich.text import Text
from textual.events import Resize
from textual.widgets import RichLog


class WrappedLog(RichLog):
    """RichLog alone wraps at the app console's width, not the panel's, and keeps each line wrapped at
    the width it was written at. This one wraps at its content width and, when that changes (a
    terminal resize, its first layout), calls `rewrite`: its owner writes every line again. Its own
    resize, not the screen's, is the moment its new width is known (a loaded machine lays out later)."""

    def __init__(self, rewrite: Callable[[], None], **kwargs):
        super().__init__(wrap=True, **kwargs)
        self._rewrite = rewrite
        self._wrapped_at = 0

    def write_line(self, text: Text) -> None:
        self.write(text, width=self.scrollable_content_region.width or None)

    def on_resize(self, event: Resize) -> None:  # RichLog's own handler runs too (Textual calls both)
        width = self.scrollable_content_region.width
        if width and width != self._wrapped_at:
            self._wrapped_at = width
            self._rewrite()
