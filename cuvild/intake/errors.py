"""The intake's refusal, importable without torch: the daemon raises it again for an archive
its inspector refused (cuvild/intake/summary.py), and imports no torch for that."""

from __future__ import annotations


class UnsafeArchive(ValueError):
    """Raised for every rejected archive: malformed, over a limit, or carrying unsafe content.

    ``entry`` is the offending zip entry (relative to the archive root), or ``"<archive>"``
    for problems with the file as a whole; ``reason`` says what was wrong.
    """

    def __init__(self, entry: str, reason: str) -> None:
        super().__init__(f"{entry}: {reason}")
        self.entry = entry
        self.reason = reason
