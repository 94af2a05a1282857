"""The one error of this package: a constraint we refuse (the API answers it with a 400)."""

from __future__ import annotations


class ConstraintError(ValueError):
    """A constraint we refuse; ``param`` names the request field for the API's error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
