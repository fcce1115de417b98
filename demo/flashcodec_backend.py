"""The flashcodec tab: transformers models, flashcodec's tiers and transformers' QuantizedCache peers."""

from __future__ import annotations

import argparse
import ctypes
import gc
from pathlib import Path

import torch
from flashcodec.compare import ATTENTION_NOTES, FlashCodecHarness
from flashcodec.tiers import TIERS
from kvbench.cli import Loaded
from kvbench.protocol import Candidate

from .backend import Backend, DemoError

__all__ = ["FlashcodecBackend"]


class FlashcodecBackend(Backend):
    key = "flashcodec"
    title = "flashcodec (transformers)"
    closest_choice = "png-keep1"
    # the tier under hqq 4-bit's bytes with the lowest KL on the real model (KIVI's split after a
    # fixed rotation of each head's channels, 8-bit scales and zero points)
    default_choice = "kivi64r-k4v4-w64i8-s8"
    # the values are flashcodec compare's --attention choices
    attention_choices = (
        ("tier", "the tier's own"),
        ("codes", "on the stored codes"),
        ("materialized", "on a decoded view"),
    )

    def __init__(self, dtype: str = "bfloat16", device: str | None = None):
        super().__init__(FlashCodecHarness(), dtype)
        self.device = device
        self._libc = _libc()

    def model_args(self, model: str) -> argparse.Namespace:
        return argparse.Namespace(model=model, dtype=self.dtype, device=self.device)

    def chat_choices(self) -> list[str]:
        # each tier once: what it attends on is the attention control, not a second entry
        return list(TIERS) + self.peer_names()

    def check_choice(self, choice: str, attention: str) -> None:
        if choice not in self.chat_choices():
            raise DemoError(f"unknown cache {choice!r}; pick one of: {', '.join(self.chat_choices())}")
        allowed = [value for value, _ in self.attention_choices]
        if attention not in allowed:
            raise DemoError(f"attention must be one of {allowed}; got {attention!r}")
        if attention != "tier" and choice not in TIERS:
            raise DemoError(
                f"{choice} is not a flashcodec tier, so the attention choice does not apply; "
                f"choose the tier's own attention or pick one of: {', '.join(TIERS)}"
            )

    def candidates(self, loaded: Loaded, names, attention: str = "tier"):
        peers = [n for n in self.peer_names() if n in names]
        tiers = [n for n in names if n in TIERS]
        chosen = None if attention == "tier" else attention  # None: each tier's own
        return self.harness.candidates(loaded, tiers, peers, attention=chosen)

    def cache_label(self, candidate: Candidate) -> str:
        # a tier's name and what it attends on, as the docs show it
        attention = candidate.config.get("attention") if candidate.kind == "tier" else None
        return f"{candidate.name} ({ATTENTION_NOTES[attention]})" if attention else candidate.name

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
