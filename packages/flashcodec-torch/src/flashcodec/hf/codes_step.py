"""Which forward attends on the codes: the hand-off between a codec layer and the attention function.

While a model that :func:`flashcodec.hf.apply_codec_attention` set up runs a forward in eval mode,
:data:`CODES_STEP` holds its :class:`CodesStep`. A :class:`~flashcodec.hf.FlashCodecLayer` that
sees one appends the step's keys and values to its codes without reading them back, and returns
the step's own tensors tagged with the layer (:func:`tag_step`); the attention function the model
calls next finds the layer through the tag (:func:`step_layer`) and attends on the codes. Outside
such a forward (another model, training, a plain ``model(...)`` of an unpatched model) the layer
returns its reconstructed view, as transformers expects.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import torch

__all__ = ["CODES_STEP", "CodesStep", "codes_step_active", "step_layer", "tag_step"]

_TAG = "_flashcodec_step_layer"


@dataclasses.dataclass
class CodesStep:
    """One patched model's forward in progress.

    Attributes:
        active: False in training mode (the layers then hand back views and nothing is coded).
        backend: the decode kernel's backend (``"auto"``, ``"torch"`` or ``"triton"``).
        stats: the model's :class:`~flashcodec.hf.codec_attention.CodecAttentionStats`.
    """

    active: bool
    backend: str
    stats: Any


#: the forward in progress, or None (a context variable: each thread and task sees its own)
CODES_STEP: contextvars.ContextVar[CodesStep | None] = contextvars.ContextVar(
    "flashcodec_codes_step", default=None
)


def codes_step_active() -> bool:
    """Whether codec layers should hand their step to the attention function instead of a view."""
    step = CODES_STEP.get()
    return step is not None and step.active


def tag_step(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aliases of the step's ``keys [B, H, s, D]`` / ``values [B, H, s, Dv]`` that name ``layer``
    (new tensor objects over the same storage, so the caller's tensors carry no tag)."""
    keys, values = keys.view(keys.shape), values.view(values.shape)
    setattr(keys, _TAG, layer)
    setattr(values, _TAG, layer)
    return keys, values


def step_layer(keys: Any) -> Any:
    """The codec layer a tagged key tensor came from, or None."""
    return getattr(keys, _TAG, None) if isinstance(keys, torch.Tensor) else None
