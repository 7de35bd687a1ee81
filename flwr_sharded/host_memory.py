"""This process's host memory: glibc's allocator policy, so that a rank's resident memory follows its tensors, and
the resident memory itself.

With its default dynamic mmap threshold, glibc raises the threshold to the size of each mapped chunk a process frees
(up to 32 MiB), so the transient tensors of a model's load and of the first step come from the heap, whose freed
holes stay resident between the long-lived tensors placed among them. The entry points pin the mmap and trim
thresholds at 128 KiB first thing (`pin_thresholds`: every buffer of that size gets a mapping of its own, returned
when freed), give the heap's free pages back once the model is loaded (`after_load`), and after the first optimizer
step (`after_first_step`: the optimizer's state and the step's long-lived buffers are in place) raise both to 32 MiB,
glibc's own ceiling: the steps' transient buffers are then reused from the heap instead of being mapped, zeroed and
unmapped every step (which cost 60-70% of a CPU step of the `small` model, benchmarks/README.md). Reused, the heap's
holes still grow over a long run (+1.2 to +4.4 MiB per 100 Flower rounds in each rank, benchmarks/soak.py): at each
sync period's end (`after_period`) its free pages go back to the OS. On GPUs the steps' buffers are device memory,
and the pin bounds the host memory of the load. `MALLOC_MMAP_THRESHOLD_` /
`MALLOC_TRIM_THRESHOLD_` in the environment win over both settings. Off glibc all of this is a no-op (logged at
debug level); a glibc call that fails is logged as a warning.

The same process's resident memory (`current_rss`), its peak (`peak_rss`) and the peak over a stretch of work
(`PeakRSS`), from Linux `/proc`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

THRESHOLD_BYTES = 128 << 10
"""Through start-up and the first step: buffers of this size or more are mappings of their own, unmapped when freed;
the trim threshold is the same."""
STEP_THRESHOLD_BYTES = 32 << 20
"""From the second step on: glibc's own ceiling of its dynamic threshold (64-bit), for both thresholds."""

_PARAMETERS = {"M_TRIM_THRESHOLD": (-1, "MALLOC_TRIM_THRESHOLD_"), "M_MMAP_THRESHOLD": (-3, "MALLOC_MMAP_THRESHOLD_")}
"""mallopt parameter (malloc.h) -> (its number, the environment variable that sets it at process start)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The running glibc, or None on another C library."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        version = ""
    if not version.startswith("glibc"):
        logger.debug("not glibc (%r): freed memory is left to the C library's defaults", version or "unknown")
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        logger.warning("glibc %s: cannot open it through ctypes (%s); freed memory stays resident", version, exc)
        return None


def pin_thresholds(threshold: int = THRESHOLD_BYTES) -> dict[str, bool]:
    """Pin glibc's mmap and trim thresholds at `threshold` bytes (unless set in the environment, which wins).

    Returns parameter -> whether this call set it (empty on other C libraries)."""
    return _set({"M_TRIM_THRESHOLD": threshold, "M_MMAP_THRESHOLD": threshold})


def _set(values: dict[str, int]) -> dict[str, bool]:
    libc = _glibc()
    if libc is None:
        return {}
    done = {}
    for name, value in values.items():
        number, variable = _PARAMETERS[name]
        if os.environ.get(variable):
            logger.debug("%s=%s is set: leaving %s as it is", variable, os.environ[variable], name)
            done[name] = False
            continue
        done[name] = libc.mallopt(ctypes.c_int(number), ctypes.c_int(value)) == 1
        if not done[name]:
            logger.warning("mallopt(%s, %d) failed (errno %d): freed memory may stay resident", name, value,
                           ctypes.get_errno())
    return done


def trim() -> bool:
    """Give the heap's free pages back to the OS now (`malloc_trim(0)`); whether any were (False off glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))


def after_load() -> None:
    """The model is loaded: give its transient buffers back to the OS (`trim`)."""
    trim()


def after_first_step() -> dict[str, bool]:
    """The first optimizer step is done: the steps' transient buffers come from the heap from now on
    (`STEP_THRESHOLD_BYTES`), and the first step's go back to the OS. Returns what `pin_thresholds` returns."""
    done = _set({"M_TRIM_THRESHOLD": STEP_THRESHOLD_BYTES, "M_MMAP_THRESHOLD": STEP_THRESHOLD_BYTES})
    trim()
    return done


def after_period() -> None:
    """A sync period ended: the heap's free pages go back to the OS (`trim`), so that its holes do not grow."""
    trim()


FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""What sets the size of torch's flight recorder (c10d's record of recent collectives), the first that is set."""


def no_flight_recorder() -> bool:
    """Turn torch's flight recorder off in this process (`TORCH_FR_BUFFER_SIZE=0`) unless the environment sizes it;
    whether this call did. For a process that makes a process group every round (the group runtime): the recorder
    keeps a little of every group ever made, and of every collective a Python traceback in its ring, which made a
    rank's memory grow about 0.3 MiB per 100 rounds more (benchmarks/README.md, "Weeks-long runs"). Call before the
    first process group; set either variable (e.g. 2000, torch's default) to keep the recorder for debugging hangs."""
    if any(os.environ.get(name) for name in FLIGHT_RECORDER_VARIABLES):
        return False
    os.environ[FLIGHT_RECORDER_VARIABLES[0]] = "0"
    return True


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss() -> int | None:
    """This process's resident memory in bytes (None where /proc does not tell)."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss() -> int | None:
    """This process's resident high-water mark (VmHWM) in bytes (None where /proc does not tell)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


class PeakRSS:
    """The peak RSS of this process from construction on, over `base_bytes` (default: the RSS at construction)."""

    def __init__(self, base_bytes: int | None = None) -> None:
        try:
            _CLEAR_REFS.write_text("5")
            self.available = True
        except OSError:
            self.available = False
        base = current_rss() if base_bytes is None else base_bytes
        self.available = self.available and base is not None
        self.base_bytes = base or 0

    def extra_bytes(self) -> int | None:
        """Peak RSS since construction less the RSS then (None where it cannot be measured)."""
        peak = _status_kib("VmHWM") if self.available else None
        return None if peak is None else max(0, peak * 1024 - self.base_bytes)

