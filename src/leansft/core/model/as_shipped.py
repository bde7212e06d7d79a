"""A block in which every layer runs the code its library ships: the plain model that verify-before-train and the
tests compare against.

Whatever replaces a layer's forward for speed (the opt-in CPU layers of ``core/cpu/fused_layers.py``) asks
``is_as_shipped()`` at call time and runs the original code while it is true. The flag lives here, in the model
package, so that the reference side needs nothing from the code it checks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_AS_SHIPPED = contextvars.ContextVar("leansft_as_shipped", default=False)


@contextlib.contextmanager
def as_shipped() -> Iterator[None]:
    """Run every replaced layer's original (Hugging Face / peft) code for the duration of the block."""
    token = _AS_SHIPPED.set(True)
    try:
        yield
    finally:
        _AS_SHIPPED.reset(token)


def is_as_shipped() -> bool:
    return _AS_SHIPPED.get()
