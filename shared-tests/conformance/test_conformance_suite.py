"""Every kvspec conformance check against every adapter named in ``KVSPEC_ADAPTERS``.

``KVSPEC_ADAPTERS`` is a comma list (default ``reference``) of names from
:data:`ADAPTER_CLASSES`. An adapter named there that cannot be imported, or an unknown name,
fails ``test_adapter_loads[<name>]`` with the traceback; it is never skipped.

Ids read ``<adapter>-<case>-<vector>-<check>`` (``config`` in place of a vector for checks
that run once per configuration). Only applicable items are generated: checks whose
capability a case lacks, and vectors of dtypes an adapter does not accept, are left out
rather than skipped.

The adapter selection lives here rather than in a ``conftest.py``: the package test suites
run in the same pytest session and import helpers with ``from conftest import ...``, which a
second ``conftest`` module in the session would shadow.
"""

from __future__ import annotations

import importlib
import os
import traceback
from functools import cache

import pytest
from kvspec.conformance import PASSED, conformance_items

ADAPTER_CLASSES = {
    "reference": "kvspec.reference:ReferenceAdapter",
    "palu": "palu_mlx.kvspec_adapter:PaluAdapter",
    "flashcodec": "flashcodec.kvspec_adapter:FlashCodecAdapter",
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


def test_adapter_loads(adapter_name):
    adapter, error = load_adapter(adapter_name)
    if error is not None:
        pytest.fail(error, pytrace=False)
    assert adapter.configs(), f"adapter {adapter_name!r} declares no configurations"


def test_conformance(conformance_item):
    assert conformance_item.run() == PASSED
