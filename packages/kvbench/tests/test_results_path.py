"""results_path: the folder KVBENCH_RESULTS names, and a clear error when it is unset."""

from __future__ import annotations

import pytest
from kvbench import results
from kvbench.results import CompareError


def test_results_path_joins_the_name_onto_the_folder_the_env_var_names(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_ENV_VAR, str(tmp_path))
    out = results.results_path("x.json")
    assert out == tmp_path / "x.json"
    assert results.write_json(out, {"a": 1}) == out and results.read_json(out) == {"a": 1}


@pytest.mark.parametrize("value", [None, ""])
def test_unset_says_which_variable(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(results.RESULTS_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(results.RESULTS_ENV_VAR, value)
    with pytest.raises(CompareError, match="KVBENCH_RESULTS is not set.*x.json"):
        results.results_path("x.json")
