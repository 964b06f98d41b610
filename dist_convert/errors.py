"""The one exception type users see: a one-line message naming the cause and the fix."""
from __future__ import annotations


class ConvertError(Exception):
    """A problem with the input or the request. ``str(e)`` is shown to the user as one line."""

    def __init__(self, cause: str, fix: str | None = None) -> None:
        self.cause = cause
        self.fix = fix
        self.local = False  # True when only this rank hit it: that rank prints it, whatever its rank
        self.group_broken = False  # a collective failed: the process group cannot be used any more
        self.quiet = False  # another rank says the cause: this one stops without a line of its own
        super().__init__(f"{cause}; {fix}" if fix else cause)

    def add_fix(self, more: str) -> None:
        self.fix = f"{self.fix}; {more}" if self.fix else more
        self.args = (f"{self.cause}; {self.fix}",)
