"""The flashcodec tab: transformers models, flashcodec's tiers and transformers' QuantizedCache peers."""

from __future__ import annotations

import argparse
import ctypes
import gc
from pathlib import Path

import torch
from flashcodec.compare import FlashCodecHarness
from flashcodec.tiers import MF_SUFFIX, TIERS
from kvbench.cli import Loaded

from .backend import Backend, DemoError

__all__ = ["FlashcodecBackend"]


class FlashcodecBackend(Backend):
    key = "flashcodec"
    title = "flashcodec (transformers)"
    closest_choice = "png-keep1"
    # the tier under hqq 4-bit's bytes with the lowest KL on the real model (KIVI's split after a
    # fixed rotation of each head's channels, 8-bit scales and zero points)
    default_choice = "kivi64r-k4v4-w64i8-s8"
    has_materialization_free = True

    def __init__(self, dtype: str = "bfloat16", device: str | None = None):
        super().__init__(FlashCodecHarness(), dtype)
        self.device = device
        self._libc = _libc()

    def model_args(self, model: str) -> argparse.Namespace:
        return argparse.Namespace(model=model, dtype=self.dtype, device=self.device)

    def chat_choices(self) -> list[str]:
        # each stored format once: materialization-free attention is the toggle, not a second entry
        return list(TIERS) + self.peer_names()

    def resolve(self, choice: str, materialization_free: bool) -> str:
        if choice not in self.chat_choices():
            raise DemoError(f"unknown cache {choice!r}; pick one of: {', '.join(self.chat_choices())}")
        if not materialization_free:
            return choice
        if choice not in TIERS:
            raise DemoError(
                f"{choice} is not a flashcodec tier, so materialization-free attention does not apply; "
                f"turn the toggle off or pick one of: {', '.join(TIERS)}"
            )
        return choice + MF_SUFFIX  # the tier with attention on the stored codes (flashcodec.tiers.tier)

    def candidates(self, loaded: Loaded, names):
        # a "-mf" name is a tier on the attention axis, listed by the harness or not
        peers = [n for n in self.peer_names() if n in names]
        tiers = [n for n in names if n not in peers and n.removesuffix(MF_SUFFIX) in TIERS]
        return self.harness.candidates(loaded, tiers, peers)

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
