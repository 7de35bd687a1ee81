"""One shard sync from its start to its merge (`Flight`) and what it did (`SyncStats`); what an overlapped one runs
on (`Overlap`): the buffers it copies its buckets and shards into at its start (`Snapshot`), the side CUDA stream and
the thread that reduces them in the background while training goes on, and an abandoned flight's thread that may
still write into those buffers."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from flwr_sharded.parallel.buckets import BucketLayout


@dataclass
class SyncStats:
    """What one sync did on this rank."""

    seconds: float
    """Wall time from its start to its merge."""
    buckets: int
    """Collectives issued over the federation's groups."""
    bytes: int
    """Payload bytes this rank sent over them."""
    total_weight: float
    """Sum of the admitted members' weights."""


class Snapshot:
    """One reusable byte buffer for copies of buckets that are never held at the same time (the fragments of one
    model: at most one is in flight), sized to the largest."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def views(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped and typed as `like`, laid out one after the other in the buffer (grown if needed)."""
        sizes = [t.numel() * t.element_size() for t in like]
        if self._storage is None or self._storage.numel() < sum(sizes) or self._storage.device != like[0].device:
            self._storage = torch.empty(sum(sizes), dtype=torch.uint8, device=like[0].device)
        out, offset = [], 0
        for t, size in zip(like, sizes):
            out.append(self._storage[offset:offset + size].view(t.dtype).view(t.shape))
            offset += size
        return out


@dataclass
class Flight:
    """One sync from its start to its merge."""

    weight: float
    ok: bool
    """This member's own verdict on what it sends."""
    norms: list[float] | None
    sends: list[torch.Tensor] | None
    """The buckets as copied out at the start (overlapped); None: copied in one by one (blocking)."""
    origins: list[torch.Tensor] | None
    """The shards at the start (overlapped, when the move is bounded or the merge carries)."""
    started: float
    dense: bool = False
    """A top-k sync that sends every entry this time."""
    adopted: int = 0
    """The merges this member's group adopted so far, brought to the admission (`admission.behind`)."""
    alpha: float = 0.0
    apply_rule: bool = True
    thread: threading.Thread | None = None
    error: BaseException | None = None
    bytes: int = 0
    total: float = 0.0

    def stats(self, buckets: int) -> SyncStats:
        """What this flight did, from its start until now."""
        return SyncStats(seconds=time.perf_counter() - self.started, buckets=buckets, bytes=self.bytes,
                         total_weight=self.total)


class Overlap:
    """What one fragment's overlapped syncs run on: the snapshot its buckets are copied into and the origin its shards
    are (shared by the fragments of one model; None: its own), the side CUDA stream, and the thread of an abandoned
    flight that was still running."""

    def __init__(self, snapshot: Snapshot | None = None, origin: Snapshot | None = None) -> None:
        self.snapshot, self.origin = snapshot or Snapshot(), origin
        self.stream: torch.cuda.Stream | None = None
        self.abandoned: threading.Thread | None = None
        """The thread of an abandoned flight that was still running: it may yet write into the snapshot."""
        self.abandoned_wait = 60.0
        """Seconds a new flight waits for an abandoned flight's thread before it refuses to begin."""

    def copy_out(self, flight: Flight, views: list, layout: BucketLayout, origins: bool) -> None:
        """Copy the shards (`layout.views()`) into the snapshot as `flight.sends`; `origins`: also keep them as they
        are now (`flight.origins`)."""
        if self.stream is not None:  # the last flight's side stream is done with the snapshot before it is reused
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        flight.sends = self.snapshot.views([flat for flat, _, _ in views])
        for k, (send, (_, shard_segments, _)) in enumerate(zip(flight.sends, views)):
            torch._foreach_copy_(layout.segments_of(k, send), shard_segments)
        if origins:
            self.origin = self.origin or Snapshot()
            flight.origins = self.origin.views(flight.sends)
            torch._foreach_copy_(flight.origins, flight.sends)

    def launch(self, flight: Flight, reduce: Callable[[Flight], None]) -> None:
        """Run `reduce(flight)` in a thread (on the side stream on GPUs, after the copies)."""
        device = flight.sends[0].device
        if device.type == "cuda":  # the copies run on the current stream
            self.stream = self.stream or torch.cuda.Stream(device=device)
            self.stream.wait_stream(torch.cuda.current_stream(device))
        flight.thread = threading.Thread(target=self._run, args=(flight, reduce), name="flwr-sharded-sync",
                                         daemon=True)
        flight.thread.start()

    def _run(self, flight: Flight, reduce: Callable[[Flight], None]) -> None:
        stream = self.stream
        try:
            if stream is not None:  # the thread's current device: else CUDA makes a context on device 0
                torch.cuda.set_device(stream.device)
            with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                try:
                    reduce(flight)
                finally:  # the side stream's work is done before the merge (or a new flight) touches the buffers
                    if stream is not None:
                        stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread when the flight is received
            flight.error = exc

    def join(self, flight: Flight, timeout: float | None) -> None:
        """Wait up to `timeout` s for the flight's thread; TimeoutError if it runs on."""
        flight.thread.join(timeout)
        if flight.thread.is_alive():
            raise TimeoutError(f"the overlapped sync did not complete within {timeout} s")

    def before_merge(self) -> None:
        """The current stream waits for what the side stream wrote."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def abandon(self, flight: Flight | None, timeout: float) -> None:
        """Drop `flight`: wait up to `timeout` s for its thread; one still running is remembered (`await_abandoned`)."""
        thread = flight.thread if flight is not None else None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self.abandoned = thread

    def await_abandoned(self) -> None:
        """Wait for an abandoned flight's thread; RuntimeError if it outlives `abandoned_wait`."""
        thread = self.abandoned
        if thread is None:
            return
        thread.join(self.abandoned_wait)
        if thread.is_alive():
            raise RuntimeError(f"an abandoned sync of this fragment is still running after {self.abandoned_wait} s "
                               f"more (its collective has not returned); a new sync would share its buffers")
        self.abandoned = None
