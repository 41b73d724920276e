"""How messages name counts of things: `1 tensor`, `3 tensors`, `2 bytes entries`.

Errors from the library and lines from the CLI both count things; one function keeps
their wording the same.
"""

from __future__ import annotations


def counted(n: int, word: str, plural: str | None = None) -> str:
    """`n word`, with `plural` (default: `word` + "s") unless n is 1."""
    return f"{n} {word if n == 1 else (plural or word + 's')}"
