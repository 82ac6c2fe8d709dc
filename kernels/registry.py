"""Launching a kernel variant, and remembering which variants cannot be built on this machine.

A variant that fails to compile or to load (Triton's `OutOfResources` when shared memory or registers
exceed the device's limits, a ptxas error, a `CompilationError`) is recorded on the `KernelRegistry` that
launched it, logged once, and answered from then on without trying again: the caller takes the reference
path. The memo lives on an object (held by the cache or backend), not in module state, so two caches or
two tests never share it. `default_registry()` serves callers that hold none.

Under TRITON_INTERPRET=1 nothing is caught: there, an exception is a bug in a kernel, never a resource
limit, and tests must see it.
"""

from __future__ import annotations

import logging
import os
import subprocess

__all__ = ["KernelRegistry", "default_registry", "is_build_failure"]

logger = logging.getLogger("kvquant.kernels")


def is_build_failure(exc: BaseException) -> bool:
    """Whether exc says "this variant cannot be built or loaded here" (not a wrong argument)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - triton without these names
        return False
    if isinstance(exc, (OutOfResources, CompilationError, subprocess.CalledProcessError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(w in text for w in ("ptxas", "PTXAS", "out of resource"))


class KernelRegistry:
    """Launches kernel variants; remembers (per instance) the ones that failed to build and says so once.

    variant: any hashable that names what was compiled (the kernel's constexprs); two calls with the same
    variant compile the same code, so one failure stands for all of them.
    """

    def __init__(self, name: str = "kernels"):
        self.name = name
        self.failed: dict[tuple, str] = {}

    def usable(self, kernel_name: str, variant) -> bool:
        return (kernel_name, variant) not in self.failed

    def launch(self, kernel, grid, args: tuple, kwargs: dict, variant) -> bool:
        """kernel[grid](*args, **kwargs); False (and nothing launched) when this variant cannot be built."""
        name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        key = (name, variant)
        if key in self.failed:
            return False
        try:
            kernel[grid](*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - filtered just below; anything else is re-raised
            if not is_build_failure(exc):
                raise
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: %s cannot be built for %s (%s); using the reference path for it",
                           self.name, name, variant, self.failed[key].splitlines()[0][:300])
            return False
        return True


_DEFAULT: KernelRegistry | None = None


def default_registry() -> KernelRegistry:
    """The registry of callers that hold none (a direct call to a public kernel function). Kept at module
    level only because such a caller has nowhere else to keep it; the cache passes its own."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KernelRegistry("default")
    return _DEFAULT
