"""``palu-mlx generate``: ``mlx_lm.generate`` with palu's KV cache.

Every option of ``mlx_lm.generate`` is kept (its own argument parser is reused) and means what it
means there: ``--model``, ``--prompt`` (``-`` reads stdin), ``--max-tokens``, ``--temp`` and the
other sampling options, the chat template options, ``--prompt-cache-file``. palu adds
``--palu-bits`` / ``--palu-tier`` and ``--calibration``, or ``--kv-memory SIZE`` (with
``--kv-context``): the tier a memory plan chooses (:mod:`palu_mlx.memory_plan`), named on stderr;
``--model`` also takes kvbench's named models. It prints what mlx-lm prints (the text, prompt and
generation tokens per second, peak memory) and then the KV bytes the cache holds against an
uncompressed cache of the same tokens.
``--max-kv-size N`` bounds every layer to a window of ``N`` tokens (the first 4 kept), as mlx-lm's
does, with palu's rotating caches (:mod:`palu_mlx.rotating`).

``--prompt-cache-file FILE``:

* a file ``mlx_lm.cache_prompt`` wrote is loaded as ``mlx_lm.generate`` loads it (the prompt
  continues the cached one, with mlx-lm's rule for chat templates) and left as it is;
* a conversation file (one this command wrote, or a file that does not exist yet): the cache and
  the conversation's messages are loaded, the new prompt is the next user turn, and after the
  reply the file is written back, so the next call continues from it. Cached tokens that the chat
  template renders differently are trimmed and recomputed.

The file is written with mlx-lm's own ``save_prompt_cache`` (the conversation rides in its
metadata; ``"model"`` is the resolved model path, and ``palu_checksum`` is a sha256 over the
conversation's texts, :mod:`palu_mlx.integrity`, so an edited conversation is refused; each palu
layer's state carries its own checksum), so mlx-lm's ``load_prompt_cache`` reads it
in any process that called ``palu_mlx.register_with_mlx_lm()``, and ``mlx_lm.generate
--prompt-cache-file`` continues it when run as ``python -c "import palu_mlx;
palu_mlx.register_with_mlx_lm(); from mlx_lm.generate import main; main()" ...``.
Conversation files of palu's own format (earlier versions) are still read.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .json_text import parse_json_text

__all__ = ["generate_main"]

_PALU_FORMAT = "palu-mlx.prompt-cache.v1"
# keys of a palu conversation file's metadata besides mlx-lm's "model" and "tokenizer_config"
_MESSAGES, _TOKENS = "palu_messages", "palu_tokens"
# the conversation's texts, covered by the checksum written under _CHECKSUM
_CONVERSATION = ("model", "tokenizer_config", _MESSAGES, _TOKENS)
_CHECKSUM = "palu_checksum"
# what loading a file that is not a readable prompt cache raises inside mlx / mlx-lm (a truncated or
# non-safetensors file is an mlx RuntimeError; other metadata fails mlx-lm's unflattening)
_LOAD_ERRORS = (ValueError, KeyError, OSError, RuntimeError, TypeError, IndexError, AttributeError)


class _BadFile(Exception):
    """A prompt-cache file's conversation metadata is not what this command writes."""


def _conversation_digest(metadata: dict[str, Any]) -> str:
    from .integrity import digest

    return digest({}, {k: metadata[k] for k in _CONVERSATION if k in metadata})


def _json_field(metadata: dict[str, Any], key: str, default: str, kind: type, what: str) -> Any:
    return parse_json_text(metadata.get(key, default), kind, f"metadata {key!r}", _BadFile, what)


def _read_conversation(
    metadata: dict[str, Any], palu_file: bool, checked: bool, cache: list[Any]
) -> tuple[dict[str, Any], list[dict[str, str]] | None, list[int]]:
    """The file's tokenizer config, messages (None when it has none) and tokens, each checked.

    ``checked``: the metadata is already covered by a checksum (palu's own file format); else a
    conversation this command wrote must carry :data:`_CHECKSUM` over its texts (one without it
    is refused: it cannot be verified).
    """
    if palu_file and not checked:
        stored = metadata.get(_CHECKSUM)
        if stored is None:
            raise _BadFile(
                f"its conversation metadata has no {_CHECKSUM!r} entry (this command writes one); it cannot "
                "be verified, so it is not continued"
            )
        if stored != _conversation_digest(metadata):
            raise _BadFile(
                f"checksum mismatch: its conversation metadata ({', '.join(_CONVERSATION)}) changed after "
                "it was written; it cannot be continued"
            )
    if "model" in metadata and (not isinstance(metadata["model"], str) or not metadata["model"]):
        raise _BadFile(f"metadata 'model' must be a model path or name; got {metadata['model']!r:.100}")
    tokenizer_config = _json_field(metadata, "tokenizer_config", "{}", dict, "a JSON object")
    if not palu_file:
        return tokenizer_config, None, []
    messages = None
    if _MESSAGES in metadata:
        messages = _json_field(metadata, _MESSAGES, "[]", list, "a JSON list of messages")
        for i, m in enumerate(messages):
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise _BadFile(
                    f"metadata {_MESSAGES!r} entry {i} must be an object with string 'role' and "
                    f"'content'; got {m!r:.100}"
                )
    tokens = _json_field(metadata, _TOKENS, "[]", list, "a JSON list of token ids")
    bad = [t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise _BadFile(f"metadata {_TOKENS!r} must list token ids (integers >= 0); it holds {bad[0]!r:.100}")
    held = max((c.size() for c in cache), default=0)
    if len(tokens) != held:
        raise _BadFile(f"metadata {_TOKENS!r} lists {len(tokens)} tokens but the cache holds {held}")
    return tokenizer_config, messages, tokens


def _parser():
    from mlx_lm.generate import setup_arg_parser

    from .serving import add_palu_arguments

    parser = setup_arg_parser()
    parser.prog = "palu-mlx generate"
    parser.description = "mlx_lm.generate with palu's compressed KV cache"
    add_palu_arguments(parser)
    return parser


def _is_palu_file(path: str) -> bool:
    import mlx.core as mx

    try:
        _, meta = mx.load(path, return_metadata=True)
    except (OSError, RuntimeError, ValueError):
        return False
    return meta.get("format") == _PALU_FORMAT


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def generate_main(argv: Sequence[str]) -> int:
    """``palu-mlx generate``: returns the exit code (1 with a one-line error on a user mistake)."""
    args = _parser().parse_args(list(argv))
    if args.kv_bits is not None:
        return _error(
            f"--kv-bits {args.kv_bits}: mlx-lm's quantized cache replaces palu's; use --palu-bits instead"
        )
    if args.max_kv_size is not None and args.prompt_cache_file is not None:
        # a conversation file is continued by trimming back to the common prefix, which a cache
        # whose first tokens have left the window cannot do
        return _error(
            f"--max-kv-size {args.max_kv_size} with --prompt-cache-file: a file's cache continues every "
            "token of the conversation; drop one of the two"
        )
    if args.image:
        return _error("--image is not supported by palu-mlx generate; use mlx_lm.generate")
    from kvspec import KVConfigError

    from .serving import check_palu_arguments

    try:
        check_palu_arguments(args)
    except KVConfigError as exc:
        return _error(str(exc))

    import mlx.core as mx
    import mlx_lm
    from kvspec import KVSpecError
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import load_prompt_cache as mlx_load_prompt_cache
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mlx_lm.models.cache import save_prompt_cache as mlx_save_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from .builder import KVCacheBuilder, load_prompt_cache, register_with_mlx_lm
    from .serving import ModelNameError, describe, kv_bytes, palu_config, resolve_model_arg

    if args.seed is not None:
        mx.random.seed(args.seed)

    # ------------------------------------------------------------------ the prompt cache file
    cache_file = args.prompt_cache_file
    if cache_file is not None and not cache_file.endswith(".safetensors"):
        cache_file += ".safetensors"  # as mx.save_safetensors names what it writes
    cached, metadata, palu_file = None, {}, True
    tokenizer_config: dict[str, Any] = {}
    messages: list[dict[str, str]] | None = None
    cached_tokens: list[int] = []
    if cache_file is not None and os.path.exists(cache_file):
        try:
            # mlx-lm's loader looks the saved class names up in its own module: palu's must be
            # there before the file is read, not only once a palu cache has been built
            register_with_mlx_lm()
            checked = _is_palu_file(cache_file)
            if checked:
                cached, metadata = load_prompt_cache(cache_file, return_metadata=True)
            else:
                cached, metadata = mlx_load_prompt_cache(cache_file, return_metadata=True)
                if not isinstance(metadata, dict):
                    raise _BadFile(f"its metadata is a {type(metadata).__name__}, not a mapping")
                palu_file = _MESSAGES in metadata  # a conversation this command wrote
            tokenizer_config, messages, cached_tokens = _read_conversation(
                metadata, palu_file, checked, cached
            )
        except (KVSpecError, _BadFile, *_LOAD_ERRORS) as exc:
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return _error(f"--prompt-cache-file {cache_file!r} cannot be loaded: {detail}")
    model_arg = args.model
    if cached is not None and "model" in metadata:
        if model_arg is None:
            model_arg = metadata["model"]
        elif not _same_model(model_arg, metadata["model"], resolve_model_arg):
            return _error(
                f"--model {model_arg!r} differs from the model the prompt cache was made with "
                f"({metadata['model']!r})"
            )
    if model_arg is None:
        return _error(
            "--model is required (a local directory, a hub id or a named model such as smollm2-135m)"
        )

    # ------------------------------------------------------------------ model and palu caches
    try:
        model_path = resolve_model_arg(model_arg)
    except ModelNameError as exc:
        return _error(str(exc))
    tokenizer_config["trust_remote_code"] = args.trust_remote_code
    try:
        model, tokenizer = mlx_lm.load(
            model_path,
            adapter_path=args.adapter_path,
            tokenizer_config=tokenizer_config,
            model_config={"quantize_activations": args.quantize_activations},
        )
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's --model
        return _error(f"--model {model_arg!r} cannot be loaded: {exc}")
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)
    try:
        config = palu_config(model, args, report=lambda line: print(line, file=sys.stderr))
        KVCacheBuilder.install(model, config)
    except KVSpecError as exc:
        return _error(str(exc))
    if args.verbose:
        print(describe(config), file=sys.stderr)

    # ------------------------------------------------------------------ the prompt
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    template_kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if args.use_default_chat_template and tokenizer.chat_template is None:
        tokenizer.chat_template = tokenizer.default_chat_template
        use_chat_template = not args.ignore_chat_template
    has_prefill = args.prefill_response is not None
    if messages is None:
        messages = []
        if args.system_prompt is not None:
            messages = [{"role": "system", "content": args.system_prompt}]
    messages.append({"role": "user", "content": prompt})
    if has_prefill:
        messages.append({"role": "assistant", "content": args.prefill_response})

    if use_chat_template:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=has_prefill,
            add_generation_prompt=not has_prefill,
            **template_kwargs,
        )
        if cached is not None and not palu_file:
            # mlx-lm's rule for its own cache files: the cache holds the template up to the query
            probe = [*messages[:-1], {"role": messages[-1]["role"], "content": "<query>"}]
            test = tokenizer.apply_chat_template(
                probe,
                tokenize=False,
                continue_final_message=has_prefill,
                add_generation_prompt=not has_prefill,
            )
            text = text[test.index("<query>") :]
        tokens = tokenizer.encode(text, add_special_tokens=False)
    else:
        tokens = tokenizer.encode(prompt, add_special_tokens=cached is None)
        if cached is not None and palu_file:
            tokens = cached_tokens + tokens

    if cached is not None:
        cache = cached
    elif args.max_kv_size is not None:
        # as mlx-lm's make_prompt_cache(model, max_kv_size): every layer holds a bounded window
        try:
            cache = KVCacheBuilder.for_model(model, config, max_kv_size=args.max_kv_size)
        except KVSpecError as exc:
            return _error(f"--max-kv-size {args.max_kv_size}: {exc}")
    else:
        cache = make_prompt_cache(model)
    if palu_file and cached is not None:
        # the file's tokens are a prefix of the new conversation up to where the template agrees
        common = 0
        for a, b in zip(cached_tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token goes through the model
        trim_prompt_cache(cache, len(cached_tokens) - common)
        fed = tokens[common:]
        prefix = tokens[:common]
    else:
        fed, prefix = tokens, []

    # ------------------------------------------------------------------ generation (mlx-lm's output)
    draft_model = None
    if args.draft_model is not None:
        draft_model, draft_tokenizer = mlx_lm.load(args.draft_model)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            return _error("--draft-model's tokenizer does not match the model's")
        if cached is None:
            cache = cache + make_prompt_cache(draft_model)
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    if args.verbose:
        print("=" * 10)
    reply, generated, response = "", [], None
    for response in stream_generate(
        model,
        tokenizer,
        mx.array(fed),
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
        draft_model=draft_model,
        num_draft_tokens=args.num_draft_tokens,
    ):
        if args.verbose:
            print(response.text, end="", flush=True)
        reply += response.text
        generated.append(int(response.token))
    if not args.verbose:
        print(reply)
    else:
        print()
        print("=" * 10)
        if response is None or not reply:
            print("No text generated for this prompt")
        if response is not None:
            print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
            print(
                f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec"
            )
            print(f"Peak memory: {response.peak_memory:.3f} GB")
        held, raw = kv_bytes(cache)
        n = max((c.size() for c in cache), default=0)
        versus = f"{held / raw:.3f}x " if raw else ""
        print(
            f"KV cache: {held / 1e6:.3f} MB held for {n} tokens ({versus}an uncompressed cache's {raw / 1e6:.3f} MB)"
        )

    # ------------------------------------------------------------------ the conversation, written back
    if cache_file is not None and palu_file:
        n = max((c.size() for c in cache), default=0)
        all_tokens = prefix + fed + generated
        if has_prefill:
            messages[-1] = {"role": "assistant", "content": args.prefill_response + reply}
        else:
            messages.append({"role": "assistant", "content": reply})
        meta = {
            # what mlx_lm.generate loads when it continues the file (from any directory)
            "model": os.path.abspath(model_path) if os.path.isdir(model_path) else model_path,
            "tokenizer_config": json.dumps(
                {k: v for k, v in tokenizer_config.items() if k != "trust_remote_code"}
            ),
            _MESSAGES: json.dumps(messages),
            _TOKENS: json.dumps(all_tokens[:n]),
        }
        meta[_CHECKSUM] = _conversation_digest(meta)
        tmp = f"{cache_file}.{os.getpid()}.tmp.safetensors"
        try:
            mlx_save_prompt_cache(tmp, cache, meta)
            os.replace(tmp, cache_file)  # a failed write leaves the previous conversation as it was
        except (KVSpecError, OSError, RuntimeError, ValueError) as exc:
            if os.path.exists(tmp):
                os.remove(tmp)
            return _error(f"--prompt-cache-file {cache_file!r} cannot be written: {exc}")
    return 0


def _same_model(given: str, saved: str, resolve) -> bool:
    """Whether ``--model`` names the model a file was made with (a named model and its directory agree)."""
    if given == saved:
        return True
    try:
        a, b = resolve(given), resolve(saved)
    except Exception:  # noqa: BLE001 - a name that does not resolve is simply not the same model
        return False
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return a == b
