"""The engine's one error class for bad client input."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (unknown model, token id outside the vocabulary, shapes that disagree, ...).

    Answered with an error reply of category ``user``. An op raises it before it changes any
    state, so the request can be corrected and sent again.
    """
