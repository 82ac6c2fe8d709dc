"""kvquant.memprobe: resident memory growth and peak as the process sees them (no timing involved)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from kvquant import memprobe
from kvquant.memprobe import MemoryProbe

MiB = 1 << 20
N = 64 * MiB // 4  # float32 elements in 64 MiB

needs_proc = pytest.mark.skipif(
    not Path("/proc/self/statm").is_file(), reason="needs Linux /proc/self/statm (resident set size)"
)
needs_linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="lazy page commit (untouched pages not resident) is Linux's"
)


@needs_proc
def test_kept_tensor_is_growth():
    with MemoryProbe("cpu") as m:
        kept = torch.ones(N)  # written: every page resident
    assert 60 * MiB <= m.growth <= 72 * MiB, m.reading
    assert m.peak >= m.growth
    assert kept.sum().item() == N  # still referenced, so the growth is held


@needs_proc
@needs_linux
def test_untouched_empty_is_not_resident():
    with MemoryProbe("cpu") as m:
        kept = torch.empty(N)  # allocated, never written
    assert m.growth < 8 * MiB, m.reading
    del kept


@needs_proc
def test_freed_temporary_is_peak_not_growth():
    with MemoryProbe("cpu") as m:
        tmp = torch.ones(N)
        tmp.add_(1)
        del tmp
    assert m.peak >= 60 * MiB, m.reading
    assert m.growth < 8 * MiB, m.reading


@needs_proc
def test_sampling_fallback_sees_a_held_peak():
    """The background sampler (used where VmHWM cannot be reset) sees a temporary held longer than its
    period: the temporary is kept until the sampler has taken a reading above it (no sleep-based timing)."""
    with MemoryProbe("cpu", force_sampling=True, sample_interval=1e-3) as m:
        tmp = torch.ones(N)
        sampler = m._sampler
        pause = threading.Event()
        for _ in range(30_000):  # wait (at most ~30 s when loaded) for one sample above the allocation
            if sampler.peak >= m._entry + 60 * MiB:
                break
            pause.wait(1e-3)
        del tmp
    assert m.reading.peak_method.startswith("sampled")
    assert m.peak >= 60 * MiB, m.reading
    assert m.growth < 8 * MiB, m.reading


@needs_proc
def test_nested_cpu_probe_is_refused_and_reading_before_exit_fails():
    probe = MemoryProbe("cpu")
    with pytest.raises(RuntimeError, match="after the with-block"):
        _ = probe.growth
    with probe:
        with pytest.raises(RuntimeError, match="already open"):
            with MemoryProbe("cpu"):
                pass
    assert probe.reading is not None
    with MemoryProbe("cpu"):  # the lock was released
        pass


@needs_proc
def test_vmhwm_reset_reports_support():
    """reset_peak_rss says whether VmHWM can be reset here; when it can, the mark drops to the current."""
    big = torch.ones(N)
    del big
    memprobe.malloc_trim()
    if not memprobe.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs refused the VmHWM reset here (the probe samples instead)")
    assert memprobe.peak_rss_bytes() < memprobe.rss_bytes() + 8 * MiB


def test_cuda_probe_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the refusal path is not reachable")
    with pytest.raises(memprobe.MemoryProbeError, match="CUDA is not available"):
        MemoryProbe("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kept_and_temporary():
    with MemoryProbe("cuda") as m:
        kept = torch.ones(N, device="cuda")
        tmp = torch.ones(N, device="cuda")
        del tmp
    assert 64 * MiB <= m.growth <= 65 * MiB
    assert m.peak >= 128 * MiB
    del kept
