"""Offline calibration: per-layer, per-KV-head projections fitted on calibration text.

Two parts: :mod:`palu_mlx.calibration.file` is the file (:class:`Calibration`,
:class:`TensorCalibration`: what it holds, writing, reading, checking it, and the fingerprint of
the model it fits); :mod:`palu_mlx.calibration.fit` makes one (:func:`calibrate`: runs the model
over text, records keys and values, fits the bases, optionally weighted by attention).

``KVCacheConfig(palu_calibration=FILE)`` makes :meth:`KVCacheBuilder.for_model` build
:class:`~palu_mlx.calibrated.CalibratedKVCache` layers from such a file.
"""

from .file import (
    CALIBRATION_FORMAT,
    WEIGHTINGS,
    Calibration,
    TensorCalibration,
    kv_weights_digest,
    kv_weights_fingerprint,
    model_identity,
)
from .fit import COMPUTE_DTYPES, DEFAULT_MAX_TOKENS, calibrate, default_calibration_text

__all__ = [
    "Calibration",
    "TensorCalibration",
    "calibrate",
    "default_calibration_text",
    "kv_weights_digest",
    "kv_weights_fingerprint",
    "model_identity",
    "CALIBRATION_FORMAT",
    "WEIGHTINGS",
    "COMPUTE_DTYPES",
    "DEFAULT_MAX_TOKENS",
]
