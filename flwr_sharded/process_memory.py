"""Peak resident memory of this process over a stretch of work (Linux `/proc`), e.g. the server's aggregation.

`PeakRSS()` resets the kernel's high-water mark (`VmHWM`, by writing 5 to `/proc/self/clear_refs`) and remembers
the current RSS (or takes a baseline measured earlier, `current_rss()`); `extra_bytes()` is then the peak RSS since,
less that baseline. Memory freed to the allocator but kept by it still counts as resident: to see what repeated work
needs, measure every repetition against one baseline taken before the first. Where `/proc` does not allow this
(not Linux, or a kernel without the reset), `available` is False and `extra_bytes()` returns None.
"""

from __future__ import annotations

from pathlib import Path

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


__all__ = ["PeakRSS", "current_rss", "peak_rss"]
