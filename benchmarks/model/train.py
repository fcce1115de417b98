"""Train the embedded default model: a tiny qwen3 on Python's own documentation, on CPU.

No model can be downloaded where this project runs, so it trains and ships its own small one
(``benchmarks/model/tiny-qwen3``). This script is the whole recipe: a byte-level BPE tokenizer
trained with ``tokenizers`` on the training split of :mod:`corpus`, then a qwen3 causal LM
(RoPE, q/k RMSNorm, grouped-query attention) trained with AdamW and a cosine schedule, seeded.
It writes the checkpoint in the standard Hugging Face layout every ``--save-every`` steps (so a
usable model exists even if the run is cut short) and a training record with the config, corpus
description and hash, the loss curve, held-out perplexity and the add-one unigram baseline.

CI never runs this; it uses the committed checkpoint. Typical use (2 CPU cores, ~30 min)::

    python benchmarks/model/train.py
    python benchmarks/model/train.py --steps 3 --out /tmp/smoke --record /tmp/smoke.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from kvbench.results import environment_stamp, results_path, weights_digest, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import (  # noqa: E402
    DOC_SEPARATOR,
    corpus_record,
    load_corpus,
    long_corpus_record,
    long_streams,
    split_documents,
)

MODEL_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = MODEL_DIR / "tiny-qwen3"
DEFAULT_RECORD = results_path("tiny_model_training.json")

BOS, EOS = "<|startoftext|>", "<|endoftext|>"

#: prompts in the style of the corpus, used for the greedy continuations in the record
PROMPTS = (
    "Return the number of",
    "The following example shows how to",
    "A dictionary is",
    "If the file does not exist,",
    "class",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory (HF layout)")
    p.add_argument("--record", type=Path, default=DEFAULT_RECORD, help="training record JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=2048, help="max_position_embeddings")
    p.add_argument("--seq-len", type=int, default=256, help="training sequence length")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument(
        "--time-budget-min", type=float, default=0.0, help="stop early after this many minutes (0 = none)"
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue from this HF checkpoint (its tokenizer and weights) instead of training from scratch",
    )
    p.add_argument(
        "--corpus",
        choices=("docs", "long"),
        default="docs",
        help="docs: the stdlib documentation split; long: corpus.long_streams() (docs + package "
        "docstrings + stdlib source), sampled by stream weight",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="resumable training state (weights, optimizer, data RNG, curves), written at every save; "
        "a run started with an existing state continues from its step",
    )
    p.add_argument(
        "--bf16", action="store_true", help="bf16 autocast for the forward pass (fp32 master weights)"
    )
    p.add_argument(
        "--eval-seq-len",
        type=int,
        default=0,
        help="held-out window length for evaluation and the per-position buckets (0 = --seq-len)",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="stop after this many steps without changing the --steps schedule (0 = run all); "
        "reproduces a run that a time budget cut short, bit for bit",
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(train_docs: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers``) that prepends BOS to every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return tok


def wrap_tokenizer(tok, context: int):
    """The transformers view of the tokenizer (writes tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=context,
        clean_up_tokenization_spaces=False,
    )


def encode_documents(tok, docs: list[str]) -> np.ndarray:
    """One token stream: ``BOS doc EOS`` for every document, concatenated. int64 ``[N]``."""
    eos_id = tok.token_to_id(EOS)
    out: list[int] = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)  # post-processor already put BOS first
        out.append(eos_id)
    return np.asarray(out, dtype=np.int64)


# --------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace, bos_id: int, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.context,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )
    return Qwen3ForCausalLM(config)


def save_checkpoint(model, hf_tok, out: Path) -> None:
    """Write the HF layout atomically (tmp dir + rename), fp32, and make config.json readable by mlx-lm."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    hf_tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # Older mlx-lm and transformers 4.x read rope_theta at the top level; 5.x nests it.
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg.setdefault("rope_scaling", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # transformers 5 writes its new class name; the generic fast class loads in 4.x and 5.x alike.
    tok_cfg_path = tmp / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def heldout_nll(model, tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> tuple[float, int]:
    """Mean next-token NLL (nats) over non-overlapping ``seq_len``-token windows of ``tokens``."""
    model.eval()
    n_windows = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    total, count = 0.0, 0
    for start in range(0, n_windows, 8):
        rows = [
            tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(start, min(start + 8, n_windows))
        ]
        batch = torch.from_numpy(np.stack(rows))
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += batch[:, 1:].numel()
    model.train()
    return total / count, count


#: held-out perplexity is reported per bucket of target position inside the window
POSITION_BUCKETS = ((0, 256), (256, 512), (512, 1024), (1024, 2048))


@torch.no_grad()
def heldout_nll_by_position(model, tokens: np.ndarray, seq_len: int) -> dict:
    """Mean next-token NLL per position bucket over non-overlapping ``seq_len``-token windows.

    A model that uses its context predicts later positions better: the buckets must fall.
    """
    model.eval()
    n_windows = (len(tokens) - 1) // seq_len
    sums = torch.zeros(seq_len, dtype=torch.float64)
    for i in range(n_windows):
        row = torch.from_numpy(tokens[i * seq_len : i * seq_len + seq_len + 1])[None]
        logits = model(input_ids=row[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], row[0, 1:], reduction="none")
        sums += nll.double()
    model.train()
    out = {"windows": n_windows, "seq_len": seq_len, "buckets": []}
    for lo, hi in POSITION_BUCKETS:
        if lo >= seq_len:
            break
        mean = float(sums[lo:hi].sum() / (n_windows * (min(hi, seq_len) - lo)))
        out["buckets"].append(
            {
                "positions": [lo, min(hi, seq_len)],
                "loss_nats": round(mean, 4),
                "perplexity": round(math.exp(mean), 3),
            }
        )
    return out


def unigram_nll(train_tokens: np.ndarray, tokens: np.ndarray, seq_len: int, vocab_size: int) -> float:
    """Add-one-smoothed unigram NLL (nats), estimated on training tokens, on the same held-out targets."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    n_windows = (len(tokens) - 1) // seq_len
    targets = np.concatenate([tokens[i * seq_len + 1 : i * seq_len + seq_len + 1] for i in range(n_windows)])
    return float(-logp[targets].mean())


@torch.no_grad()
def continuations(model, hf_tok, prompts=PROMPTS, new_tokens: int = 32) -> list[dict]:
    model.eval()
    out = []
    for prompt in prompts:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=hf_tok.pad_token_id
        )
        out.append(
            {
                "prompt": prompt,
                "continuation": hf_tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=False),
            }
        )
    model.train()
    return out


# --------------------------------------------------------------------------- training
def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def load_data(args: argparse.Namespace, tok) -> tuple[list[tuple[str, np.ndarray, float]], dict]:
    """Training token streams ``(name, tokens, weight)`` and the corpus record."""
    if args.corpus == "docs":
        train_docs = [text for _, text in split_documents()[0]]
        return [("stdlib-docs", encode_documents(tok, train_docs), 1.0)], corpus_record()
    streams = long_streams()
    record = corpus_record()
    record["long"] = long_corpus_record(streams)
    out = []
    for stream in streams:
        tokens = encode_documents(tok, [text for _, text in stream["documents"]])
        record["long"][stream["name"]]["tokens"] = int(len(tokens))
        out.append((stream["name"], tokens, stream["weight"]))
    return out, record


def sample_batch(gen: np.random.Generator, streams, batch: int, seq_len: int) -> torch.Tensor:
    """``batch`` windows of ``seq_len + 1`` tokens: a stream drawn by weight, then a uniform start."""
    weights = np.asarray([w for _, _, w in streams], dtype=np.float64)
    picks = gen.choice(len(streams), size=batch, p=weights / weights.sum())
    rows = []
    for pick in picks:
        tokens = streams[pick][1]
        start = int(gen.integers(0, len(tokens) - seq_len - 1))
        rows.append(tokens[start : start + seq_len + 1])
    return torch.from_numpy(np.stack(rows))


def save_state(path: Path, model, opt, gen, steps_done: int, losses, evals, elapsed: float) -> None:
    """Everything a later run needs to continue bit for bit; written atomically."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "state.pt.tmp"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "data_rng": gen.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
            "steps_done": steps_done,
            "losses": losses,
            "evals": evals,
            "elapsed_s": elapsed,
        },
        tmp,
    )
    tmp.replace(path / "state.pt")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t_start = time.perf_counter()
    eval_len = args.eval_seq_len or args.seq_len

    if args.init_from is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    else:
        tok = train_tokenizer([text for _, text in split_documents()[0]], args.vocab_size)
    args.vocab_size = tok.get_vocab_size()
    hf_tok = wrap_tokenizer(tok, args.context)
    streams, corpus = load_data(args, tok)
    heldout_docs = load_corpus("heldout").rstrip("\n").split(DOC_SEPARATOR)  # same text, committed file
    heldout_tokens = encode_documents(tok, heldout_docs)
    train_tokens = streams[0][1]  # the stdlib-docs stream: the unigram baseline's counts
    print(
        f"tokenizer: vocab {args.vocab_size}; train { ({name: len(t) for name, t, _ in streams}) }; heldout {len(heldout_tokens)}",
        flush=True,
    )

    if args.init_from is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        model.config.max_position_embeddings = args.context
    else:
        model = build_model(args, bos_id=tok.token_to_id(BOS), eos_id=tok.token_to_id(EOS))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = np.random.default_rng(args.seed)

    losses: list[dict] = []
    evals: list[dict] = []
    first_step, elapsed_before = 0, 0.0
    state_file = args.state_dir / "state.pt" if args.state_dir is not None else None
    if state_file is not None and state_file.exists():
        state = torch.load(state_file, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.bit_generator.state = state["data_rng"]
        torch.set_rng_state(state["torch_rng"])
        first_step, losses, evals = state["steps_done"], state["losses"], state["evals"]
        elapsed_before = state["elapsed_s"]
        print(f"resumed from {state_file} at step {first_step}", flush=True)

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - t_start

    window_loss, window_n = 0.0, 0
    steps_done = first_step
    model.train()
    for step in range(first_step, args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        batch = sample_batch(gen, streams, args.batch, args.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        window_loss += loss.item()
        window_n += 1
        if steps_done % args.log_every == 0 or steps_done == args.steps:
            losses.append(
                {
                    "step": steps_done,
                    "train_loss": round(window_loss / window_n, 4),
                    "lr": lr_at(step, args),
                    "elapsed_s": round(elapsed(), 1),
                }
            )
            print(
                f"step {steps_done}/{args.steps} loss {window_loss / window_n:.4f} lr {lr_at(step, args):.2e} {elapsed():.0f}s",
                flush=True,
            )
            window_loss, window_n = 0.0, 0
        # Both stops fall on step boundaries, so the weights at step N do not depend on the clock.
        out_of_time = (
            args.time_budget_min > 0 and time.perf_counter() - t_start > 60 * args.time_budget_min
        ) or (args.stop_after > 0 and steps_done >= args.stop_after)
        if steps_done % args.eval_every == 0 and steps_done != args.steps:
            nll, _ = heldout_nll(model, heldout_tokens, eval_len, max_windows=8)
            evals.append(
                {"step": steps_done, "heldout_loss_subset": round(nll, 4), "windows": 8, "seq_len": eval_len}
            )
            print(f"  heldout (8 windows of {eval_len}) loss {nll:.4f} ppl {math.exp(nll):.1f}", flush=True)
        if steps_done % args.save_every == 0 or out_of_time:
            save_checkpoint(model, hf_tok, args.out)
            if args.state_dir is not None:
                save_state(args.state_dir, model, opt, gen, steps_done, losses, evals, elapsed())
        if out_of_time:
            print(
                f"stopped at step {steps_done} (time budget {args.time_budget_min} min / --stop-after)",
                flush=True,
            )
            break
    train_seconds = elapsed()

    nll, n_targets = heldout_nll(model, heldout_tokens, args.seq_len)
    by_position = heldout_nll_by_position(model, heldout_tokens, eval_len)
    uni = unigram_nll(train_tokens, heldout_tokens, args.seq_len, args.vocab_size)
    print(f"heldout: loss {nll:.4f} ppl {math.exp(nll):.2f}; unigram ppl {math.exp(uni):.2f}", flush=True)
    print(f"heldout by position: {by_position['buckets']}", flush=True)
    save_checkpoint(model, hf_tok, args.out)
    if args.state_dir is not None:
        save_state(args.state_dir, model, opt, gen, steps_done, losses, evals, train_seconds)
    samples = continuations(model, hf_tok)
    for s in samples:
        print(f"  {s['prompt']!r} -> {s['continuation']!r}", flush=True)

    stamp = environment_stamp(["torch", "transformers", "tokenizers", "numpy"])
    stamp["machine"]["torch_threads"] = args.threads
    record = {
        **stamp,
        "command": "python benchmarks/model/train.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_config": json.loads((args.out / "config.json").read_text()),
        "n_parameters": n_params,
        "checkpoint_bytes": sum(f.stat().st_size for f in args.out.iterdir()),
        "weights_sha256": weights_digest(args.out),
        "corpus": corpus,
        "tokens": {
            "train": {name: int(len(t)) for name, t, _ in streams},
            "heldout": int(len(heldout_tokens)),
            "heldout_targets_scored": n_targets,
        },
        "steps_planned": args.steps,
        "steps_done": steps_done,
        "tokens_seen": (steps_done - first_step) * args.batch * args.seq_len,
        "resumed_at_step": first_step,
        "train_seconds": round(train_seconds, 1),
        "loss_curve": losses,
        "heldout_curve": evals,
        "heldout": {
            "loss_nats": round(nll, 4),
            "perplexity": round(math.exp(nll), 3),
            "unigram_add_one_loss_nats": round(uni, 4),
            "unigram_add_one_perplexity": round(math.exp(uni), 3),
            "perplexity_ratio_unigram_over_model": round(math.exp(uni - nll), 2),
            "eval": f"non-overlapping {args.seq_len}-token windows of the held-out text, BOS doc EOS per document",
        },
        "heldout_by_position": by_position,
        "greedy_continuations": samples,
    }
    write_json(args.record, record)
    print(f"wrote {args.out} and {args.record}", flush=True)
    return record


if __name__ == "__main__":
    main()
