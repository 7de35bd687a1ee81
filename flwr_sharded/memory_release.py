"""Return freed host memory to the operating system (glibc's malloc), so a rank's resident memory follows its tensors.

With its default dynamic mmap threshold, glibc raises the threshold to the size of each mapped chunk a process
frees (up to 32 MiB), so after loading a model the transient tensors of the load (and later FSDP's gathered
parameters and unsharded gradients) come from the heap, whose freed holes stay resident. Pinning the mmap and trim
thresholds (`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_`, which glibc reads only when the process starts) gives
every buffer of 128 KiB or more a mapping of its own, returned when it is freed; `malloc_trim(0)` gives back the free
pages of the heap at once. The entry points call `pin_thresholds` first thing and `after_load` once the model is
loaded. The thresholds stay pinned through the steps, whose gathered parameters and gradients would otherwise stay
resident in the heap (x 1.47-1.85 of a rank's state share against x 1.03, benchmarks/README.md); on a CPU, mapping
every buffer costs 15-20% of a tiny model's step. On other C libraries both are no-ops (logged at debug level); a
glibc call that fails is logged as a warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

THRESHOLD_BYTES = 128 << 10
"""Buffers of this size or more are mappings of their own, unmapped when freed; the trim threshold is the same."""

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
