"""Does the embedded model use its context? Held-out perplexity per position, beside an older model.

    python benchmarks/model/evaluate.py                                   # the embedded model
    python benchmarks/model/evaluate.py --baseline /path/to/older/tiny-qwen3

For each model (the embedded one, and ``--baseline`` when given) on the committed held-out text
(``kvbench/data/heldout.txt``, BOS doc EOS per document, as in training):

* perplexity over non-overlapping 256-token windows (the protocol of the first training record,
  so the two models are compared on exactly the same targets);
* perplexity over 2,048-token windows, per bucket of target position (0-256, 256-512,
  512-1,024, 1,024-2,048): a model that uses its context predicts later positions better, so the
  buckets fall. The windows are laid at 8 offsets (0, 256, ..., 1,792 tokens), so every target
  lands in every bucket once and the buckets score the same text: they differ only in how much
  context precedes each target.

Writes ``benchmarks/results/tiny_model_eval.json``. float32, CPU, deterministic.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from kvbench.results import environment_stamp, results_path, weights_digest, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import DOC_SEPARATOR, load_corpus  # noqa: E402
from train import DEFAULT_OUT, encode_documents, heldout_nll, heldout_nll_by_position  # noqa: E402

#: the offsets between the window layouts: the narrowest position bucket
BUCKET = 256


def by_position_all_offsets(model, tokens, seq_len: int, step: int) -> dict:
    """Per-position-bucket loss over windows laid at offsets 0, step, 2 step, ... < seq_len."""
    runs = [heldout_nll_by_position(model, tokens[offset:], seq_len) for offset in range(0, seq_len, step)]
    windows = sum(r["windows"] for r in runs)
    buckets = []
    for i, bucket in enumerate(runs[0]["buckets"]):
        loss = sum(r["buckets"][i]["loss_nats"] * r["windows"] for r in runs) / windows
        buckets.append(
            {
                "positions": bucket["positions"],
                "loss_nats": round(loss, 4),
                "perplexity": round(math.exp(loss), 3),
            }
        )
    return {
        "windows": windows,
        "seq_len": seq_len,
        "offsets": list(range(0, seq_len, step)),
        "buckets": buckets,
    }


def evaluate(path: Path, threads: int) -> dict:
    """Held-out figures of the model in ``path`` (an HF checkpoint directory)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokens = encode_documents(tok, load_corpus("heldout").rstrip("\n").split(DOC_SEPARATOR))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll_256, targets_256 = heldout_nll(model, tokens, 256)
    by_position = by_position_all_offsets(model, tokens, 2048, BUCKET)
    return {
        "path": str(path),
        "weights_sha256": weights_digest(path),
        "heldout_tokens": int(len(tokens)),
        "perplexity_256_windows": round(math.exp(nll_256), 3),
        "targets_256_windows": targets_256,
        "by_position_2048_windows": by_position,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_OUT, help="checkpoint (default: the embedded model)"
    )
    parser.add_argument("--baseline", type=Path, default=None, help="an earlier checkpoint to compare with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_path("tiny_model_eval.json"))
    args = parser.parse_args(argv)
    result = {
        **environment_stamp(["torch", "transformers", "tokenizers", "numpy"]),
        "command": "python benchmarks/model/evaluate.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "text": "kvbench/data/heldout.txt",
        "model": evaluate(args.model, args.threads),
    }
    if args.baseline is not None:
        result["baseline"] = evaluate(args.baseline, args.threads)
    for key in ("model", "baseline"):
        if key in result:
            r = result[key]
            buckets = ", ".join(
                f"{b['positions'][0]}-{b['positions'][1]}: {b['perplexity']:.1f}"
                for b in r["by_position_2048_windows"]["buckets"]
            )
            print(f"{key}: ppl (256-token windows) {r['perplexity_256_windows']:.2f}; by position: {buckets}")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
