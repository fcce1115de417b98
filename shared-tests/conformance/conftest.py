"""Which adapters the conformance suite drives: ``KVSPEC_ADAPTERS`` (comma list, default
``reference``). An adapter named there that cannot be imported fails the run
(``test_adapter_loads``); it is never skipped."""

from __future__ import annotations

import importlib
import os
import traceback
from functools import cache

import pytest
from kvspec.conformance import conformance_items

ADAPTER_CLASSES = {
    "reference": "kvspec.reference:ReferenceAdapter",
    "palu": "palu_mlx.spec:PaluAdapter",
    "flashcodec": "flashcodec.spec:FlashCodecAdapter",
}


def requested_adapters() -> tuple[str, ...]:
    raw = os.environ.get("KVSPEC_ADAPTERS", "reference")
    return tuple(name.strip() for name in raw.split(",") if name.strip())


@cache
def load_adapter(name: str):
    """``(adapter instance, None)`` or ``(None, why it could not be loaded)``."""
    if name not in ADAPTER_CLASSES:
        return None, f"unknown adapter {name!r} in KVSPEC_ADAPTERS; known: {sorted(ADAPTER_CLASSES)}"
    module_name, _, class_name = ADAPTER_CLASSES[name].partition(":")
    try:
        adapter = getattr(importlib.import_module(module_name), class_name)()
    except Exception:  # noqa: BLE001 - reported in full by test_adapter_loads
        return None, f"cannot load adapter {name!r} ({ADAPTER_CLASSES[name]}):\n{traceback.format_exc()}"
    return adapter, None


def pytest_report_header(config):
    return f"kvspec conformance adapters (KVSPEC_ADAPTERS): {', '.join(requested_adapters())}"


def pytest_generate_tests(metafunc):
    if "adapter_name" in metafunc.fixturenames:
        names = requested_adapters()
        metafunc.parametrize("adapter_name", names, ids=list(names))
    if "conformance_item" in metafunc.fixturenames:
        items = []
        for name in requested_adapters():
            adapter, _ = load_adapter(name)
            if adapter is not None:
                items.extend(conformance_items(adapter))
        metafunc.parametrize("conformance_item", items, ids=[item.id for item in items])


@pytest.fixture
def adapter_loader():
    return load_adapter
