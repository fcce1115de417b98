"""Every kvspec conformance check against every adapter named in KVSPEC_ADAPTERS.

Ids read ``<adapter>-<case>-<vector>-<check>`` (``config`` in place of a vector for checks
that run once per configuration). Only applicable items are generated: checks whose
capability a case lacks, and vectors of dtypes an adapter does not accept, are left out
rather than skipped.
"""

from __future__ import annotations

import pytest
from kvspec.conformance import PASSED


def test_adapter_loads(adapter_name, adapter_loader):
    adapter, error = adapter_loader(adapter_name)
    if error is not None:
        pytest.fail(error, pytrace=False)
    assert adapter.configs(), f"adapter {adapter_name!r} declares no configurations"


def test_conformance(conformance_item):
    assert conformance_item.run() == PASSED
