"""How a command that cannot be carried out becomes an answer.

Owns :class:`CommandError` (raised anywhere in the package; its text is the answer's message) and
:func:`_fit`, which keeps an answer's text within the controller's ``TEXT_MAX``.
"""

from __future__ import annotations

from vigil.contract.schemas import TEXT_MAX


class CommandError(Exception):
    """A command that cannot or must not be carried out; its text is the answer's message."""


def _fit(text: str, limit: int = TEXT_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
