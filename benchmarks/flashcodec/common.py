"""What the flashcodec measurement scripts share: tier lookup, signals, stamping, results paths
and teacher-forced log-probabilities.

Every configuration a script runs is a tier of :data:`flashcodec.tiers.TIERS` or a study
configuration of ``benchmarks/studies/flashcodec_tiers.py``, named as there ("jpeg-k2-int8"); its
attention is a field (:attr:`flashcodec.tiers.Tier.attention`), chosen with ``--attention`` where a
script offers it, never part of the name. :func:`tier_list` parses and checks ``--tiers``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from kvbench.results import environment_stamp, results_path, write_json
from kvspec import KVConfigError

# the study registry sits beside this folder (benchmarks/studies), one level up from the scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
from flashcodec_tiers import ALL_TIERS, study_tier  # noqa: E402

__all__ = [
    "ALL_TIERS",
    "ATTENTION_OPTIONS",
    "study_tier",
    "tier_list",
    "attention_list",
    "compare_with_studies",
]


def tier_list(text: str) -> list[str]:
    """``--tiers a,b``: names of tiers or study configurations (:func:`study_tier`), checked
    (argparse type); a name carrying an attention suffix is refused, saying to choose the attention."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        try:
            study_tier(name)
        except KVConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"no tier named in {text!r}; known: {list(ALL_TIERS)}")
    return names


#: ``--attention`` of the scripts that run tiers themselves: each tier's own, one for all, or both
ATTENTION_OPTIONS = ("tier", "codes", "materialized", "both")


def attention_list(name: str, attention: str) -> list[str]:
    """The attentions ``--attention`` asks of tier ``name``: its own (``tier``), one, or both."""
    if attention == "tier":
        return [study_tier(name).attention]
    return ["codes", "materialized"] if attention == "both" else [attention]


def compare_with_studies(argv: list[str]) -> int:
    """``flashcodec compare`` offering the study configurations beside the package's tiers."""
    from flashcodec.compare import main

    return main(argv, registry=ALL_TIERS)


def long_run_args(
    peers: str,
    *,
    context: int = 64,
    scored: int = 32,
    long_windows: int = 1,
    speed_rounds: int = 2,
    speed_steps: int = 16,
) -> list[str]:
    """``flashcodec compare``'s arguments for a script measured by the long run (``long_windows``
    windows of 1,792 prefilled + 256 scored tokens, decode timed at 2,048) beside ``peers``: the
    short run is one window of ``context`` + ``scored`` tokens and one prompt, as small as the tool
    allows, and the speed run ``speed_rounds`` rounds of ``speed_steps`` steps."""
    return [
        "--peers", peers,
        "--windows", "1", "--context-tokens", str(context), "--scored-tokens", str(scored),
        "--prompt-count", "1", "--new-tokens", "8",
        "--long-context", "2048", "--long-windows", str(long_windows), "--long-scored-tokens", "256",
        "--speed-rounds", str(speed_rounds), "--speed-steps", str(speed_steps),
        "--quiet",
    ]  # fmt: skip


def random_walk(b: int, h: int, s: int, d: int, seed: int, step: float) -> torch.Tensor:
    """``[b, h, s, d]`` fp32 ``x_0 + step * cumsum(N(0, 1))`` along the sequence (seeded):
    autocorrelated like the description's synthetic signal."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, 1, d, generator=g) + step * torch.randn(b, h, s, d, generator=g).cumsum(2)


def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so a wall-clock timing covers it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stamp(packages: list[str], device: torch.device | None = None) -> dict:
    """:func:`kvbench.results.environment_stamp` (machine, versions, date, load average) plus the
    torch threads and, given ``device``, its name."""
    out = environment_stamp(packages)
    out["machine"]["torch_threads"] = torch.get_num_threads()
    if device is not None:
        out["machine"]["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return out


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--threads`` and ``--out`` (``benchmarks/tools/gpu_check.py`` passes the first two)."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="1 by default: intra-op threads stall on a shared machine"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/<name>.json (CPU) or <name>_cuda.json"
    )


def save(data: dict, name: str, args: argparse.Namespace) -> Path:
    """Write ``data`` to ``args.out`` or ``$KVBENCH_RESULTS/<name>.json`` (``<name>_cuda.json`` on a GPU)."""
    out = args.out or results_path(f"{name}.json" if args.device == "cpu" else f"{name}_cuda.json")
    write_json(out, data)
    print(f"wrote {out}")
    return out


@torch.inference_mode()
def log_probs(model, cache, window: list[int], context: int) -> torch.Tensor:
    """Log-probabilities at the scored positions: one prefill call, then one token per call."""
    out = [
        model(input_ids=torch.tensor([window[:context]]), past_key_values=cache, logits_to_keep=1).logits[
            0, -1
        ]
    ]
    for token in window[context:-1]:
        out.append(model(input_ids=torch.tensor([[token]]), past_key_values=cache).logits[0, -1])
    return torch.stack(out).float().log_softmax(-1)


def model_and_text(path: str | Path):
    """``(model, ids)``: the model at ``path`` in bf16, eval mode, and kvbench's held-out text as
    its token ids (no special tokens added)."""
    from kvbench.models import default_text_path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = AutoTokenizer.from_pretrained(path).encode(
        default_text_path().read_text(), add_special_tokens=False
    )
    return model, ids


@torch.no_grad()
def exact_windows(model_name: str, windows: int, context: int, scored: int) -> tuple[object, list[tuple]]:
    """The model (``kvbench.models.resolve_model(model_name)``, bf16, eval) and, for each of ``windows``
    consecutive windows of ``context + scored`` tokens of kvbench's held-out text, ``(tokens [1, S],
    per-layer exact context K/V, exact log-probabilities fp32 [scored, vocab] of one forward of the
    scored tokens)``: the reference of a one-forward quality check (:func:`score_replaced_kv`)."""
    from kvbench.models import resolve_model
    from transformers import DynamicCache

    model, ids = model_and_text(resolve_model(model_name))
    size = context + scored
    out = []
    for i in range(windows):
        w = torch.tensor(ids[i * size : (i + 1) * size])[None]
        cache = DynamicCache(config=model.config)
        model(w[:, :context], past_key_values=cache, use_cache=True)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        logits = model(w[:, context:], past_key_values=cache, use_cache=True).logits
        out.append((w, kv, logits.float().log_softmax(-1)[0]))
    return model, out


def add_window_options(
    parser: argparse.ArgumentParser, model: str | None = "smollm2-135m", note: str = ""
) -> None:
    """``--model`` (default ``model``) and the windows of :func:`exact_windows`: ``--windows`` (2),
    ``--context`` (1792 tokens) and ``--scored`` (256 tokens); ``note`` prefixes the windows' help."""
    parser.add_argument(
        "--model",
        default=model,
        help=f"kvbench model name or directory (default: {model or 'the real model'})",
    )
    parser.add_argument("--windows", type=int, default=2, help=f"{note}windows")
    parser.add_argument("--context", type=int, default=1792, help=f"{note}context tokens")
    parser.add_argument("--scored", type=int, default=256, help=f"{note}scored tokens")


def save_window_result(
    out: str | Path,
    args: argparse.Namespace,
    rows: list[dict],
    *,
    model: str | None = None,
    protocol: str | None = None,
    **fields,
) -> Path:
    """Write the result of a one-forward quality check (:func:`score_replaced_kv`) to ``out`` and say so:
    ``{stamp, model (default args.model), dtype "bfloat16", protocol (when given), windows,
    context_tokens, scored_tokens (from args, as add_window_options made them), **fields, rows}``."""
    data = {
        "stamp": stamp(["flashcodec-kv", "kvbench", "torch", "transformers"]),
        "model": str(model or args.model),
        "dtype": "bfloat16",
        **({} if protocol is None else {"protocol": protocol}),
        "windows": args.windows,
        "context_tokens": args.context,
        "scored_tokens": args.scored,
        **fields,
        "rows": rows,
    }
    write_json(out, data)
    print(f"wrote {out}")
    return Path(out)


@torch.no_grad()
def score_replaced_kv(model, windows: list[tuple], context: int, replace) -> tuple[float, float]:
    """``(KL mean, top-1 agreement)`` of one forward of each window's scored tokens over its context
    K/V replaced layer by layer (``replace(layer, k, v) -> (k, v)``) against the exact log-probabilities
    of :func:`exact_windows`: ``KL(exact || replaced)`` and the share of positions whose argmax agrees."""
    from transformers import DynamicCache

    kls, agree = [], []
    for w, kv, base in windows:
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(*replace(i, k, v), i)
        lp = model(w[:, context:], past_key_values=cache, use_cache=True).logits.float().log_softmax(-1)[0]
        kls.append((base.exp() * (base - lp)).sum(-1))
        agree.append((base.argmax(-1) == lp.argmax(-1)).float())
    return float(torch.cat(kls).mean()), float(torch.cat(agree).mean())


def compare_result(
    cli: list[str], compare_json: Path | None = None, main: Callable[[list[str]], int] | None = None
) -> dict:
    """The result dict of ``flashcodec compare <cli>``, run in this process into a temporary JSON
    file, or read from ``compare_json`` (a run saved earlier); ``SystemExit`` when compare fails.
    ``main``: the command to run instead of ``flashcodec compare`` over the package's tiers and
    the study configurations (a harness of the caller's own)."""
    if compare_json is None:
        if main is None:
            main = compare_with_studies

        compare_json = Path(tempfile.mkdtemp()) / "compare.json"
        code = main([*cli, "--json", str(compare_json)])
        if code:
            raise SystemExit(f"flashcodec compare exited with {code}")
    return json.loads(compare_json.read_text())
