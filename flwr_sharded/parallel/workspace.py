"""Named byte buffers reused across reductions: first touching fresh memory costs more than quantizing it."""

from __future__ import annotations

import torch


class Workspace:
    """Named byte buffers reused across reductions (the codecs' scratch, the ring's rows, a top-k sync's rows)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str, *,
            pinned: bool = False) -> torch.Tensor:
        """`numel` elements of `dtype` on `device`; `pinned`: in page-locked host memory where CUDA is available
        (`device` is then the CPU)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            pin = pinned and torch.cuda.is_available()
            buf = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        return buf[:nbytes].view(dtype)
