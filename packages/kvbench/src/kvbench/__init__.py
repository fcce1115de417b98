"""kvbench: the one measuring harness behind ``palu-mlx compare`` and ``flashcodec compare``.

* :mod:`kvbench.protocol`: the side-by-side protocol (KL to the baseline, top-1 agreement,
  perplexity, held / resident / peak bytes, speed ratios) over a framework's :class:`Runner`.
* :mod:`kvbench.results`: the result document, its stamp (machine, versions, date), strict JSON.
* :mod:`kvbench.report`: terminal and markdown tables, the chart.
* :mod:`kvbench.cli`: the options both compare commands share and the short- and long-context runs.
* :mod:`kvbench.models`: the default inputs (the shipped held-out text, the embedded model).
* :mod:`kvbench.process`: a server in a child process on a free port, waited for and stopped.
"""

from .models import default_text_path, embedded_model_path
from .passkey import run_passkey
from .protocol import MEASURES, Candidate, KVBytes, Runner, Settings, measure
from .results import SCHEMA, CompareError, build_result, read_json, run_of, write_json

__version__ = "0.1.0"

__all__ = [
    "MEASURES",
    "SCHEMA",
    "Candidate",
    "CompareError",
    "KVBytes",
    "Runner",
    "Settings",
    "build_result",
    "default_text_path",
    "embedded_model_path",
    "measure",
    "read_json",
    "run_of",
    "run_passkey",
    "write_json",
]
