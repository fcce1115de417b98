"""The flashcodec tab: transformers models, flashcodec's tiers and transformers' QuantizedCache peers."""

from __future__ import annotations

import argparse
import ctypes
import gc
from pathlib import Path

import torch
from flashcodec.compare import FlashCodecHarness
from flashcodec.tiers import TIERS
from kvbench.cli import Loaded

from .backend import Backend, DemoError

__all__ = ["FlashcodecBackend", "materialization_free_twin"]


def materialization_free_twin(name: str) -> str | None:
    """The registry's tier that stores what ``name`` stores with materialization-free decode
    attention (the same codec), or None when the registry has none."""
    codec = TIERS[name].codec
    return next((t.name for t in TIERS.values() if t.materialization_free and t.codec == codec), None)


class FlashcodecBackend(Backend):
    key = "flashcodec"
    title = "flashcodec (transformers)"
    closest_choice = "png-keep1"
    # the tier at hqq 4-bit's bytes with the lowest KL on the real model (keys per channel, values per token)
    default_choice = "kivi64-k4v4-w64i8"
    has_materialization_free = True

    def __init__(self, dtype: str = "bfloat16", device: str | None = None):
        super().__init__(FlashCodecHarness(), dtype)
        self.device = device
        self._libc = _libc()

    def model_args(self, model: str) -> argparse.Namespace:
        return argparse.Namespace(model=model, dtype=self.dtype, device=self.device)

    def chat_choices(self) -> list[str]:
        # a "-mf" tier is its twin with the toggle on, so the list shows each stored format once
        return [n for n in self.tier_names() if not TIERS[n].materialization_free] + self.peer_names()

    def resolve(self, choice: str, materialization_free: bool) -> str:
        if choice not in self.chat_choices():
            raise DemoError(f"unknown cache {choice!r}; pick one of: {', '.join(self.chat_choices())}")
        if not materialization_free:
            return choice
        twin = materialization_free_twin(choice) if choice in TIERS else None
        if twin is None:
            offered = [n for n in self.chat_choices() if n in TIERS and materialization_free_twin(n)]
            raise DemoError(
                f"{choice} has no materialization-free tier in flashcodec.tiers; turn the toggle off "
                f"or pick one of: {', '.join(offered)}"
            )
        return twin

    def memory_now(self, loaded: Loaded) -> int | None:
        device = torch.device(loaded.runner.device)
        if device.type == "cuda":
            return torch.cuda.memory_allocated(device)
        # process resident memory, after handing freed heap back (as the runner's peak meter does)
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        status = Path("/proc/self/status")
        if not status.exists():
            return None
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return None


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
