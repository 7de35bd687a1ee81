"""What a training rank measures about itself: phase timings, peak memory, model FLOPs and MFU, log lines."""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10": 125.0, "V100": 125.0}
"""Dense bf16/fp16 tensor-core TFLOP/s of known GPUs (vendor figures; SXM parts), by a substring of the device name."""


class PhaseTimer:
    """Times named phases (forward, backward, optimizer, sync) without adding device synchronisations: on GPU by CUDA
    events read only in `collect()`, which the caller runs when it synchronises anyway (logging, the end of a Flower
    round); on CPU, where kernels run synchronously, by wall clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._totals[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call (frees the recorded events)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                self._totals[name] += start.elapsed_time(end) / 1000.0
            self._pending.clear()
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals


def model_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x the matmul parameters + 12 x layers x width x sequence for
    attention scores (PaLM, appendix B). Embedding lookups are not matmuls; a tied output head is counted once; of a
    mixture of experts, the `num_experts_per_tok` experts a token is routed to."""
    config = getattr(model, "config", None)
    matmul = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            matmul += module.weight.numel()  # the global count: DTensor parameters report their full size
    routed = getattr(config, "num_experts_per_tok", None)
    for param in model.parameters():  # a mixture's fused experts (experts x rows x columns): those a token meets
        if routed and param.dim() == 3 and id(param) not in seen:
            seen.add(id(param))
            matmul += param.numel() * routed // param.shape[0]
    attention = 0.0
    if config is not None and hasattr(config, "num_hidden_layers") and hasattr(config, "hidden_size"):
        heads = getattr(config, "num_attention_heads", None)
        head_dim = getattr(config, "head_dim", None)
        width = heads * head_dim if heads and head_dim else config.hidden_size  # query width (Qwen3: != hidden)
        attention = 12.0 * config.num_hidden_layers * width * seq_len
    return 6.0 * matmul + attention


def device_peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The peak used for MFU: the option if set, else a known GPU's figure, else None (CPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)


class Throughput:
    """Converts a rank's token rate into achieved TFLOP/s and MFU, and reports its peak memory."""

    def __init__(self, model: nn.Module, cfg: Any, device: torch.device) -> None:
        self.device = device
        self.flops_per_token = model_flops_per_token(model, cfg.data.seq_len)
        self.peak_tflops = device_peak_tflops(device, cfg.output.peak_tflops)

    def utilisation(self, tokens_per_s_per_rank: float) -> dict[str, float]:
        """Achieved model TFLOP/s of one rank and, when the device's peak is known, its MFU."""
        tflops = self.flops_per_token * tokens_per_s_per_rank / 1e12
        out = {"tflops_per_rank": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out

    def peak_memory_mib(self) -> float:
        """Peak device memory allocated (GPU) or peak resident memory of the process (CPU), in MiB."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def train_line(r: dict[str, Any], total_steps: int) -> str:
    """One log line of a train record."""
    phases = " ".join(f"{short} {r[key]:.3f}" for key, short in (("forward_s", "fwd"), ("backward_s", "bwd"),
                                                                 ("optimizer_s", "opt"), ("sync_s", "sync"))
                      if key in r)
    mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
    return (f"step {r['step']}/{total_steps} | loss {r['loss']:.4f} ppl {r['ppl']:.2f} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | {r['step_s']:.3f} s/step ({phases}) | peak mem "
            f"{r['peak_memory_mib']:,.0f} MiB | {r['tflops_per_rank']:.3f} TFLOP/s per rank{mfu}")


def progress_bar(total: int, enabled: bool, initial: int = 0, desc: str = "train"):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step", dynamic_ncols=True)
