"""The base of every error ssmquant raises for its user.

Each package keeps its own error classes (``formats.FormatError``, ``models.CaptureError``, ...), named where they
are raised; every one derives from ``SsmquantError`` (and keeps its ``ValueError`` / ``RuntimeError`` base), so a
caller catches them all at once: the CLI prints any of them as one ``Error:`` line, status 1.
"""


class SsmquantError(Exception):
    """An error whose message is meant for the user: it names what is wrong and the accepted values or what to do."""


__all__ = ["SsmquantError"]
