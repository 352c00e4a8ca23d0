"""Package attributes imported on first use (PEP 562), so that importing a light sub-package
does not import what its parent package offers (no keras_cct imports here)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple


def lazy_attributes(namespace: Dict[str, Any], exports: Mapping[str, str],
                    modules: Optional[Mapping[str, str]] = None
                    ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for a package whose globals are ``namespace``.

    Args:
        exports: attribute name -> the module that defines it (imported on first use, then
            kept in ``namespace``).
        modules: attribute name -> a module that is the attribute itself.
    """
    modules = dict(modules or {})
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in modules:
            return importlib.import_module(modules[name])
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:
        return sorted(set(namespace) | set(exports) | set(modules))

    return __getattr__, __dir__
