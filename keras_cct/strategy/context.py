"""The strategy in effect while layers are created (``with strategy.scope():``).

Kept free of TensorFlow and device imports so that layers can consult it cheaply.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

_STACK = threading.local()


def _stack() -> List[Any]:
    if not hasattr(_STACK, "items"):
        _STACK.items = []
    return _STACK.items


def current() -> Optional[Any]:
    """The innermost active :class:`~keras_cct.strategy.CCTStrategy`, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def push(strategy: Any) -> None:
    _stack().append(strategy)


def pop(strategy: Any) -> None:
    stack = _stack()
    if not stack or stack[-1] is not strategy:
        raise RuntimeError("CCTStrategy scopes must be exited in the order they were entered")
    stack.pop()
