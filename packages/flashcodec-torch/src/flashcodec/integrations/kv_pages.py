"""K/V between a paged engine's pages and flashcodec's codes; no engine is imported here.

A paged engine (vLLM, SGLang) keeps each layer's K/V in fixed-size pages addressed by a block
table. What it hands an offload path is that layer tensor and the page ids of one request. This
module turns such pages into one ``[H, S, D]`` key and one value sequence, codes them with a
flashcodec format, and writes decoded sequences back into pages, so that a connector only has to
say which pages and which file.

Page layout handled (:func:`gather_pages`, :func:`scatter_pages`): vLLM's CPU attention backend
(``CPU_ATTN``, vLLM 0.32): one tensor ``[num_blocks, H, block_size, 2 * D]`` per layer, in which
each (block, head) holds ``block_size`` key rows followed by ``block_size`` value rows (the backend
views it as ``[num_blocks, H, 2 * block_size, D]`` and splits dim 2 in halves). Other backends lay
pages out differently (GPU backends keep keys and values apart); they need their own gather.

Formats (:class:`PagedKVCoder`):

* ``"raw"``: the pages' K/V as they are (the reference the other formats are measured against);
* ``"exponent"``: :class:`~flashcodec.codecs.lossless.ExponentCoder`, bit-exact for bf16 / fp16;
* any tier name of :data:`flashcodec.tiers.TIERS` (e.g. ``"kivi64r-k4v4-w64i8-s8"``, the default): the tier's
  codec, applied as a cache applies it (:class:`~flashcodec.stream.CodecStream`: complete codec
  blocks coded, the newest tokens in the codec's tail form), lossy.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import torch
from kvspec import KVConfigError, KVDataError, KVDtypeError, KVShapeError

from ..codecs.lossless import ExponentCoder, ExponentPacked
from ..stream import CodecStream
from ..tiers import TIERS, tier

__all__ = ["PagedKVCoder", "gather_pages", "scatter_pages", "FORMATS_EXTRA"]

#: formats besides the tier names: uncoded, and the lossless exponent coder
FORMATS_EXTRA = ("raw", "exponent")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_layer(kv_layer: object) -> tuple[int, int, int, int]:
    if not isinstance(kv_layer, torch.Tensor) or kv_layer.dtype not in _FLOAT_DTYPES:
        got = f"a {kv_layer.dtype} tensor" if isinstance(kv_layer, torch.Tensor) else type(kv_layer).__name__
        raise KVDtypeError(f"kv_layer must be a float16 / bfloat16 / float32 torch.Tensor; got {got}")
    if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
        raise KVShapeError(
            "kv_layer must be [num_blocks, H, block_size, 2 * D] (vLLM's CPU backend pages); "
            f"got shape {tuple(kv_layer.shape)}"
        )
    nb, h, bs, two_d = kv_layer.shape
    return nb, h, bs, two_d // 2


def _check_block_ids(block_ids: object, num_blocks: int) -> torch.Tensor:
    if not isinstance(block_ids, torch.Tensor):
        block_ids = torch.as_tensor(block_ids)
        if not block_ids.numel():
            block_ids = block_ids.long()  # an empty list reads as float: no pages is still valid
    if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.dtype == torch.bool:
        raise KVShapeError(
            f"block_ids must be a 1-D integer sequence; got {block_ids.dtype} {tuple(block_ids.shape)}"
        )
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise KVShapeError(
            f"block_ids must lie in [0, {num_blocks}); got min {int(block_ids.min())}, max {int(block_ids.max())}"
        )
    return block_ids.long()


def gather_pages(kv_layer: torch.Tensor, block_ids: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the pages ``block_ids`` (in order): two ``[H, len(block_ids) * block_size, D]`` copies."""
    nb, h, bs, d = _check_layer(kv_layer)
    ids = _check_block_ids(block_ids, nb).to(kv_layer.device)
    pages = kv_layer.index_select(0, ids).view(len(ids), h, 2, bs, d)  # copy, then split K | V rows
    k = pages[:, :, 0].permute(1, 0, 2, 3).reshape(h, len(ids) * bs, d)
    v = pages[:, :, 1].permute(1, 0, 2, 3).reshape(h, len(ids) * bs, d)
    return k, v


def scatter_pages(kv_layer: torch.Tensor, block_ids: object, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``, ``v`` ``[H, len(block_ids) * block_size, D]`` into the pages ``block_ids``
    (cast to the pages' dtype). Checks everything before writing: a bad call leaves the pages unchanged."""
    nb, h, bs, d = _check_layer(kv_layer)
    ids = _check_block_ids(block_ids, nb).to(kv_layer.device)
    want = (h, len(ids) * bs, d)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise KVDtypeError(f"{name} must be a floating torch.Tensor; got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise KVShapeError(f"{name} must have shape {want} for {len(ids)} pages; got {tuple(t.shape)}")
    n = len(ids)
    kb = k.reshape(h, n, bs, d).permute(1, 0, 2, 3)
    vb = v.reshape(h, n, bs, d).permute(1, 0, 2, 3)
    pages = torch.stack((kb, vb), dim=2).to(kv_layer.dtype).reshape(n, h, bs, 2 * d)
    kv_layer.index_copy_(0, ids, pages)


@dataclass(frozen=True)
class PagedKVCoder:
    """Codes one layer's ``k``, ``v`` ``[H, S, D]`` into bytes and back.

    Args:
        format: ``"raw"``, ``"exponent"`` (lossless, bf16 / fp16 only) or a tier name of
            :data:`flashcodec.tiers.TIERS`.
    """

    format: str = "kivi64r-k4v4-w64i8-s8"

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or (
            self.format not in FORMATS_EXTRA and self.format not in TIERS
        ):
            raise KVConfigError(f"format must be one of {FORMATS_EXTRA + tuple(TIERS)}; got {self.format!r}")

    @property
    def lossless(self) -> bool:
        """Whether :meth:`decode` returns the input bit for bit."""
        return self.format in FORMATS_EXTRA or tier(self.format).codec.lossless

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[bytes, int]:
        """``(blob, payload_bytes)``: the file's bytes, and the bytes of the coded arrays in it
        (the blob adds a small header)."""
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
                got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
                raise KVDtypeError(f"{name} must be a float16 / bfloat16 / float32 torch.Tensor; got {got}")
            if t.dim() != 3 or t.shape[1] < 1:
                raise KVShapeError(f"{name} must be [H, S, D] with S >= 1; got shape {tuple(t.shape)}")
        if k.shape != v.shape or k.dtype != v.dtype:
            raise KVShapeError(
                f"k and v must agree; got {tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        arrays: dict[str, torch.Tensor]
        if self.format == "raw":
            arrays = {"k": k, "v": v}
        elif self.format == "exponent":
            coder = ExponentCoder()
            arrays = {
                name: torch.frombuffer(bytearray(coder.encode(t).to_bytes()), dtype=torch.uint8)
                for name, t in (("k", k), ("v", v))
            }
        else:
            codec = tier(self.format).codec
            h, _, d = k.shape
            arrays = {}
            for name, c, t in (("k", codec, k), ("v", codec.value_codec, v)):
                stream = CodecStream(c, 1, h, d, t.dtype, "cpu")
                stream.append(t.unsqueeze(0))
                arrays.update({f"{name}.{i}": a for i, a in enumerate(stream.state())})
        payload = sum(a.nbytes for a in arrays.values())
        header = {"format": self.format, "dtype": str(k.dtype).removeprefix("torch."), "shape": list(k.shape)}
        buf = io.BytesIO()
        torch.save({"header": json.dumps(header), "arrays": arrays}, buf)
        return buf.getvalue(), payload

    def decode(self, blob: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` ``[H, S, D]`` in the dtype they were coded from. ``KVDataError`` for a blob
        of another format or a damaged one."""
        try:
            obj = torch.load(io.BytesIO(blob), weights_only=True)
            header = json.loads(obj["header"])
            arrays = obj["arrays"]
            dtype = getattr(torch, header["dtype"])
        except Exception as err:  # any parse failure is a damaged blob
            raise KVDataError(f"blob is not a PagedKVCoder blob: {err}") from None
        if header.get("format") != self.format:
            raise KVDataError(f"blob was coded as {header.get('format')!r}; this coder reads {self.format!r}")
        shape = tuple(header["shape"])
        if self.format == "raw":
            k, v = arrays["k"], arrays["v"]
        elif self.format == "exponent":
            k, v = (
                ExponentCoder.decode(ExponentPacked.from_bytes(arrays[n].numpy().tobytes()))
                for n in ("k", "v")
            )
        else:
            codec = tier(self.format).codec
            out = []
            for name, c in (("k", codec), ("v", codec.value_codec)):
                parts = tuple(
                    arrays[f"{name}.{i}"]
                    for i in range(sum(1 for key in arrays if key.startswith(name + ".")))
                )
                out.append(CodecStream.from_state(c, parts, dtype).read()[0].clone())
            k, v = out
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise KVDataError(f"blob decodes to {tuple(k.shape)} / {tuple(v.shape)}; its header says {shape}")
        return k, v
