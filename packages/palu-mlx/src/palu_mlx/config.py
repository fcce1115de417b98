"""KVCacheConfig: a palu cache's configuration as a few objects, checked once when made.

A config is its coder (:class:`~palu_mlx.coders.Rotation`, the default; the fitted latent coders
:class:`~palu_mlx.coders.WaterFilling` and :class:`~palu_mlx.coders.HiLoSplit`; or the naive
baseline's :class:`~palu_mlx.coders.naive.NaiveQuant`), where the basis comes from
(:class:`~palu_mlx.config_parts.Fitting`), which tokens stay exact
(:class:`~palu_mlx.config_parts.ExactTokens`), how side information is stored
(:class:`~palu_mlx.config_parts.SideInformation`) and three switches. The reference description's
flat keywords (``method=``, ``palu_rank=``, ``palu_bits=`` ...) are accepted by the same constructor,
which builds the objects, and read back as properties of the same names.

A bad value raises :class:`kvspec.KVConfigError` naming the keyword, the value given and what is
allowed, so a typo fails at construction instead of deep in a model forward.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvspec import KVConfigError

from .coders.hilo import HiLoSplit
from .coders.naive import NaiveQuant
from .coders.rotation import DEFAULT_ROTATION_BITS, ROTATION_BITS_ALLOWED, Rotation
from .coders.water_filling import DEFAULT_PALU_BITS, WaterFilling, is_weight
from .config_parts import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, ExactTokens, Fitting, SideInformation
from .json_text import parse_json_text
from .mixed_bit import PACKABLE_BITS, UNQUANTIZED_BITS

__all__ = [
    "KVCacheConfig",
    "PACKABLE_BITS",
    "UNQUANTIZED_BITS",
    "METHODS",
    "KEYWORDS",
    "DEFAULT_PALU_BITS",
    "DEFAULT_ROTATION_BITS",
    "REFERENCE_SPLIT",
    "DEFAULT_SINK_TOKENS",
    "DEFAULT_RECENT_TOKENS",
]

#: ``"rotation"`` (the default) is the code with nothing fitted but means
#: (:mod:`palu_mlx.rotation_code`); ``"palu"`` the low-rank latent cache; ``"naive"`` the uniform
#: group-quant baseline.
METHODS: tuple[str, ...] = ("rotation", "palu", "naive")
#: the reference's rank and hi/lo split (the ``reference-default`` tier), for the keywords a
#: config leaves unset when it asks for the split
REFERENCE_SPLIT: dict[str, float] = {
    "palu_energy_threshold": 0.90,
    "palu_hi_bit": 4,
    "palu_lo_bit": 2,
    "palu_hi_fraction": 0.25,
}
#: every keyword of the flat form and what it is when not given (None: decided by the other keywords)
KEYWORDS: dict[str, Any] = {
    "method": None,
    "head_dim": None,
    "palu_rank": None,
    "palu_energy_threshold": None,
    "palu_n_head_groups": None,
    "palu_hi_bit": None,
    "palu_lo_bit": None,
    "palu_hi_fraction": None,
    "palu_group_size": 32,
    "palu_quantize_values": True,
    "palu_bits": None,
    "palu_calibration": None,
    "palu_sensitivity": None,
    "palu_key_weight": 1.0,
    "palu_value_weight": 1.0,
    "palu_relative_error": None,
    "palu_min_fit_tokens": None,
    "palu_check_finite": True,
    "palu_pre_rope": True,
    "palu_token_scale": True,
    "palu_sink_tokens": DEFAULT_SINK_TOKENS,
    "palu_recent_tokens": DEFAULT_RECENT_TOKENS,
    "palu_basis_bits": 16,
    "palu_scale_bits": 16,
    "palu_recent_bits": None,
    "palu_fill_rows": False,
    "naive_bits": 2,
    "naive_group_size": 64,
}
#: keywords only the fitted latent cache reads: one given a value other than its default (or ``coder=``
#: a fitted coder) without a ``method`` asks for ``method="palu"``
_FITTED_ONLY = (
    "palu_rank", "palu_energy_threshold", "palu_n_head_groups", "palu_hi_bit", "palu_lo_bit",
    "palu_hi_fraction", "palu_group_size", "palu_quantize_values", "palu_bits", "palu_calibration",
    "palu_sensitivity", "palu_key_weight", "palu_value_weight", "palu_relative_error",
    "palu_min_fit_tokens", "palu_basis_bits", "palu_scale_bits", "palu_fill_rows",
)  # fmt: skip
#: keywords that choose the fitted coder (``coder=`` must not be contradicted by them)
_CHOOSING = ("palu_bits", "palu_energy_threshold", "palu_hi_bit", "palu_lo_bit", "palu_hi_fraction")
#: the newest tokens' storage when not given: int8 for the rotation code (2.4% fewer bytes than 16 bits
#: at 2,048 tokens for a KL within 1% on SmolLM2, ``benchmarks/results/palu_frontier.json``,
#: rotation-4bit against rotation-4bit-recent16); as given for the fitted cache, as it was measured
_RECENT_BITS = {"rotation": 8, "palu": 16, "naive": 16}


def _is_int(value: Any) -> bool:
    # bool is an int subclass; True as a rank or bit width is always a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _or_reference_split(keyword: str) -> property:
    """A read-only property: the flat ``keyword``, or its :data:`REFERENCE_SPLIT` value when unset."""

    def read(config: KVCacheConfig) -> float:
        value = getattr(config, keyword)
        return REFERENCE_SPLIT[keyword] if value is None else value

    return property(read, doc=f"``{keyword}``, or the reference's {REFERENCE_SPLIT[keyword]} when unset.")


@dataclass(frozen=True, init=False)
class KVCacheConfig:
    """Configuration of a palu KV cache (the rotation code, the fitted latent cache or the naive baseline).

    ``KVCacheConfig()`` is the default tier, ``rotation-3.5bit``: nothing fitted but each head's mean,
    keys before RoPE where the model allows it, a fixed Hadamard rotation of each head's channels, 4
    bits per rotated key channel and 3 per value channel under a per-token scale, the first 4 tokens
    exact and the newest 32 in int8. Made either from the objects below or from the flat keywords
    (both at once where they agree); :meth:`replace` changes keywords, :meth:`keywords` reads them all.

    Attributes:
        head_dim: the model's key head dimension ``D``; checked against the model and every
            ``update_and_fetch``. None takes the ``D`` of the model (or of the first update).
        coder: :class:`~palu_mlx.coders.Rotation` (``method="rotation"``),
            :class:`~palu_mlx.coders.WaterFilling` or :class:`~palu_mlx.coders.HiLoSplit`
            (``method="palu"``), or :class:`~palu_mlx.coders.naive.NaiveQuant` (``method="naive"``).
        fitting: :class:`~palu_mlx.config_parts.Fitting`, the fitted basis' rank, head groups and files.
        exact: :class:`~palu_mlx.config_parts.ExactTokens`, the tokens held beside their codes.
        side: :class:`~palu_mlx.config_parts.SideInformation`, how the basis and scales are stored.
        quantize_values: False keeps the fitted cache's value latents unquantized (still low-rank).
        pre_rope: code keys as they were before RoPE where the model's layers allow it
            (:func:`~palu_mlx.rope.model_rotaries`), rotating them back at their positions.
        check_finite: reject NaN / inf keys and values (one device sync per layer call).

    The flat keywords (read back as properties of the same names):

    - ``method``: ``"rotation"``, ``"palu"`` or ``"naive"``; left out, a config giving any keyword
      only the fitted cache reads (``palu_bits``, ``palu_rank``, ``palu_calibration`` ...) a value
      other than its default, or a fitted ``coder=``, is ``"palu"``, and any other is ``"rotation"``.
    - ``palu_bits``: the rotation code's bits per rotated channel, in halves from 2 to 8 (3.5: keys 4,
      values 3; None: 3.5); the fitted cache's average code bits per element (a number in ``(0, 8]``,
      water-filling; None: :data:`DEFAULT_PALU_BITS` unless the split is asked for).
    - ``palu_rank``, ``palu_energy_threshold``, ``palu_hi_bit``, ``palu_lo_bit``, ``palu_hi_fraction``:
      the reference's rank + hi/lo split (any of them set without ``palu_bits``; unset ones from
      :data:`REFERENCE_SPLIT`; widths 1, 2, 3, 4, 5, 6, 8 or 16 = unquantized). ``palu_rank`` also caps
      the water-filling coder's full rank.
    - ``palu_n_head_groups``, ``palu_min_fit_tokens``, ``palu_calibration``, ``palu_sensitivity``:
      :class:`~palu_mlx.config_parts.Fitting`'s fields.
    - ``palu_token_scale``, ``palu_key_weight``, ``palu_value_weight``, ``palu_relative_error``:
      :class:`~palu_mlx.coders.WaterFilling`'s ``token_scale``, weights and ``relative`` (None:
      automatic, relative error when fitted at the prefill with weights 1 and no file).
    - ``palu_sink_tokens`` (4), ``palu_recent_tokens`` (32), ``palu_recent_bits`` (None: 8 for the
      rotation code, 16 for the fitted cache): :class:`~palu_mlx.config_parts.ExactTokens`.
    - ``palu_group_size`` (32), ``palu_basis_bits``, ``palu_scale_bits`` (16 or 8), ``palu_fill_rows``:
      :class:`~palu_mlx.config_parts.SideInformation`.
    - ``palu_quantize_values``, ``palu_pre_rope``, ``palu_check_finite``: the three switches.
    - ``naive_bits`` (2), ``naive_group_size`` (64): the naive baseline's
      :class:`~palu_mlx.coders.naive.NaiveQuant`.
    """

    head_dim: int | None
    coder: Rotation | WaterFilling | HiLoSplit | NaiveQuant
    fitting: Fitting
    exact: ExactTokens
    side: SideInformation
    quantize_values: bool
    pre_rope: bool
    check_finite: bool

    def __init__(
        self,
        method: str | None = None,
        head_dim: int | None = None,
        coder: Rotation | WaterFilling | HiLoSplit | NaiveQuant | None = None,
        fitting: Fitting | None = None,
        exact: ExactTokens | None = None,
        side: SideInformation | None = None,
        quantize_values: bool | None = None,
        pre_rope: bool | None = None,
        check_finite: bool | None = None,
        **keywords: Any,
    ) -> None:
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise KVConfigError(
                f"unknown KVCacheConfig keyword(s) {unknown}; allowed: the fields {sorted(_FIELDS)} "
                f"and the keywords {sorted(KEYWORDS)}"
            )
        given = dict(keywords)
        for name, value in (("method", method), ("head_dim", head_dim), ("palu_quantize_values", quantize_values),
                            ("palu_pre_rope", pre_rope), ("palu_check_finite", check_finite)):  # fmt: skip
            if value is not None:
                given.setdefault(name, value)
        for name, part, kind in (("fitting", fitting, Fitting), ("exact", exact, ExactTokens),
                                 ("side", side, SideInformation)):  # fmt: skip
            if part is not None and not isinstance(part, kind):
                raise KVConfigError(
                    f"{name}={part!r} must be None or a palu_mlx.config_parts.{kind.__name__}"
                )
            for key, value in _keywords_of(part).items():
                given.setdefault(key, value)
        if coder is not None:
            _take_coder(coder, given)
        k = SimpleNamespace(**{**KEYWORDS, **given})
        if k.method is None:
            named = [name for name in _FITTED_ONLY if given.get(name) not in (None, KEYWORDS[name])]
            k.method = "palu" if named else "rotation"
        if k.palu_recent_bits is None and k.method in _RECENT_BITS:
            k.palu_recent_bits = _RECENT_BITS[k.method]
        _check(k)
        object.__setattr__(self, "head_dim", k.head_dim)
        object.__setattr__(self, "coder", _coder_of(k))
        object.__setattr__(
            self,
            "fitting",
            Fitting(k.palu_rank, k.palu_energy_threshold, k.palu_n_head_groups, k.palu_min_fit_tokens,
                    k.palu_calibration, k.palu_sensitivity),
        )  # fmt: skip
        object.__setattr__(
            self, "exact", ExactTokens(k.palu_sink_tokens, k.palu_recent_tokens, k.palu_recent_bits)
        )
        object.__setattr__(
            self,
            "side",
            SideInformation(k.palu_group_size, k.palu_basis_bits, k.palu_scale_bits, k.palu_fill_rows),
        )
        object.__setattr__(self, "quantize_values", k.palu_quantize_values)
        object.__setattr__(self, "pre_rope", k.palu_pre_rope)
        object.__setattr__(self, "check_finite", k.palu_check_finite)

    # -- the flat keywords, read back ------------------------------------------------------------

    @property
    def method(self) -> str:
        """``"rotation"``, ``"palu"`` or ``"naive"``: which coder :attr:`coder` is."""
        if isinstance(self.coder, Rotation):
            return "rotation"
        return "naive" if isinstance(self.coder, NaiveQuant) else "palu"

    def keywords(self) -> dict[str, Any]:
        """Every flat keyword of this config (what :meth:`to_json` writes; ``KVCacheConfig(**it)``
        makes an equal config)."""
        return {name: getattr(self, name) for name in KEYWORDS}

    def replace(self, **changes: Any) -> KVCacheConfig:
        """A new config: this one's keywords with ``changes`` (flat keywords) on top; ``self`` unchanged."""
        return KVCacheConfig(**{**self.keywords(), **changes})

    palu_rank = property(lambda self: self.fitting.rank, doc="Fitting.rank")
    palu_energy_threshold = property(
        lambda self: self.fitting.energy_threshold, doc="Fitting.energy_threshold"
    )
    palu_n_head_groups = property(lambda self: self.fitting.n_head_groups, doc="Fitting.n_head_groups")
    palu_min_fit_tokens = property(lambda self: self.fitting.min_fit_tokens, doc="Fitting.min_fit_tokens")
    palu_calibration = property(lambda self: self.fitting.calibration, doc="Fitting.calibration")
    palu_sensitivity = property(lambda self: self.fitting.sensitivity, doc="Fitting.sensitivity")
    palu_sink_tokens = property(lambda self: self.exact.sink, doc="ExactTokens.sink")
    palu_recent_tokens = property(lambda self: self.exact.recent, doc="ExactTokens.recent")
    palu_recent_bits = property(lambda self: self.exact.recent_bits, doc="ExactTokens.recent_bits")
    palu_group_size = property(lambda self: self.side.group_size, doc="SideInformation.group_size")
    palu_basis_bits = property(lambda self: self.side.basis_bits, doc="SideInformation.basis_bits")
    palu_scale_bits = property(lambda self: self.side.scale_bits, doc="SideInformation.scale_bits")
    palu_fill_rows = property(lambda self: self.side.fill_rows, doc="SideInformation.fill_rows")
    palu_quantize_values = property(lambda self: self.quantize_values, doc="quantize_values")
    palu_pre_rope = property(lambda self: self.pre_rope, doc="pre_rope")
    palu_check_finite = property(lambda self: self.check_finite, doc="check_finite")

    @property
    def palu_bits(self) -> float | None:
        """The rotation code's or the water-filling coder's bits; None for the hi/lo split and the naive baseline."""
        return self.coder.bits if isinstance(self.coder, (Rotation, WaterFilling)) else None

    def _water(self, name: str, default: Any) -> Any:
        return getattr(self.coder, name) if isinstance(self.coder, WaterFilling) else default

    palu_token_scale = property(lambda self: self._water("token_scale", True), doc="WaterFilling.token_scale")
    palu_key_weight = property(lambda self: self._water("key_weight", 1.0), doc="WaterFilling.key_weight")
    palu_value_weight = property(
        lambda self: self._water("value_weight", 1.0), doc="WaterFilling.value_weight"
    )
    palu_relative_error = property(lambda self: self._water("relative", None), doc="WaterFilling.relative")

    def _split_field(self, name: str) -> Any:
        return getattr(self.coder, name) if isinstance(self.coder, HiLoSplit) else None

    palu_hi_bit = property(lambda self: self._split_field("hi_bit"), doc="HiLoSplit.hi_bit")
    palu_lo_bit = property(lambda self: self._split_field("lo_bit"), doc="HiLoSplit.lo_bit")
    palu_hi_fraction = property(lambda self: self._split_field("hi_fraction"), doc="HiLoSplit.hi_fraction")
    naive_bits = property(
        lambda self: self.coder.bits if isinstance(self.coder, NaiveQuant) else KEYWORDS["naive_bits"],
        doc="NaiveQuant.bits",
    )
    naive_group_size = property(
        lambda self: (
            self.coder.group_size if isinstance(self.coder, NaiveQuant) else KEYWORDS["naive_group_size"]
        ),
        doc="NaiveQuant.group_size",
    )

    # -- what the coder choice resolves to -------------------------------------------------------

    @property
    def coder_choice(self) -> Rotation | WaterFilling | HiLoSplit | NaiveQuant:
        """:attr:`coder` with the automatic weighing resolved: a water-filling coder's ``relative``
        None becomes False under a calibration or a sensitivity profile (a calibration sets its own
        widths, a profile's weights are per unit of squared error) and its
        :attr:`~palu_mlx.coders.WaterFilling.relative_error` otherwise."""
        coder = self.coder
        if not isinstance(coder, WaterFilling):
            return coder
        relative = coder.relative
        if relative is None:
            files = self.fitting.calibration is not None or self.fitting.sensitivity is not None
            relative = False if files else coder.relative_error
        return dataclasses.replace(coder, relative=relative)

    @property
    def uses_split(self) -> bool:
        """Whether the latents are coded by the reference's rank + hi/lo split."""
        return isinstance(self.coder, HiLoSplit)

    @property
    def relative_error(self) -> bool:
        """Whether the water-filling level weighs relative error (:attr:`coder_choice`'s
        :attr:`~palu_mlx.coders.WaterFilling.relative_error`); False for every other coder."""
        coder = self.coder_choice
        return isinstance(coder, WaterFilling) and coder.relative_error

    @property
    def coder_bits(self) -> float | None:
        """Code bits of the water-filling coder or the rotation code (:attr:`palu_bits`); None for the
        hi/lo split and the naive baseline."""
        return self.palu_bits

    energy_threshold = _or_reference_split("palu_energy_threshold")
    hi_bit = _or_reference_split("palu_hi_bit")
    lo_bit = _or_reference_split("palu_lo_bit")
    hi_fraction = _or_reference_split("palu_hi_fraction")

    def for_head_dim(self, head_dim: int | None) -> KVCacheConfig:
        """This config for a model whose key head dim is ``head_dim`` (None: unknown).

        ``head_dim`` left None takes the model's, so ``KVCacheConfig()`` fits any model; the other
        model-dependent fields stay None and are read from the layer (one head group per KV head,
        ``head_dim`` tokens before the fit). A different ``head_dim`` given, or a ``palu_rank`` above
        the model's head dim, raises ``KVConfigError``; ``self`` is never changed.
        """
        if head_dim is None or self.head_dim == head_dim:
            return self
        if self.head_dim is not None:
            raise KVConfigError(
                f"head_dim={self.head_dim} does not match the model's head_dim {head_dim}; "
                f"allowed: {head_dim}, or None to take the model's"
            )
        if self.palu_rank is not None and self.palu_rank > head_dim:
            raise KVConfigError(
                f"palu_rank={self.palu_rank} exceeds the model's head_dim {head_dim}; "
                f"allowed: None or an integer in [1, {head_dim}]"
            )
        return self.replace(head_dim=head_dim)

    def head_groups(self, n_heads: int) -> int:
        """Head groups for a layer of ``n_heads`` KV heads: ``palu_n_head_groups``, or one per head
        when it is None. (Whether it divides ``n_heads`` is checked where the heads are known.)"""
        return n_heads if self.palu_n_head_groups is None else self.palu_n_head_groups

    def min_fit_tokens(self, dim: int) -> int:
        """Tokens held exactly before fitting: ``palu_min_fit_tokens``, or the key head dim ``dim``."""
        return dim if self.palu_min_fit_tokens is None else self.palu_min_fit_tokens

    def to_json(self) -> str:
        """The configuration as a JSON object of its flat keywords (:meth:`keywords`; used in ``meta_state``)."""
        return json.dumps(self.keywords(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVCacheConfig:
        """Inverse of :meth:`to_json`; unknown keys, invalid JSON or values raise ``KVConfigError``."""
        data = parse_json_text(text, dict, "KVCacheConfig.from_json's text", KVConfigError)
        unknown = sorted(set(data) - set(KEYWORDS))
        if unknown:
            raise KVConfigError(f"unknown KVCacheConfig keywords {unknown}; known: {sorted(KEYWORDS)}")
        return cls(**data)


#: what the constructor takes by name besides the flat keywords: ``method`` and the fields
_FIELDS = (
    "method",
    "head_dim",
    "coder",
    "fitting",
    "exact",
    "side",
    "quantize_values",
    "pre_rope",
    "check_finite",
)


#: per part object and coder, each flat keyword it holds and the attribute that holds it
_KEYWORD_ATTRIBUTES: dict[type, dict[str, str]] = {
    Fitting: {
        "palu_rank": "rank",
        "palu_energy_threshold": "energy_threshold",
        "palu_n_head_groups": "n_head_groups",
        "palu_min_fit_tokens": "min_fit_tokens",
        "palu_calibration": "calibration",
        "palu_sensitivity": "sensitivity",
    },
    ExactTokens: {
        "palu_sink_tokens": "sink",
        "palu_recent_tokens": "recent",
        "palu_recent_bits": "recent_bits",
    },
    SideInformation: {
        "palu_group_size": "group_size",
        "palu_basis_bits": "basis_bits",
        "palu_scale_bits": "scale_bits",
        "palu_fill_rows": "fill_rows",
    },
    WaterFilling: {
        "palu_bits": "bits",
        "palu_token_scale": "token_scale",
        "palu_key_weight": "key_weight",
        "palu_value_weight": "value_weight",
        "palu_relative_error": "relative",
    },
    HiLoSplit: {"palu_hi_bit": "hi_bit", "palu_lo_bit": "lo_bit", "palu_hi_fraction": "hi_fraction"},
    Rotation: {"palu_bits": "bits"},
    NaiveQuant: {"naive_bits": "bits", "naive_group_size": "group_size"},
}
#: the method each coder is
_CODER_METHODS: dict[type, str] = {
    WaterFilling: "palu",
    HiLoSplit: "palu",
    Rotation: "rotation",
    NaiveQuant: "naive",
}


def _keywords_of(part: Any) -> dict[str, Any]:
    """The flat keywords a part (:class:`Fitting`, :class:`ExactTokens`, :class:`SideInformation`)
    or a coder says; none for anything else (None)."""
    for kind, attributes in _KEYWORD_ATTRIBUTES.items():
        if isinstance(part, kind):
            return {keyword: getattr(part, attribute) for keyword, attribute in attributes.items()}
    return {}


def _take_coder(coder: Any, given: dict[str, Any]) -> None:
    """Write ``coder``'s keywords into ``given``: each keyword it owns must be unset or agree."""
    method = next((method for kind, method in _CODER_METHODS.items() if isinstance(coder, kind)), None)
    if method is None:
        raise KVConfigError(
            f"coder={coder!r} must be None or one of palu_mlx.coders.Rotation, WaterFilling, HiLoSplit, NaiveQuant"
        )
    owned = _keywords_of(coder)
    if given.get("method", method) != method:
        raise KVConfigError(f"coder={coder!r} is method={method!r}; got method={given['method']!r}")
    # the energy threshold is the fitting's: it chooses the split only when no coder is given
    for name in sorted({*_CHOOSING, *owned} - {"palu_energy_threshold"}):
        value = given.get(name)
        agrees = value == owned[name] if name in owned else False
        # a keyword left at its default (not a choosing one) says nothing against the coder
        left = name not in _CHOOSING and value == KEYWORDS[name]
        if value is None or agrees or left:
            continue
        raise KVConfigError(
            f"coder={coder!r} and {name}={value!r} both choose the coder; allowed: one of them "
            f"({name} unset, or equal to what the coder says; config.replace({name}=...) changes a "
            "config's coder)"
        )
    given.update(owned, method=method)


def _chooses_split(k: SimpleNamespace) -> bool:
    """Whether the keywords ask for the reference's rank + hi/lo split: no ``palu_bits`` and any of
    ``palu_rank``, ``palu_energy_threshold``, ``palu_hi_bit``, ``palu_lo_bit``, ``palu_hi_fraction``."""
    split = (k.palu_rank, k.palu_energy_threshold, k.palu_hi_bit, k.palu_lo_bit, k.palu_hi_fraction)
    return k.method == "palu" and k.palu_bits is None and any(v is not None for v in split)


def _coder_of(k: SimpleNamespace) -> Rotation | WaterFilling | HiLoSplit | NaiveQuant:
    """The coder object checked keywords ``k`` choose."""
    if k.method == "rotation":
        return Rotation(DEFAULT_ROTATION_BITS if k.palu_bits is None else float(k.palu_bits))
    if k.method == "naive":
        return NaiveQuant(k.naive_bits, k.naive_group_size)
    if _chooses_split(k):
        return HiLoSplit(
            *(REFERENCE_SPLIT[n] if getattr(k, n) is None else getattr(k, n)
              for n in ("palu_hi_bit", "palu_lo_bit", "palu_hi_fraction"))
        )  # fmt: skip
    bits = DEFAULT_PALU_BITS if k.palu_bits is None else k.palu_bits
    return WaterFilling(
        bits, k.palu_token_scale, k.palu_key_weight, k.palu_value_weight, k.palu_relative_error
    )


def _check(k: SimpleNamespace) -> None:
    """Check flat keywords ``k`` (path-like files become strings); ``KVConfigError`` naming the keyword."""
    if k.method not in METHODS:
        raise KVConfigError(f"method={k.method!r} is not supported; allowed: {', '.join(METHODS)}")
    if k.head_dim is not None and (not _is_int(k.head_dim) or k.head_dim < 1):
        raise KVConfigError(
            f"head_dim={k.head_dim!r} must be a positive integer (the model's head dim) or None"
        )
    if k.palu_rank is not None and (
        not _is_int(k.palu_rank) or k.palu_rank < 1 or (k.head_dim is not None and k.palu_rank > k.head_dim)
    ):
        raise KVConfigError(
            f"palu_rank={k.palu_rank!r} must be None or an integer in [1, head_dim={k.head_dim}]"
        )
    t = k.palu_energy_threshold
    if t is not None and (not _is_real(t) or not math.isfinite(t) or not 0.0 < t <= 1.0):
        raise KVConfigError(f"palu_energy_threshold={t!r} must be None or a number in (0, 1]")
    if k.palu_n_head_groups is not None and (not _is_int(k.palu_n_head_groups) or k.palu_n_head_groups < 1):
        raise KVConfigError(
            f"palu_n_head_groups={k.palu_n_head_groups!r} must be None (one group per KV head) "
            "or a positive integer (the number of head groups; the layer's KV head count must be "
            "divisible by it)"
        )
    allowed = (*PACKABLE_BITS, UNQUANTIZED_BITS)
    for name in ("palu_hi_bit", "palu_lo_bit"):
        value = getattr(k, name)
        if value is not None and (not _is_int(value) or value not in allowed):
            raise KVConfigError(
                f"{name}={value!r} cannot be packed; allowed: None, {', '.join(map(str, allowed))} "
                "(16 = keep unquantized)"
            )
    f = k.palu_hi_fraction
    if f is not None and (not _is_real(f) or not math.isfinite(f) or not 0.0 <= f <= 1.0):
        raise KVConfigError(f"palu_hi_fraction={f!r} must be None or a number in [0, 1]")
    if not _is_int(k.palu_group_size) or k.palu_group_size < 1:
        raise KVConfigError(f"palu_group_size={k.palu_group_size!r} must be a positive integer")
    b = k.palu_bits
    if b is not None and (not _is_real(b) or not math.isfinite(b) or not 0.0 < b <= 8.0):
        raise KVConfigError(f"palu_bits={b!r} must be None or a number in (0, 8] (code bits per element)")
    if isinstance(k.palu_calibration, os.PathLike):
        k.palu_calibration = os.fspath(k.palu_calibration)
    if k.palu_calibration is not None and (not isinstance(k.palu_calibration, str) or not k.palu_calibration):
        raise KVConfigError(f"palu_calibration={k.palu_calibration!r} must be None or a file path")
    if isinstance(k.palu_sensitivity, os.PathLike):
        k.palu_sensitivity = os.fspath(k.palu_sensitivity)
    if k.palu_sensitivity is not None and (not isinstance(k.palu_sensitivity, str) or not k.palu_sensitivity):
        raise KVConfigError(
            f"palu_sensitivity={k.palu_sensitivity!r} must be None or a file path (a sensitivity profile)"
        )
    if k.palu_relative_error is not None and not isinstance(k.palu_relative_error, bool):
        raise KVConfigError(
            f"palu_relative_error={k.palu_relative_error!r} must be None (automatic), True or False"
        )
    for name in ("palu_key_weight", "palu_value_weight"):
        if not is_weight(getattr(k, name)):
            raise KVConfigError(
                f"{name}={getattr(k, name)!r} must be a finite number > 0 (a water-filling weight)"
            )
    if not isinstance(k.palu_quantize_values, bool):
        raise KVConfigError(f"palu_quantize_values={k.palu_quantize_values!r} must be True or False")
    if k.palu_min_fit_tokens is not None and (
        not _is_int(k.palu_min_fit_tokens) or k.palu_min_fit_tokens < 1
    ):
        raise KVConfigError(
            f"palu_min_fit_tokens={k.palu_min_fit_tokens!r} must be None (= head_dim) or a positive integer"
        )
    if not isinstance(k.palu_check_finite, bool):
        raise KVConfigError(f"palu_check_finite={k.palu_check_finite!r} must be True or False")
    if not isinstance(k.palu_pre_rope, bool):
        raise KVConfigError(f"palu_pre_rope={k.palu_pre_rope!r} must be True or False")
    if not _is_int(k.palu_sink_tokens) or k.palu_sink_tokens < 0:
        raise KVConfigError(
            f"palu_sink_tokens={k.palu_sink_tokens!r} must be a non-negative integer "
            "(tokens at the start of the sequence kept exactly)"
        )
    if not _is_int(k.palu_recent_tokens) or k.palu_recent_tokens < 0:
        raise KVConfigError(
            f"palu_recent_tokens={k.palu_recent_tokens!r} must be a non-negative integer "
            "(the newest tokens kept exactly)"
        )
    if not isinstance(k.palu_token_scale, bool):
        raise KVConfigError(f"palu_token_scale={k.palu_token_scale!r} must be True or False")
    for name in ("palu_basis_bits", "palu_scale_bits", "palu_recent_bits"):
        value = getattr(k, name)
        if not _is_int(value) or value not in (16, 8):
            raise KVConfigError(f"{name}={value!r} must be 16 (as given) or 8 (compact)")
    if not isinstance(k.palu_fill_rows, bool):
        raise KVConfigError(f"palu_fill_rows={k.palu_fill_rows!r} must be True or False")
    if k.palu_calibration is not None and k.palu_fill_rows:
        raise KVConfigError(
            f"palu_fill_rows=True with palu_calibration={k.palu_calibration!r}: a calibration fixes "
            "the widths; allowed: False"
        )
    if k.palu_calibration is not None and (k.palu_basis_bits, k.palu_scale_bits) != (16, 16):
        raise KVConfigError(
            f"palu_basis_bits={k.palu_basis_bits} and palu_scale_bits={k.palu_scale_bits} with "
            f"palu_calibration={k.palu_calibration!r}: the compact basis and scales are for caches "
            "fitted at the prefill; allowed: 16 and 16"
        )
    if k.method == "rotation":
        _check_rotation(k)
    if not _is_int(k.naive_bits) or k.naive_bits not in PACKABLE_BITS:
        raise KVConfigError(
            f"naive_bits={k.naive_bits!r} cannot be packed; allowed: {', '.join(map(str, PACKABLE_BITS))}"
        )
    if k.naive_group_size not in (32, 64, 128) or not _is_int(k.naive_group_size):
        raise KVConfigError(f"naive_group_size={k.naive_group_size!r} must be 32, 64 or 128")
    weighted = (k.palu_key_weight, k.palu_value_weight) != (1.0, 1.0) or bool(k.palu_relative_error)
    if (weighted or k.palu_sensitivity is not None) and _chooses_split(k):
        raise KVConfigError(
            "palu_sensitivity, palu_relative_error and the palu_key_weight / palu_value_weight water-filling "
            "weights need the "
            "water-filling coder (palu_bits); this config asks for the rank + hi/lo split"
        )
    if k.palu_sensitivity is not None and k.palu_calibration is not None:
        raise KVConfigError(
            f"palu_sensitivity={k.palu_sensitivity!r} and palu_calibration={k.palu_calibration!r}: "
            "the sensitivity budgets are for caches fitted at the prefill; allowed: one of them"
        )


def _check_rotation(k: SimpleNamespace) -> None:
    """``method="rotation"``: bits per rotated channel in halves from 2 to 8, a per-token scale,
    and none of the fields of a fitted or calibrated projection."""
    bits = k.palu_bits
    if bits is not None and float(bits) not in ROTATION_BITS_ALLOWED:
        raise KVConfigError(
            f"palu_bits={bits!r} with method='rotation' must be None (3.5) or one of "
            f"{', '.join(f'{b:g}' for b in ROTATION_BITS_ALLOWED)} (bits per rotated channel; a half "
            "gives keys the bit above and values the bit below)"
        )
    fitted = ("palu_rank", "palu_energy_threshold", "palu_hi_bit", "palu_lo_bit", "palu_hi_fraction",
              "palu_calibration", "palu_sensitivity", "palu_n_head_groups")  # fmt: skip
    if not k.palu_token_scale:
        raise KVConfigError(
            "palu_token_scale=False with method='rotation': the rotation code's steps are relative to "
            "a per-token scale; allowed: True (the default)"
        )
    given = [name for name in fitted if getattr(k, name) is not None]
    if given:
        raise KVConfigError(
            f"{', '.join(given)} with method='rotation': the rotation code fits no projection; "
            "allowed: leave them unset (or use method='palu')"
        )


_UNSET = object()
