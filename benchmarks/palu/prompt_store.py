"""``palu-mlx server --prompt-cache-dir``: bytes on disk per token, and time to first token after a restart.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        hatch run mlx:python benchmarks/palu/prompt_store.py --models tiny-qwen3 smollm2-135m

Writes ``benchmarks/results/palu_prompt_store.json``. For each model:

* **bytes per token**: a prompt of ``--contexts`` tokens of kvbench's held-out text is prefilled
  (in steps of the server's ``--prefill-step-size``, 2048) into palu's cache with the server's
  default config, and written as the server writes an entry (``PromptStore.save``); the same
  tokens go through mlx-lm's own cache (``make_prompt_cache`` without palu) and are written with
  mlx-lm's ``save_prompt_cache``. Both files' sizes are measured (``os.path.getsize``). mlx-lm's
  file as it writes it holds the model's dtype and its buffers at their grown capacity (steps of
  256 tokens); the ratio is taken against a second mlx-lm file of the same caches cut to the
  prompt's tokens and held in 16 bits (float32 keys and values rounded to bfloat16), what mlx-lm
  writes for a 16-bit model at a multiple of 256 tokens.
* **time to first token after a restart**: a server with a fresh ``--prompt-cache-dir`` answers
  a chat request whose user turn is ``--ttft-context`` tokens of the text, writes its entry and is
  stopped. Then, ``--rounds`` times each, a new server (the ``palu-mlx server`` command, its own
  process) with a copy of that directory, and one without any directory, answer a short warm-up
  request (not sharing the long prompt) and then the follow-up turn of that conversation, asked
  for one token: its wall time is the time to first token. The follow-up's ``cached_tokens``
  (mlx-lm's usage field) says how many prompt tokens were not prefilled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _prompt_tokens(tokenizer: Any, n: int) -> list[int]:
    from kvbench.models import default_text_path

    ids = tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    if len(ids) < n:
        raise SystemExit(f"the held-out text has {len(ids)} tokens; --contexts {n} is too many")
    return ids[:n]


def measure_bytes(model_name: str, contexts: list[int], step: int) -> list[dict[str, Any]]:
    """Bytes of a palu prompt-store entry and of mlx-lm's prompt cache file for the same tokens."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
    from palu_mlx import KVCacheBuilder
    from palu_mlx.prompt_store import PromptStore, store_key
    from palu_mlx.server import server_parser
    from palu_mlx.serving import describe, kv_bytes, palu_config, resolve_model_arg

    path = resolve_model_arg(model_name)
    model, tokenizer = mlx_lm.load(path)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="palu-prompt-store-bench-"))
    try:
        for n in contexts:
            tokens = _prompt_tokens(tokenizer, n)

            def prefill(cache, tokens=tokens):
                for start in range(0, len(tokens), step):
                    model(mx.array([tokens[start : start + step]]), cache=cache)
                    mx.eval([c.state for c in cache])
                return cache

            KVCacheBuilder.uninstall(model)
            plain = prefill(make_prompt_cache(model))
            dtype = str(plain[0].state[0].dtype)
            capacity = int(plain[0].state[0].shape[2])
            mlx_file = work / f"mlx-lm-{n}.safetensors"
            save_prompt_cache(str(mlx_file), plain, {"model": path})
            # mlx-lm's KVCache saves its buffers at their grown capacity (steps of 256 tokens);
            # the same tokens cut to their count, in 16 bits, are what the comparison uses
            for c in plain:
                k, v, offset = c.state
                sixteen_dtype = mx.bfloat16 if k.dtype == mx.float32 else k.dtype
                c.state = (
                    k[..., :offset, :].astype(sixteen_dtype),
                    v[..., :offset, :].astype(sixteen_dtype),
                    offset,
                )
            exact_file = work / f"mlx-lm-{n}-16bit-exact.safetensors"
            save_prompt_cache(str(exact_file), plain, {"model": path})
            del plain

            config = palu_config(model, server_parser().parse_args([]))
            KVCacheBuilder.install(model, config)
            cache = prefill(make_prompt_cache(model))
            held, raw = kv_bytes(cache)
            store = PromptStore(work / f"store-{n}", 1 << 40)
            key, description = store_key(model, config, path)
            entry = store.save(key, description, tokens, cache)
            palu = os.path.getsize(entry)
            mlx_bytes = os.path.getsize(mlx_file)
            sixteen = os.path.getsize(exact_file)
            rows.append(
                {
                    "context_tokens": n,
                    "palu_config": describe(config),
                    "palu_entry_bytes": palu,
                    "palu_entry_bytes_per_token": palu / n,
                    "palu_cache_nbytes_in_memory": held,
                    "mlx_lm_file_bytes": mlx_bytes,
                    "mlx_lm_file_dtype": dtype,
                    "mlx_lm_file_capacity_tokens": capacity,
                    "mlx_lm_file_bytes_per_token": mlx_bytes / n,
                    "mlx_lm_16bit_exact_file_bytes": sixteen,
                    "mlx_lm_16bit_exact_file_bytes_per_token": sixteen / n,
                    "palu_over_mlx_lm_16bit": palu / sixteen,
                    "uncompressed_raw_nbytes": raw,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        KVCacheBuilder.uninstall(model)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def _ask(port: int, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int, int, int]:
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600
    )
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0
    )
    wall = time.perf_counter() - start
    details = reply.usage.prompt_tokens_details
    cached = (details.cached_tokens if details else 0) or 0
    return (
        wall,
        reply.choices[0].message.content or "",
        cached,
        reply.usage.prompt_tokens,
        reply.usage.total_tokens,
    )


def _server(model_path: str, log: Path, store_dir: Path | None):
    from kvbench.process import free_port, served

    port = free_port()
    cmd = [sys.executable, "-m", "palu_mlx.cli", "server", "--model", model_path, "--port", str(port)]
    if store_dir is not None:
        cmd += ["--prompt-cache-dir", str(store_dir)]
    health = f"http://127.0.0.1:{port}/health"
    return served(
        cmd, health, log, timeout_s=600, poll_s=0.5, stop_timeout_s=30, name="palu-mlx server"
    ), port


def _wait_for(log: Path, text: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise SystemExit(f"the server never logged {text!r}; its log: {log}")
        time.sleep(0.2)


def measure_ttft(model_name: str, context: int, reply_tokens: int, rounds: int) -> dict[str, Any]:
    """Time to first token of a follow-up after a restart, with and without the directory."""
    import mlx_lm
    from kvbench.models import default_text_path
    from palu_mlx.serving import resolve_model_arg

    path = resolve_model_arg(model_name)
    tokenizer = mlx_lm.load(path)[1]
    text = tokenizer.decode(_prompt_tokens(tokenizer, context))
    first = [{"role": "user", "content": text + "\n\nWhat is this text about?"}]
    warm_up = [{"role": "user", "content": default_text_path().read_text(encoding="utf-8")[-400:]}]
    work = Path(tempfile.mkdtemp(prefix="palu-prompt-store-ttft-"))
    try:
        pristine = work / "written"
        context_manager, port = _server(path, work / "writer.log", pristine)
        with context_manager:
            _, reply, _, first_prompt_tokens, total = _ask(port, first, reply_tokens)
            _wait_for(work / "writer.log", f"tokens (of {total}) written to palu-prompt-")
        entry_bytes = sum(f.stat().st_size for f in pristine.iterdir() if f.name.startswith("palu-prompt-"))
        follow_up = [
            *first,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Say it in one word."},
        ]
        runs: dict[str, list[dict[str, Any]]] = {"with_dir": [], "without_dir": []}
        for r in range(rounds):
            for mode in runs:
                store_dir = None
                if mode == "with_dir":
                    store_dir = work / f"round-{r}"
                    shutil.copytree(pristine, store_dir)
                log = work / f"{mode}-{r}.log"
                context_manager, port = _server(path, log, store_dir)
                with context_manager:
                    warm_s, _, _, _, _ = _ask(port, warm_up, 1)
                    ttft, token, cached, prompt_tokens, _ = _ask(port, follow_up, 1)
                loaded = [
                    line for line in log.read_text(errors="replace").splitlines() if "loaded from" in line
                ]
                runs[mode].append(
                    {
                        "ttft_s": ttft,
                        "warm_up_s": warm_s,
                        "prompt_tokens": prompt_tokens,
                        "cached_tokens": cached,
                        "first_token": token,
                        "log": loaded[-1].split(" - ", 2)[-1] if loaded else None,
                    }
                )
                print(mode, json.dumps(runs[mode][-1]), flush=True)
                if store_dir is not None:
                    shutil.rmtree(store_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {mode: statistics.median(x["ttft_s"] for x in rows) for mode, rows in runs.items()}
    return {
        "first_turn_prompt_tokens": first_prompt_tokens,
        "entry_bytes_on_disk": entry_bytes,
        "runs": runs,
        "median_ttft_s": med,
        "ttft_without_over_with": med["without_dir"] / med["with_dir"],
        "same_first_token": len({x["first_token"] for rows in runs.values() for x in rows}) == 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3", "smollm2-135m"])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 512, 1024], help="prompt tokens (bytes)"
    )
    parser.add_argument("--ttft-context", type=int, default=1024, help="tokens of the first user turn (TTFT)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens of the first turn's reply")
    parser.add_argument("--rounds", type=int, default=3, help="server starts per mode (TTFT)")
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--out", default=None, help="default: $KVBENCH_RESULTS/palu_prompt_store.json")
    args = parser.parse_args()

    from kvbench.results import environment_stamp, results_path, write_json

    out = args.out or str(results_path("palu_prompt_store.json"))
    models = {}
    for name in args.models:
        models[name] = {
            "bytes": measure_bytes(name, args.contexts, args.prefill_step_size),
            "ttft_after_restart": measure_ttft(name, args.ttft_context, args.reply_tokens, args.rounds),
        }
    write_json(
        out,
        {
            **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm", "openai"]),
            "command": " ".join(["python benchmarks/palu/prompt_store.py", *sys.argv[1:]]),
            "blas_preloaded": "libblas" in os.environ.get("LD_PRELOAD", ""),
            "settings": vars(args),
            "models": models,
        },
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
