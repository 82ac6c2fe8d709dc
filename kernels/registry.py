"""Launching a kernel variant, and remembering which variants cannot be built on this machine.

A variant that fails to compile or to load (Triton's `OutOfResources` when shared memory or registers
exceed the device's limits, a ptxas error, a `CompilationError`) is recorded on the `KernelRegistry` that
launched it, logged once, and answered from then on without trying again: the caller takes the reference
path. The memo lives on an object (held by the cache or backend), not in module state, so two caches or
two tests never share it. `default_registry()` serves callers that hold none.

Under TRITON_INTERPRET=1 nothing is caught: there, an exception is a bug in a kernel, never a resource
limit, and tests must see it.

First-use self-check (`KernelRegistry.trusted`): before a variant serves its first call on a device, the
launcher hands the registry a probe (a small problem of the same variant, run through the same launcher,
compared with the kernel's `_ref` twin: pack kernels bit for bit with torch.equal, attention within the
tests' float bound |out - ref32| <= 2 |ref_same_dtype - ref32| + atol). A probe that finds a difference
disables the variant for the process (the verdict lives in a `SelfCheck`, one per process unless a test
gives its own), logs once what differed (max error, where), and the caller takes the reference path, as
for a variant that cannot be built. The probe runs inside the first call, so a benchmark that warms up
before timing never times it; it is skipped (no verdict yet) while a CUDA graph is being captured.
Which devices are checked: CUDA always; the interpreter only when asked (`SelfCheck(enabled=True)` or
KVQUANT_SELF_CHECK=1), since there the kernel and its twin run the same generic code and the probe only
costs time; KVQUANT_SELF_CHECK=0 turns it off everywhere. `SelfCheck.seconds` records each probe's cost.

Devices: Triton compiles for and launches on the *current* CUDA device, whatever device the arguments live
on. In a model split across GPUs by a device map, layer 5's pages may be on cuda:1 while cuda:0 is current,
so `launch` makes the device of the launch's tensors current around it (`device_guard`: a
`torch.cuda.device`; nothing on the CPU or under the interpreter).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable

__all__ = [
    "KernelRegistry", "SelfCheck", "default_registry", "device_guard", "is_build_failure", "launch_device",
    "process_self_check",
]

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


class SelfCheck:
    """Verdicts of first-use probes, per (kernel, variant, device): None = the probe agreed with the twin,
    a string = what differed (the variant is disabled). One per process (`process_self_check`) unless a
    caller gives its own; enabled None = CUDA devices only (KVQUANT_SELF_CHECK=0/1 overrides)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled
        self.verdicts: dict[tuple, str | None] = {}
        self.seconds: dict[tuple, float] = {}  # wall time of each probe (kernel + twin + comparison)

    def wanted(self, device) -> bool:
        if self.enabled is not None:
            return self.enabled
        env = os.environ.get("KVQUANT_SELF_CHECK", "")
        if env in ("0", "1"):
            return env == "1"
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        return getattr(device, "type", str(device)) == "cuda" and not interpreted

    def disabled(self) -> dict[tuple, str]:
        """The variants a probe disabled, with what differed."""
        return {k: v for k, v in self.verdicts.items() if v is not None}


_SELF_CHECK: SelfCheck | None = None


def process_self_check() -> SelfCheck:
    """The process's verdicts: a variant found wrong on a device is wrong for every cache on it."""
    global _SELF_CHECK
    if _SELF_CHECK is None:
        _SELF_CHECK = SelfCheck()
    return _SELF_CHECK


def launch_device(args: tuple):
    """The device of a launch: its first tensor argument's (the launchers put every tensor on one device and
    check it); None when it has no tensor."""
    return next((a.device for a in args if hasattr(a, "device") and hasattr(a, "data_ptr")), None)


def device_guard(device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` for a CUDA device (Triton launches on the current device, so a layer on
    cuda:1 must launch with cuda:1 current), a no-op context for anything else (the CPU, the interpreter)."""
    if getattr(device, "type", None) != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def _capturing(device) -> bool:
    if getattr(device, "type", None) != "cuda":
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


class KernelRegistry:
    """Launches kernel variants; remembers (per instance) the ones that failed to build and says so once;
    asks its `SelfCheck` (the process's by default) whether a variant is trusted on a device.

    variant: any hashable that names what was compiled (the kernel's constexprs); two calls with the same
    variant compile the same code, so one failure stands for all of them.
    """

    def __init__(self, name: str = "kernels", self_check: SelfCheck | None = None):
        self.name = name
        self.failed: dict[tuple, str] = {}
        self._self_check = self_check
        # small per-device constants of a codec (codebook levels), copied once: (key) -> (source, copy)
        self.constants: dict[tuple, tuple] = {}
        # compiled tokens per loop iteration of a decode variant (decode_attention._block_tokens)
        self.blocks: dict[tuple, int] = {}

    @property
    def self_check(self) -> SelfCheck:
        return self._self_check if self._self_check is not None else process_self_check()

    def trusted(self, kernel_name: str, variant, device, probe: Callable[[], str | None]) -> bool:
        """Whether `variant` of `kernel_name` may serve calls on `device`: on its first call there (when the
        self-check wants this device), probe() runs it on a small problem against its twin and returns None
        (agreed) or what differed; a difference disables the variant for the process, logged once.
        The verdict is provisionally "trusted" while the probe runs, so the probe's own launches of this
        variant go straight through. A probe whose launch cannot be built returns None: `launch` has
        already recorded and logged that failure, and the caller takes the reference path for it anyway."""
        check = self.self_check
        if not check.wanted(device):
            return True
        key = (kernel_name, variant, str(device))
        if key in check.verdicts:
            return check.verdicts[key] is None
        if _capturing(device):  # no allocation or sync may happen inside a graph capture: check later
            return True
        check.verdicts[key] = None
        t0 = time.perf_counter()
        try:
            problem = probe()
        except BaseException:
            del check.verdicts[key]  # no verdict: a bug in the probe is raised, and the next call retries
            raise
        check.seconds[key] = time.perf_counter() - t0
        check.verdicts[key] = problem
        if problem is not None:
            logger.warning("%s: %s variant %s disagrees with its reference twin on %s (%s); disabled for "
                           "this process, the reference path serves it", self.name, kernel_name,
                           _short(variant), device, problem)
        return problem is None

    def usable(self, kernel_name: str, variant) -> bool:
        return (kernel_name, variant) not in self.failed

    def launch(self, kernel, grid, args: tuple, kwargs: dict, variant) -> bool:
        """kernel[grid](*args, **kwargs) with the arguments' CUDA device current (`device_guard`); False
        (and nothing launched) when this variant cannot be built."""
        name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        key = (name, variant)
        if key in self.failed:
            return False
        try:
            with device_guard(launch_device(args)):
                kernel[grid](*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - filtered just below; anything else is re-raised
            if not is_build_failure(exc):
                raise
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            logger.warning("%s: %s cannot be built for %s (%s); using the reference path for it",
                           self.name, name, variant, self.failed[key].splitlines()[0][:300])
            return False
        return True


def _short(variant, limit: int = 400) -> str:
    text = str(variant)
    return text if len(text) <= limit else text[:limit] + "..."


_DEFAULT: KernelRegistry | None = None


def default_registry() -> KernelRegistry:
    """The registry of callers that hold none (a direct call to a public kernel function). Kept at module
    level only because such a caller has nowhere else to keep it; the cache passes its own."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KernelRegistry("default")
    return _DEFAULT
