"""``palu-mlx server`` beside ``mlx_lm.server``: resident KV bytes at equal context, throughput with
concurrent clients.

    hatch run mlx:python benchmarks/palu/serving.py                        # the real model
    hatch run mlx:python benchmarks/palu/serving.py --model tiny-qwen3 --contexts 512

Writes ``benchmarks/results/palu_serving.json``. Each server runs in its own process (this script
with ``--kind``), built from the same pieces ``mlx_lm.server.run`` uses (``LRUPromptCache``,
``ResponseGenerator``, mlx-lm's HTTP handler) on a free localhost port, so the script can read the
server's prompt cache; only the model provider differs: mlx-lm's ``ModelProvider`` with the
model's default cache, or palu-mlx's ``PaluModelProvider`` (palu's default tier unless
``--palu-bits`` is given). Clients are the ``openai`` package, greedy (temperature 0).

* **resident KV at equal context**: for each context length, one chat request whose prompt is
  that many tokens of the held-out text (the model's chat template around it), ``--reply-tokens``
  tokens of reply; then the bytes the server's prompt cache holds for that conversation
  (``LRUPromptCache.nbytes``: each kept cache's ``nbytes``, measured from its arrays) and the
  tokens it holds. The prompt cache is cleared between contexts.
* **throughput**: ``--clients`` conversations at once (different prompts of ``--client-prompt``
  tokens, ``--client-tokens`` tokens each, streamed), after one warm-up round; the generated
  tokens of all clients over the wall time from the first request to the last reply, best of
  ``--rounds`` rounds, and the same with one client.

On Linux, run it with OpenBLAS preloaded as the other MLX benchmarks are (the model itself runs
in its own dtype, as a server runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvbench.process import free_port

KINDS = ("mlx-lm", "palu-mlx")


def _texts(tokenizer: Any, n_tokens: int, count: int) -> list[str]:
    """``count`` different passages of about ``n_tokens`` tokens of the held-out text."""
    from kvbench.models import default_text_path

    ids = tokenizer.encode(default_text_path().read_text(encoding="utf-8"))
    step = max(1, (len(ids) - n_tokens) // max(1, count))
    out = []
    for i in range(count):
        start = (i * step) % max(1, len(ids) - n_tokens)
        out.append(tokenizer.decode(ids[start : start + n_tokens]))
    return out


def run_kind(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Serve with one provider in this process and measure it."""
    import mlx.core as mx
    import openai
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint
    from palu_mlx.server import PaluModelProvider, server_parser
    from palu_mlx.serving import resolve_model_arg

    port = free_port()
    argv = ["--model", resolve_model_arg(args.model), "--port", str(port), "--max-tokens", "64"]
    if kind == "palu-mlx" and args.palu_bits is not None:
        argv += ["--palu-bits", str(args.palu_bits)]
    cli_args = server_parser().parse_args(argv)
    provider = (PaluModelProvider if kind == "palu-mlx" else ModelProvider)(cli_args)
    prompt_cache = LRUPromptCache(cli_args.prompt_cache_size)
    generator = ResponseGenerator(provider, prompt_cache)
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", port),
        lambda *a, **k: APIHandler(generator, *a, system_fingerprint=get_system_fingerprint(), **k),
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=3600
    )

    def chat(content: str, max_tokens: int, stream: bool = False):
        return client.chat.completions.create(
            model="default_model",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=stream,
        )

    def streamed(content: str, max_tokens: int) -> int:
        n = 0
        for chunk in chat(content, max_tokens, stream=True):
            n += sum(1 for c in chunk.choices if c.delta.content)
        return n

    try:
        chat("Hello.", 4)  # loads the model (and installs palu) in the generation thread
        tokenizer = provider.tokenizer
        result: dict[str, Any] = {
            "kind": kind,
            "batchable": bool(provider.is_batchable),
            "cache": type(provider.model.make_cache()[0]).__name__
            if hasattr(provider.model, "make_cache")
            else "KVCache",
        }
        if kind == "palu-mlx":
            from palu_mlx.serving import describe

            result["palu"] = describe(provider.palu_config)
            result["palu_config"] = json.loads(provider.palu_config.to_json())
        contexts = []
        for n in args.contexts:
            prompt_cache.trim_to(n_sequences=0)
            reply = chat(_texts(tokenizer, n, 1)[0], args.reply_tokens)
            contexts.append(
                {
                    "context_tokens": n,
                    "prompt_tokens": reply.usage.prompt_tokens,
                    "completion_tokens": reply.usage.completion_tokens,
                    "resident_kv_bytes": int(prompt_cache.nbytes),
                    "sequences_kept": len(prompt_cache),
                }
            )
            print(f"[{kind}] context {n}: {contexts[-1]}", file=sys.stderr, flush=True)
        result["contexts"] = contexts

        prompts = _texts(tokenizer, args.client_prompt, args.clients + 1)
        throughput = {}
        for clients in sorted({1, args.clients}):
            best = None
            for round_ in range(args.rounds + 1):  # round 0 warms up
                prompt_cache.trim_to(n_sequences=0)
                counts = [0] * clients
                errors: list[BaseException] = []

                def one(i: int, counts=counts, errors=errors) -> None:
                    try:
                        counts[i] = streamed(f"Summarize: {prompts[i]}", args.client_tokens)
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        errors.append(exc)

                threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
                tic = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - tic
                if errors:
                    raise errors[0]
                rate = sum(counts) / wall
                print(
                    f"[{kind}] {clients} clients round {round_}: {sum(counts)} tokens in {wall:.2f} s",
                    file=sys.stderr,
                )
                if round_ and (best is None or rate > best["tokens_per_s"]):
                    best = {"tokens": sum(counts), "wall_s": wall, "tokens_per_s": rate}
            throughput[str(clients)] = best
        result["throughput"] = throughput
        result["peak_memory_bytes"] = int(mx.get_peak_memory())
        return result
    finally:
        httpd.shutdown()
        generator.stop_and_join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a named model, a directory or a hub id")
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 4096], help="prompt tokens per context"
    )
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--client-prompt", type=int, default=256, help="prompt tokens per client")
    parser.add_argument("--client-tokens", type=int, default=64, help="tokens each client asks for")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--palu-bits", type=float, default=None, help="palu-mlx's tier (default: palu's default)"
    )
    parser.add_argument("--kind", choices=KINDS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="default: $KVBENCH_RESULTS/palu_serving.json")
    args = parser.parse_args()

    if args.kind is not None:
        from kvbench.results import write_json

        write_json(args.part, run_kind(args.kind, args))
        sys.stdout.flush()
        sys.stderr.flush()
        # the server's generation thread holds MLX streams whose teardown at interpreter exit
        # aborts the process ("terminate called without an active exception"): leave at once
        os._exit(0)

    from kvbench.results import environment_stamp, results_path, write_json

    args.out = args.out or str(results_path("palu_serving.json"))
    runs = {}
    for kind in KINDS:
        part = Path(args.out).with_suffix(f".{kind}.part.json")
        cmd = [sys.executable, __file__, *sys.argv[1:], "--kind", kind, "--part", str(part)]
        subprocess.run(cmd, check=True, env=os.environ.copy())
        runs[kind] = json.loads(part.read_text())
        part.unlink()
    base, palu = runs["mlx-lm"], runs["palu-mlx"]
    ratios = {
        "resident_kv": [
            {
                "context_tokens": a["context_tokens"],
                "palu_over_mlx_lm": b["resident_kv_bytes"] / a["resident_kv_bytes"],
            }
            for a, b in zip(base["contexts"], palu["contexts"], strict=True)
        ],
        "throughput": {
            clients: palu["throughput"][clients]["tokens_per_s"] / base["throughput"][clients]["tokens_per_s"]
            for clients in base["throughput"]
        },
    }
    write_json(
        args.out,
        {
            **environment_stamp(["palu-mlx", "kvbench", "mlx", "mlx-lm", "openai"]),
            "command": " ".join(["python benchmarks/palu/serving.py", *sys.argv[1:]]),
            "model": args.model,
            "settings": {k: v for k, v in vars(args).items() if k not in ("kind", "part", "out")},
            "runs": runs,
            "ratios": ratios,
        },
    )
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
