"""Compile kernels for a GPU that is not here, and read what the compiler made of them.

Triton compiles for sm_90 on a CPU-only machine: its wheel bundles ptxas, cuobjdump and nvdisasm. Inside
`compile_only()`, a stand-in driver whose current target is sm_90 is active and every `kernel[grid](...)`
launch compiles (or finds in the JIT cache) the variant the launcher asked for, records it, and launches
nothing. So the launchers in this package run unchanged, on CPU tensors, and what gets compiled is exactly
what a GPU would have compiled for the same call (same constexprs, same integer specialisation).

`resources(kernel)` reads a compiled kernel: registers, spill bytes, shared memory, programs per SM on an
H200, and the SASS instruction count of each loop (backward branch) per warp.

`SpecializationCounter` counts distinct JIT cache keys without compiling anything (fast enough for
tens of thousands of launcher calls), which is how the recompile test counts variants across a decode.

This module imports triton but never needs a GPU. It must not be used while TRITON_INTERPRET=1 for the
kernels it compiles: interpreted kernels are not JITFunctions (`SpecializationCounter` handles that by
wrapping the kernel's Python function in a JITFunction of its own).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver as _driver
from triton.runtime.jit import JITFunction

__all__ = [
    "H200",
    "compile_only",
    "constexpr",
    "resources",
    "sass_loops",
    "KernelResources",
    "SpecializationCounter",
]


@dataclass(frozen=True)
class Device:
    """What bounds a kernel on one GPU model (per SM unless said)."""

    name: str
    arch: int
    sms: int
    regs: int = 65536
    smem: int = 228 * 1024  # per SM
    smem_per_block: int = 227 * 1024
    smem_reserved_per_block: int = 1024  # the driver keeps 1 KB per resident block
    max_warps: int = 64
    max_blocks: int = 32
    hbm_gbs: float = 4800.0
    clock_ghz: float = 1.98

    @property
    def hbm_bytes_per_clock_per_sm(self) -> float:
        return self.hbm_gbs / self.clock_ghz / self.sms  # about 18.4 on an H200

    issue_per_clock: int = 4  # warp-instructions per clock per SM (4 schedulers)


H200 = Device("H200", 90, 132)

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _StandInDriver:
    """Enough of a Triton driver for JITFunction.run(..., warmup=True): a current target, device, stream."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return f"stand-in-sm{self.target.arch}"  # a cache key of its own, never a real device's

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def compile_only(arch: int = 90, record: list | None = None):
    """Inside: launches compile for sm_{arch} without running; each compiled kernel is appended to record.

    Yields the record list. Compilation errors (OutOfResources included, which Triton raises at load time
    on a GPU; here only what the compiler itself refuses) propagate to the launcher as they would on a GPU.
    """
    record = [] if record is None else record
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        record.append(kernel)
        return kernel

    previous = _driver._active  # None on a machine without a GPU driver (reading .active would fail)
    _driver.set_active(_StandInDriver(arch))
    JITFunction.run = run
    try:
        yield record
    finally:
        JITFunction.run = original
        _driver._active = previous


# ----------------------------------------------------------------------------------------------- reading


@dataclass
class KernelResources:
    name: str
    num_warps: int
    regs: int
    spill_bytes: int  # local memory per thread (spill stores), bytes
    smem_bytes: int
    programs_per_sm: int
    loops: list[int] = field(default_factory=list)  # SASS instructions per warp per iteration, by address
    limit: str = ""  # what bounds programs_per_sm
    instructions: int = 0  # SASS instructions of the whole kernel (straight-line kernels have no loops)

    @property
    def token_loops(self) -> list[int]:
        """The loops over tokens, in address order (a split kernel's body loop, then its FP loop): those of
        more than 8 instructions (a one-instruction loop is the trap at a kernel's end)."""
        return [n for n in self.loops if n > 8]


def _tool(name: str) -> str:
    path = _BIN / name
    return str(path) if path.exists() else name


def _res_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line:\n{out}")
    reg, stack, shared, local = map(int, m.groups())
    return {"regs": reg, "stack": stack, "shared": shared, "local": local}


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?`\((\.L_x_\d+)\)")


def sass_loops(sass: str) -> list[int]:
    """Instruction count of each innermost loop (a backward branch to a label), per warp per iteration.

    Loops are given in address order; an outer loop that contains another is dropped (the kernels here
    have no nested loops; a nested one would be counted as its inner loop alone).
    """
    labels: dict[str, int] = {}
    instrs: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in sass.splitlines():
        s = line.strip()
        lm = _LABEL.match(s)
        if lm:
            pending.append(lm.group(1))
            continue
        im = _INSTR.search(s)
        if im:
            addr = int(im.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, im.group(2)))
    loops = []
    for addr, text in instrs:
        bm = _BRANCH.search(text)
        if bm and bm.group(1) in labels and labels[bm.group(1)] <= addr:
            loops.append((labels[bm.group(1)], addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return [sum(1 for a, _ in instrs if lo <= a <= hi) for lo, hi in sorted(set(inner))]


def programs_per_sm(regs: int, smem: int, num_warps: int, dev: Device = H200) -> tuple[int, str]:
    """Resident programs (CTAs) per SM and the resource that bounds them."""
    regs_per_warp = ((max(regs, 1) * 32 + 255) // 256) * 256  # allocated per warp in units of 256
    by = {
        "regs": dev.regs // (regs_per_warp * num_warps),
        "smem": dev.smem // (smem + dev.smem_reserved_per_block) if smem else dev.max_blocks,
        "warps": dev.max_warps // num_warps,
        "blocks": dev.max_blocks,
    }
    if smem > dev.smem_per_block:
        by["smem"] = 0
    limit = min(by, key=by.get)
    return by[limit], limit


@functools.cache
def _read(cubin: bytes, name: str, num_warps: int, shared: int) -> KernelResources:
    use = _res_usage(cubin)
    per_sm, limit = programs_per_sm(use["regs"], shared, num_warps)
    sass = _sass(cubin)
    return KernelResources(
        name=name, num_warps=num_warps, regs=use["regs"], spill_bytes=max(use["local"], use["stack"]),
        smem_bytes=shared, programs_per_sm=per_sm, loops=sass_loops(sass), limit=limit,
        instructions=len(_INSTR.findall(sass)),
    )


def resources(kernel) -> KernelResources:
    """Registers, spills, shared memory, occupancy and loop sizes of a compiled kernel (`compile_only`)."""
    md = kernel.metadata
    return _read(kernel.asm["cubin"], md.name, md.num_warps, md.shared)


def constexpr(kernel, name: str):
    """The value a compiled kernel (`compile_only`'s record) was specialised on for constexpr `name`."""
    return kernel.src.constants[(kernel.src.fn.arg_names.index(name),)]


def ceiling_pct(bytes_per_iter: float, instr_per_warp: int, num_warps: int, dev: Device = H200) -> float:
    """The instruction-issue bound on bandwidth, as % of HBM peak: an SM issues `issue_per_clock`
    warp-instructions per clock, so an iteration of num_warps * instr warp-instructions reading
    bytes_per_iter bytes moves at most bytes_per_iter * issue / (num_warps * instr) bytes per clock."""
    if instr_per_warp <= 0:
        return float("nan")
    bpc = bytes_per_iter * dev.issue_per_clock / (num_warps * instr_per_warp)
    return 100.0 * bpc / dev.hbm_bytes_per_clock_per_sm


# ----------------------------------------------------------------------------------------------- recompiles


class SpecializationCounter:
    """Counts the distinct variants a launcher would compile, without compiling.

    `with counter:` makes every `kernel[grid](...)` launch compute the JIT cache key that Triton would
    compute for sm_{arch} (argument types, integer specialisation: == 1 and % 16, constexprs, options)
    and record it; nothing is compiled or run. `counter.variants` maps kernel name -> set of keys.
    Works with TRITON_INTERPRET=1 too: an interpreted kernel is wrapped in a JITFunction of its own
    (same Python function, same do_not_specialize) just to compute keys.

    passthrough=True: every launch is recorded and then launched as usual (on a GPU, or interpreted), so
    a real generation can count the variants it compiled; the stand-in driver is active only while a key
    is computed.
    """

    def __init__(self, arch: int = 90, passthrough: bool = False):
        self.arch = arch
        self.passthrough = passthrough
        self.variants: dict[str, set] = {}
        self.calls: dict[str, int] = {}
        self._twins: dict[int, JITFunction] = {}
        self._patched: list = []

    def counts(self) -> dict[str, int]:
        return {name: len(keys) for name, keys in self.variants.items()}

    def _twin(self, kernel) -> JITFunction:
        twin = self._twins.get(id(kernel))
        if twin is None:
            if isinstance(kernel, JITFunction):
                twin = kernel
            else:  # an InterpretedFunction keeps the jit decorator's arguments in .kwargs
                dns = list((getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or [])
                twin = JITFunction(kernel.fn, do_not_specialize=dns)
            self._twins[id(kernel)] = twin
        return twin

    def record(self, kernel, args, kwargs) -> None:
        from triton.runtime.jit import compute_cache_key

        twin = self._twin(kernel)
        stand_in = _StandInDriver(self.arch)
        device = stand_in.get_current_device()
        previous = _driver._active
        _driver.set_active(stand_in)  # the binder is made for the driver's target on first use
        try:
            kernel_cache, key_cache, target, backend, binder = twin.device_caches[device]
        finally:
            _driver._active = previous
        kwargs = {k: v for k, v in kwargs.items() if k != "grid"}
        _, specialization, options = binder(*args, **kwargs)
        key = compute_cache_key(key_cache, specialization, options)
        name = twin.fn.__name__
        self.variants.setdefault(name, set()).add(key)
        self.calls[name] = self.calls.get(name, 0) + 1

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        counter = self
        previous = _driver._active
        if not self.passthrough:
            _driver.set_active(_StandInDriver(self.arch))
        originals = {cls: cls.__getitem__ for cls in (JITFunction, InterpretedFunction)}

        def patched_getitem(self_kernel, grid):
            if not counter.passthrough:
                return lambda *args, **kwargs: counter.record(self_kernel, args, kwargs)
            original = next(g for c, g in originals.items() if isinstance(self_kernel, c))
            launch = original(self_kernel, grid)

            def record_and_launch(*args, **kwargs):
                counter.record(self_kernel, args, kwargs)
                return launch(*args, **kwargs)

            return record_and_launch

        for cls in (JITFunction, InterpretedFunction):
            self._patched.append((cls, cls.__dict__.get("__getitem__")))
            cls.__getitem__ = patched_getitem
        self._previous_driver = previous
        return self

    def __exit__(self, *exc):
        for cls, original in self._patched:
            if original is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = original
        self._patched = []
        _driver._active = self._previous_driver
        return False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
