"""Helpers shared by the SDK scripts in test/e2e (run as `python test/e2e/<script>.py`)."""
from collections.abc import Callable


def error_of(fn: Callable[[], object]) -> str:
    """The exception `fn` raised, as `Type: message`, or "" when it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the scripts report whatever the SDK raised
        return f"{type(e).__name__}: {e}"
    return ""
