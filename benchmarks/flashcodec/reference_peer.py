"""The reference description's own library (PyPI ``flashcodec-kv`` 1.0.0) beside ours, transformers'
``QuantizedCache`` and the uncompressed cache, on the real model, in one run.

The released library imports as ``flashcodec``, as our package does, so it runs in a venv of its own
(made once under ``~/.cache/kvbench/venvs/``: torch 2.13.0, the transformers of constraints.txt,
``flashcodec-kv==1.0.0``, and kvspec / kvbench editable from this checkout) and in a process of
its own. Each side is one subprocess running kvbench's protocol (:func:`kvbench.protocol.measure`)
on the same text windows (:func:`kvbench.cli.prepare_tokens`, as ``flashcodec compare --windows N
--context-tokens C --scored-tokens S`` cuts them), with the same model in the same dtype:

* ours (this environment): the uncompressed ``DynamicCache``, our zero-argument default
  (``apply_flash_codec(model)``: tier ``kivi64r-k4v4-w64i8-s8`` with attention on the codes, built
  as ``flashcodec compare`` builds it) and transformers' ``QuantizedCache`` (hqq and quanto, 4-bit);
* reference (the venv): the uncompressed ``DynamicCache`` again and the released ``FlashCodecCache``
  in its keyword form at each setting of :data:`REFERENCE_SETTINGS`. A setting it refuses becomes a
  row ``refused: <error>``.

KL and top-1 of a row are against the uncompressed model of its own process; both processes run the
same weights, dtype, threads and tokens, and the result records whether their baselines agree.

    hatch run bench:python benchmarks/flashcodec/reference_peer.py
    # writes benchmarks/results/flashcodec_reference_peer.json (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
RESULTS_FILE = "flashcodec_reference_peer.json"

#: the released library measured here, and where its venv lives (outside the checkout)
REFERENCE_DIST = "flashcodec-kv"
REFERENCE_VERSION = "1.0.0"
VENV = Path("~/.cache/kvbench/venvs/flashcodec-kv-1.0.0").expanduser()
#: the torch build that lies on the machines' disk (a looser pin downloads a CUDA build)
TORCH = "torch==2.13.0"

#: row name -> the released ``FlashCodecCache``'s keyword form; ``{}`` is its own default
REFERENCE_SETTINGS: dict[str, dict[str, Any]] = {
    "ref-jpeg-k8-int8": {"mode": "jpeg", "block_size": 8, "keep_freqs": 8, "quant_bits": 8},
    "ref-jpeg-k2-int8": {"mode": "jpeg", "block_size": 8, "keep_freqs": 2, "quant_bits": 8},
    "ref-png-keep1": {"mode": "png", "block_size": 8, "keep_ratio": 1.0},
    "ref-default": {},
}
#: our zero-argument default as ``flashcodec compare`` names it (its own attention: on the codes)
OURS_DEFAULT = "kivi64r-k4v4-w64i8-s8"
#: transformers' own 4-bit caches, by ``flashcodec compare``'s names
OURS_PEERS = ("hf-hqq-q4", "hf-quanto-q4")
#: every row name the results file must carry, measured or refused (the test reads this)
SETTINGS = ("baseline", OURS_DEFAULT, *OURS_PEERS, *REFERENCE_SETTINGS)

NOTES = [
    "KL and top-1 are against the uncompressed DynamicCache of the same process; 'baselines_agree' "
    "compares the two processes' uncompressed rows (same weights, dtype, tokens and threads).",
    "Resident bytes (kv_resident_bytes, resident_ratio*, the summary's 'resident' columns): every "
    "tensor reachable from the cache object (attributes, lists, dicts, slots; tensor subclasses "
    "through their inner tensors; model modules skipped), each storage counted once at its full "
    "allocated size. For the reference library that is its archive at its allocated capacity "
    "(capacity doubling from 16 blocks), the int8 scales, the raw tail, its memoized decoded view "
    "(_rec, also at capacity) and the keys/values view each layer keeps (a torch.cat copy of the "
    "view and the tail whenever a tail exists).",
    "Held bytes (kv_bytes, kv_ratio*): each library's own account. Reference: FlashCodecCache."
    "storage_bytes() (valid archive region + raw tail, no spare capacity, no decoded view); ours: "
    "flashcodec.compare.cache_bytes (storage_bytes().held + native layers); QuantizedCache: its "
    "quantized states and full-precision residual; DynamicCache: keys and values.",
    "library_ratio: the library's own byte count over the uncompressed cache's at the same tokens, "
    "after the first window (reference: FlashCodecCache.storage_bytes(); ours: "
    "FlashCodecCache.storage_bytes().held + native layers; null for transformers' caches, which "
    "report none). "
    "codec_storage_ratio: what the reference codec's storage_ratio() reports for itself.",
    "Peak memory is not measured by this script (peak columns are null).",
]


# --------------------------------------------------------------------------- the reference's venv
def _venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def _pin(name: str) -> str:
    """``name==version`` from constraints.txt (the release our environments run)."""
    for line in CONSTRAINTS.read_text().splitlines():
        if line.split("==")[0].strip().lower() == name:
            return line.strip()
    raise SystemExit(f"{CONSTRAINTS} pins no {name}")


_PROBE = (
    "import importlib.metadata as m, json, kvbench, flashcodec;"
    "print(json.dumps({d: m.version(d) for d in ('torch', 'transformers', 'flashcodec-kv')}"
    " | {'kvbench': kvbench.__file__, 'flashcodec': flashcodec.__file__}))"
)


def _venv_state(path: Path) -> dict[str, str] | None:
    python = _venv_python(path)
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def ensure_venv(path: Path) -> dict[str, str]:
    """The reference's venv at ``path``, made or completed when its versions differ; returns them."""
    transformers = _pin("transformers")
    want = {
        "torch": TORCH.split("==")[1],
        "transformers": transformers.split("==")[1],
        "flashcodec-kv": REFERENCE_VERSION,
    }
    state = _venv_state(path)
    ok = state is not None and all(state[k].split("+")[0] == v for k, v in want.items())
    if ok and Path(state["kvbench"]).is_relative_to(ROOT / "packages" / "kvbench"):
        return state
    if not _venv_python(path).exists():
        print(f"making {path}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(path)
    pip = [str(_venv_python(path)), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS)]
    subprocess.run([*pip, TORCH, transformers, f"{REFERENCE_DIST}=={REFERENCE_VERSION}"], check=True)
    # kvbench and kvspec come from this checkout, editable, so both sides run the same protocol
    kv = ("-e", str(ROOT / "packages" / "kvspec"), "-e", str(ROOT / "packages" / "kvbench"))
    subprocess.run([*pip, "--no-deps", *kv], check=True)
    state = _venv_state(path)
    if state is None:
        raise SystemExit(f"{path}: the venv does not import kvbench and flashcodec after installing")
    return state


# --------------------------------------------------------------------------- bytes of a cache object
def resident_bytes(cache: Any) -> int:
    """Bytes of every tensor storage reachable from ``cache``, each storage once, at its full size."""
    import torch

    seen_objects: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack = [cache]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            flatten = getattr(type(obj), "__tensor_flatten__", None)
            if (
                flatten is not None
                and type(obj) is not torch.Tensor
                and not isinstance(obj, torch.nn.Parameter)
            ):
                # a wrapper subclass (quanto's QTensor) owns no storage of its own: its inner tensors do
                names, _ = obj.__tensor_flatten__()
                stack.extend(getattr(obj, name) for name in names)
                continue
            storage = obj.untyped_storage()
            storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
            continue
        if isinstance(obj, (torch.nn.Module, type)) or callable(obj) and not hasattr(obj, "__dict__"):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for klass in type(obj).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(obj, slot):
                        stack.append(getattr(obj, slot))
    return sum(storages.values())


def _dynamic_held(cache: Any) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


class Runner:
    """kvbench's ``Runner`` for a transformers model, batch 1, on the CPU, with the same byte counts
    on both sides: held by ``held(cache)`` (each library's own account), resident by
    :func:`resident_bytes`. ``accounts`` keeps, per candidate, ``account(cache)`` at the last
    :meth:`kv_bytes` of its cache (kvbench reads the bytes last after its first window)."""

    peak_label = "not measured by benchmarks/flashcodec/reference_peer.py"

    def __init__(self, model: Any, tokenizer: Any, held, account):
        self.model, self.tokenizer = model, tokenizer
        self.kv_itemsize = next(model.parameters()).element_size()
        self._held, self._account = held, account
        # transformers 5.x renamed the forward's cache argument; the old name warns on every call
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.names: dict[int, str] = {}
        self.accounts: dict[str, Any] = {}

    def tagged(self, candidate):
        """``candidate`` whose caches are named, so :meth:`kv_bytes` knows whose account it read."""

        def make():
            cache = candidate.make_cache()
            self.names[id(cache)] = candidate.name
            return cache

        return dataclasses.replace(candidate, make_cache=make)

    def _logits(self, cache: Any, ids: list[int]):
        import torch

        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache}
            )
        return out.logits[0, -1].float().numpy()

    def prefill(self, cache, tokens):
        return self._logits(cache, list(tokens))

    def step(self, cache, token):
        return self._logits(cache, [int(token)])

    def kv_bytes(self, cache):
        from kvbench.protocol import KVBytes

        name = self.names.get(id(cache))
        if name is not None:
            self.accounts[name] = self._account(cache)
        return KVBytes(held=self._held(cache), resident=resident_bytes(cache))

    def raw_bytes(self, cache):
        return _dynamic_held(cache)  # the baseline: DynamicCache holds exactly the tokens seen

    def reset_peak(self):
        pass

    def restart_peak(self):
        pass

    def peak_bytes(self):
        return None

    def detokenize(self, tokens):
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


# --------------------------------------------------------------------------- the two sides
def _ours(model: Any, runner_args: tuple) -> tuple[Runner, list, list[dict]]:
    from flashcodec.compare import build_candidates, cache_bytes
    from flashcodec.hf import FlashCodecCache

    def held(cache):
        return cache_bytes(cache).held

    def account(cache):
        if isinstance(cache, FlashCodecCache):
            storage = cache.storage_bytes()
            native = cache.native_nbytes()
            return {"held": storage.held + native, "resident": storage.resident + native}
        return None  # transformers' caches report no byte count of their own

    runner = Runner(*runner_args, held=held, account=account)
    candidates, absent = build_candidates(model, [OURS_DEFAULT], list(OURS_PEERS))
    out = []
    for cand in candidates:
        if cand.name == OURS_DEFAULT:
            cand = dataclasses.replace(
                cand,
                description=f"ours: apply_flash_codec(model)'s default, {cand.description}",
                config={**cand.config, "what": "apply_flash_codec(model) with no arguments"},
            )
        out.append(runner.tagged(cand))
    return runner, out, absent


def _reference(model: Any, runner_args: tuple, probe_tokens: list[int]) -> tuple[Runner, list, list[dict]]:
    from flashcodec import FlashCodecCache
    from kvbench.protocol import Candidate
    from transformers import DynamicCache

    def held(cache):
        if isinstance(cache, FlashCodecCache):
            return cache.storage_bytes()
        return _dynamic_held(cache)

    def account(cache):
        if isinstance(cache, FlashCodecCache):
            return {"storage_bytes": cache.storage_bytes()}
        return None

    runner = Runner(*runner_args, held=held, account=account)
    out = [
        Candidate(
            "baseline",
            "baseline",
            "transformers DynamicCache, uncompressed (reference venv)",
            lambda: DynamicCache(config=model.config),
        )
    ]
    absent = []
    for name, keywords in REFERENCE_SETTINGS.items():
        try:
            # a setting counts only when the library builds it and runs the model's prefill and a step
            cache = FlashCodecCache(**keywords)
            logits = runner.prefill(cache, probe_tokens)
            runner.step(cache, int(logits.argmax()))
            layer = cache.layers[0]
            codec = repr(layer.codec)
            ratio = layer.codec.storage_ratio()
        except Exception as err:  # the library's refusal, whatever its type, is the row
            absent.append(
                {"name": name, "kind": "tier", "reason": " ".join(f"{type(err).__name__}: {err}".split())}
            )
            continue
        form = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
        out.append(
            Candidate(
                name,
                "tier",
                f"flashcodec-kv {REFERENCE_VERSION}: FlashCodecCache({form}) = {codec}",
                lambda keywords=keywords: FlashCodecCache(**keywords),
                {
                    "class": "flashcodec.FlashCodecCache (PyPI flashcodec-kv)",
                    "keywords": keywords,
                    "codec": codec,
                    "codec_storage_ratio": ratio,
                },
            )
        )
    return runner, [runner.tagged(c) for c in out], absent


def run_side(args: argparse.Namespace) -> int:
    """One side of the run, in this process: measure its candidates and write kvbench's document."""
    import flashcodec
    import torch
    from kvbench.cli import load_eval_text, prepare_tokens
    from kvbench.models import resolve_model
    from kvbench.protocol import Settings, measure
    from kvbench.results import build_result, text_digest, weights_digest, write_json
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    tokenizer.model_max_length = int(1e12)  # the text is tokenized whole, then cut into windows
    settings = Settings(
        windows=args.windows,
        context_tokens=args.context,
        scored_tokens=args.scored,
        new_tokens=args.new_tokens,
        speed_rounds=args.speed_rounds,
        speed_steps=args.speed_steps,
        prompt_count=1,
    )
    text, text_path = load_eval_text(None)
    windows, prompts, prompt_source = prepare_tokens(
        lambda t: tokenizer.encode(t, add_special_tokens=False), tokenizer.encode, text, None, settings
    )
    runner_args = (model, tokenizer)
    if args.side == "ours":
        runner, candidates, absent = _ours(model, runner_args)
        packages = (
            "flashcodec-kv",
            "kvbench",
            "kvcache-spec",
            "torch",
            "transformers",
            "numpy",
            "hqq",
            "optimum-quanto",
        )
    else:
        runner, candidates, absent = _reference(model, runner_args, windows[0][:64])
        packages = ("flashcodec-kv", "kvbench", "kvcache-spec", "torch", "transformers", "numpy")
    started = time.perf_counter()
    rows = measure(runner, candidates, windows, prompts, settings, progress=not args.quiet)
    for row in rows:
        row["library_account"] = runner.accounts.get(row["name"])
    text_config = model.config.get_text_config(decoder=True)
    info = {
        "name": args.model,
        "source": source,
        "architecture": text_config.model_type,
        "layers": text_config.num_hidden_layers,
        "kv_heads": text_config.num_key_value_heads,
        "head_dim": getattr(text_config, "head_dim", None),
        "dtype": args.dtype,
        "weights_sha256": weights_digest(source),
        "framework": f"torch {torch.__version__}",
        "torch_threads": torch.get_num_threads(),
    }
    result = build_result(
        tool=f"benchmarks/flashcodec/reference_peer.py --side {args.side}",
        packages=packages,
        model=info,
        inputs={
            "text": str(text_path),
            "text_sha256": text_digest(text),
            "dtype": args.dtype,
            "device": "cpu",
            "flashcodec_imported_from": flashcodec.__file__,
            "python": sys.executable,
        },
        peak_label=runner.peak_label,
        runs=[
            {
                "name": "short",
                "settings": {**settings.as_dict(), "prompts": len(prompts), "prompt_source": prompt_source},
                "rows": rows,
            }
        ],
        absent=absent,
    )
    result["seconds"] = time.perf_counter() - started
    write_json(args.side_out, result)
    return 0


# --------------------------------------------------------------------------- merging
def _summary_row(row: dict[str, Any], side: str) -> dict[str, Any]:
    account = row.get("library_account") or {}
    raw = row["kv_raw_bytes"]
    library = account.get("storage_bytes", account.get("held"))
    return {
        "name": row["name"],
        "side": side,
        "kind": row["kind"],
        "status": "measured",
        "description": row["description"],
        "resident_ratio_decode_mean": row["resident_ratio_decode_mean"],
        "resident_ratio": row["resident_ratio"],
        "kv_ratio_decode_mean": row["kv_ratio_decode_mean"],
        "library_ratio": None if library is None or not raw else library / raw,
        "codec_storage_ratio": row["config"].get("codec_storage_ratio"),
        "kl_mean": row["kl_mean"],
        "kl_p99": row["kl_p99"],
        "top1_agreement": row["top1_agreement"],
        "ppl_delta": row["ppl_delta"],
        "positions_scored": row["positions_scored"],
        "decode_tokens_per_s": row["decode_tokens_per_s"],
    }


def merge(ours: dict[str, Any], ref: dict[str, Any], command: str) -> dict[str, Any]:
    """One document: ours' stamp and rows, then the reference's (its baseline as a ``reference``
    row), refusals as summary rows ``refused: <error>``."""
    ours_rows = ours["runs"][0]["rows"]
    ref_rows = ref["runs"][0]["rows"]
    base, ref_base = ours_rows[0], ref_rows[0]
    ref_base = {**ref_base, "name": "baseline-reference-venv", "kind": "reference"}
    summary = [_summary_row(r, "ours") for r in ours_rows]
    summary += [_summary_row(ref_base, "reference")] + [_summary_row(r, "reference") for r in ref_rows[1:]]
    for side, doc in (("ours", ours), ("reference", ref)):
        for item in doc["absent"]:
            summary.append(
                {
                    "name": item["name"],
                    "side": side,
                    "kind": item["kind"],
                    "status": f"refused: {item['reason']}",
                }
            )
    return {
        "schema": ours["schema"],
        "tool": "benchmarks/flashcodec/reference_peer.py",
        "command": command,
        "stamp": ours["stamp"],
        "stamp_reference_venv": ref["stamp"],
        "model": ours["model"],
        "model_reference_venv": ref["model"],
        "inputs": ours["inputs"],
        "inputs_reference_venv": ref["inputs"],
        "settings": ours["runs"][0]["settings"],
        "reference_settings": REFERENCE_SETTINGS,
        "measures": ours["measures"],
        "notes": NOTES,
        "baselines_agree": {
            "nll_ours": base["nll"],
            "nll_reference_venv": ref_base["nll"],
            "same_nll": base["nll"] == ref_base["nll"],
            "same_greedy_sample": base["sample"] == ref_base["sample"],
            "same_raw_bytes": base["kv_raw_bytes"] == ref_base["kv_raw_bytes"],
        },
        "seconds": {"ours": ours["seconds"], "reference": ref["seconds"]},
        "runs": [
            {
                "name": "short",
                "settings": ours["runs"][0]["settings"],
                "rows": [*ours_rows, ref_base, *ref_rows[1:]],
            }
        ],
        "absent": [*ours["absent"], *ref["absent"]],
        "summary": summary,
    }


def _side_command(python: Path | str, side: str, out: Path, args: argparse.Namespace) -> list[str]:
    return [
        str(python), str(Path(__file__).resolve()), "--side", side, "--side-out", str(out),
        "--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
        "--windows", str(args.windows), "--context", str(args.context), "--scored", str(args.scored),
        "--new-tokens", str(args.new_tokens), "--speed-rounds", str(args.speed_rounds),
        "--speed-steps", str(args.speed_steps), *(["--quiet"] if args.quiet else []),
    ]  # fmt: skip


def run_both(args: argparse.Namespace, argv: list[str]) -> int:
    from kvbench.results import results_path, write_json

    ensure_venv(args.venv)
    folder = Path(tempfile.mkdtemp(prefix="reference_peer."))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # the venv's own site-packages only: neither this environment's flashcodec nor the user's site
    ref_env = {**env, "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": str(args.threads)}
    sides = {}
    for side, python, side_env in (
        ("ours", sys.executable, {**os.environ, "OMP_NUM_THREADS": str(args.threads)}),
        ("reference", _venv_python(args.venv), ref_env),
    ):
        out = folder / f"{side}.json"
        print(f"measuring the {side} side ...", file=sys.stderr, flush=True)
        subprocess.run(_side_command(python, side, out, args), env=side_env, check=True)
        sides[side] = json.loads(out.read_text())
    command = "hatch run bench:python benchmarks/flashcodec/reference_peer.py " + " ".join(argv)
    result = merge(sides["ours"], sides["reference"], command.strip())
    out = args.out or results_path(RESULTS_FILE)
    write_json(out, result)
    for row in result["summary"]:
        if row["status"] != "measured":
            print(f"{row['name']:28s} {row['status']}")
            continue
        library = "-" if row["library_ratio"] is None else f"{row['library_ratio']:.3f}"
        print(
            f"{row['name']:28s} resident {row['resident_ratio_decode_mean']:.3f} (after the window "
            f"{row['resident_ratio']:.3f}, library's own {library})  KL {row['kl_mean']:.2e}  "
            f"top-1 {row['top1_agreement']:.3f}"
        )
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="kvbench model name or directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side (1: a shared machine)")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024, help="prefilled tokens per window")
    parser.add_argument("--scored", type=int, default=128, help="teacher-forced, scored tokens per window")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy tokens of the one prompt")
    parser.add_argument("--speed-rounds", type=int, default=1)
    parser.add_argument("--speed-steps", type=int, default=8)
    parser.add_argument("--venv", type=Path, default=VENV, help="the reference library's venv")
    parser.add_argument("--out", type=Path, default=None, help=f"default: $KVBENCH_RESULTS/{RESULTS_FILE}")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--side", choices=("ours", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--side-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return run_side(args)
    return run_both(args, argv)


if __name__ == "__main__":
    sys.exit(main())
