"""Memory as the process sees it: resident set size on the CPU, the caching allocator's counters on CUDA.

`kvquant.memory` gives the formula (bytes a scheme should hold); this module measures what the process
holds, so a report can put the two side by side (issue 20: a saving only in `nbytes()` is not a saving).

    from kvquant.memprobe import MemoryProbe

    with MemoryProbe("cpu") as m:
        cache = ...                      # whatever is built here and still referenced at exit
    m.growth   # bytes resident at exit minus at entry (after gc + malloc_trim on both sides)
    m.peak     # highest resident bytes inside the block minus at entry

What each number is
-------------------
CPU (Linux):
  current  resident set size, `/proc/self/statm` field 2 (resident pages) x page size: the anonymous and
           file-backed pages of this process in RAM now. Pages allocated but never written are not
           resident (`torch.empty` of 64 MiB costs ~0 until touched; `torch.zeros` writes, so it is).
  peak     `VmHWM` of `/proc/self/status`, the kernel's high-water mark of the resident set, reset at entry
           by writing "5" to `/proc/self/clear_refs` (Linux >= 4.0). Where that write is refused the peak
           is the maximum of `statm` sampled every `sample_interval` seconds (1 ms) by a background
           thread, which can miss a peak shorter than the interval; `peak_method` says which was used.
  Before every reading the probe runs `gc.collect()` and glibc's `malloc_trim(0)` (through ctypes), which
  hands every whole free page of every malloc arena back to the kernel, so memory already freed does not
  count.
CUDA:
  current  `torch.cuda.memory_allocated(device)`: bytes of live tensors (after `synchronize`).
  peak     `torch.cuda.max_memory_allocated(device)` after `reset_peak_memory_stats(device)` at entry.
  `reserved_growth` is `memory_reserved` at exit minus at entry: what the caching allocator keeps from the
  driver (what `nvidia-smi` shows, less the CUDA context), which can exceed the live tensors.

Known biases
------------
- glibc arenas: allocations under the mmap threshold (128 KiB at start; glibc raises it, up to 32 MiB,
  each time an mmapped chunk is freed) come from arenas; `malloc_trim(0)` returns only whole free pages,
  so fragments of partly used pages stay resident and read as growth. Threads get their own arenas.
  Without glibc (musl) there is no trim (`trimmed` is False) and freed small blocks may read as resident.
- Transparent huge pages: with THP "always", touching one byte of a large region can make 2 MiB
  resident, so growth has a granularity of up to 2 MiB per large allocation.
- First use: the first call of a kernel loads code pages, builds thread pools and oneDNN primitives;
  that shows as growth. Warm the code path up before the probe, or take the difference between two
  states that both ran it.
- RSS counts the whole process: another thread allocating inside the block is counted.
- Peaks through `VmHWM`: the kernel updates the mark when pages are unmapped and on reads of /proc, so a
  temporary freed inside the block is counted; pages dropped by `madvise` alone may leave the mark below
  the true peak on some kernels. The sampling fallback can miss peaks shorter than its interval.
- CUDA: `memory_allocated` counts live tensors, rounded up to the allocator's 512-byte blocks; it never
  sees memory outside PyTorch's allocator (cuBLAS workspaces, Triton's own buffers, the context).
- Nested CPU probes would reset each other's peak, so a CPU probe is not reentrant (entering a second
  one while one is open raises RuntimeError); CUDA probes nest the same way through
  `reset_peak_memory_stats`, unchecked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MemoryProbe",
    "MemoryProbeError",
    "MemoryReading",
    "malloc_trim",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
]

logger = logging.getLogger(__name__)

_STATM = Path("/proc/self/statm")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class MemoryProbeError(RuntimeError):
    """The capability a measurement needs is missing here (no /proc, no CUDA)."""


def _require_proc() -> None:
    if not _STATM.is_file():
        raise MemoryProbeError(
            f"{_STATM} is not present: resident memory is read from Linux's /proc; this platform has none"
        )


def rss_bytes() -> int:
    """Resident set size of this process now: `/proc/self/statm` resident pages x page size."""
    _require_proc()
    return int(_STATM.read_text().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """`VmHWM` (kB in /proc/self/status) in bytes: the resident high-water mark since start or last reset."""
    _require_proc()
    m = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    if m is None:
        raise MemoryProbeError(f"{_STATUS} has no VmHWM line (kernel too old?)")
    return int(m.group(1)) * 1024


def reset_peak_rss() -> bool:
    """Reset `VmHWM` to the current resident size (write "5" to /proc/self/clear_refs); False if refused."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError as e:
        logger.debug("cannot reset VmHWM through %s: %s", _CLEAR_REFS, e)
        return False


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MALLOC_TRIM = _load_libc()  # the libc function (not state): None without glibc


def malloc_trim() -> bool:
    """gc.collect(), then glibc `malloc_trim(0)` (return every whole free page of every arena to the kernel).
    False where libc has no malloc_trim (not glibc): freed memory may then still read as resident."""
    gc.collect()
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


@dataclass(frozen=True)
class MemoryReading:
    """One probe's result, in bytes (see the module docstring for what each number is)."""

    device: str
    entry: int  # resident (CPU) / allocated (CUDA) at entry
    exit: int  # the same at exit
    peak_abs: int  # highest value inside the block
    peak_method: str  # "VmHWM", "sampled statm every 1 ms", "cuda max_memory_allocated"
    trimmed: bool  # malloc_trim ran before readings (CPU)
    reserved_growth: int | None = None  # CUDA only: memory_reserved at exit minus at entry

    @property
    def growth(self) -> int:
        return self.exit - self.entry

    @property
    def peak(self) -> int:
        return max(self.peak_abs, self.exit) - self.entry


class _Sampler(threading.Thread):
    """Max of statm's resident pages, read every `interval` seconds until stopped."""

    def __init__(self, interval: float):
        super().__init__(name="kvquant-memprobe", daemon=True)
        self.interval = interval
        self.peak = rss_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


class MemoryProbe:
    """Measure what a block of code leaves held and its peak: `with MemoryProbe(device) as m: ...`.

    After the block, `m.growth` (bytes held at exit minus at entry), `m.peak` (peak minus entry) and
    `m.reading` (a `MemoryReading`) are set. device: "cpu" (resident set size) or a CUDA device (its
    allocator's counters). trim: gc + malloc_trim before the CPU readings (default True). sample_interval:
    the fallback sampler's period, used only where VmHWM cannot be reset (or when force_sampling=True).
    """

    _cpu_open = threading.Lock()  # held while a CPU probe is open: nested ones would reset each other's peak

    def __init__(self, device="cpu", *, trim: bool = True, sample_interval: float = 1e-3,
                 force_sampling: bool = False):
        import torch

        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MemoryProbeError(f"MemoryProbe({device!r}): CUDA is not available in this torch build/host")
        if self.device.type not in ("cpu", "cuda"):
            raise MemoryProbeError(f"MemoryProbe measures 'cpu' or 'cuda' devices, not {self.device.type!r}")
        self.trim = trim
        self.sample_interval = sample_interval
        self.force_sampling = force_sampling
        self.reading: MemoryReading | None = None
        self._sampler: _Sampler | None = None
        self._entry = 0
        self._reserved = 0
        self._trimmed = False

    # ---------------------------------------------------------------------------------------------- readings
    def current(self) -> int:
        """Bytes held now (after gc + trim on the CPU; after synchronize on CUDA)."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        if self.trim:
            self._trimmed = malloc_trim()
        return rss_bytes()

    @property
    def growth(self) -> int:
        return self._done().growth

    @property
    def peak(self) -> int:
        return self._done().peak

    def _done(self) -> MemoryReading:
        if self.reading is None:
            raise RuntimeError("MemoryProbe: read growth/peak after the with-block has exited")
        return self.reading

    # ------------------------------------------------------------------------------------- context manager
    def __enter__(self) -> MemoryProbe:
        import torch

        self.reading = None
        if self.device.type == "cuda":
            self._entry = self.current()
            self._reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        _require_proc()
        if not MemoryProbe._cpu_open.acquire(blocking=False):
            raise RuntimeError(
                "a CPU MemoryProbe is already open: nested probes would reset each other's peak; "
                "take readings with probe.current() inside the outer one instead"
            )
        try:
            self._entry = self.current()
            if self.force_sampling or not reset_peak_rss():
                self._sampler = _Sampler(self.sample_interval)
                self._sampler.start()
        except BaseException:
            MemoryProbe._cpu_open.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            exit_ = self.current()
            self.reading = MemoryReading(
                device=str(self.device),
                entry=self._entry,
                exit=exit_,
                peak_abs=torch.cuda.max_memory_allocated(self.device),
                peak_method="cuda max_memory_allocated",
                trimmed=False,
                reserved_growth=torch.cuda.memory_reserved(self.device) - self._reserved,
            )
            return
        try:
            if self._sampler is not None:
                peak, method = self._sampler.stop(), f"sampled statm every {self.sample_interval * 1e3:g} ms"
                self._sampler = None
            else:
                peak, method = peak_rss_bytes(), "VmHWM"  # read before the trim: what the block reached
            exit_ = self.current()
            self.reading = MemoryReading(
                device="cpu",
                entry=self._entry,
                exit=exit_,
                peak_abs=peak,
                peak_method=method,
                trimmed=self._trimmed,
            )
        finally:
            MemoryProbe._cpu_open.release()
