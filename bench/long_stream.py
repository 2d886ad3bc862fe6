"""Long answers from `verispec serve`: does a token cost the same at the end of an 8k-token answer as in a 1k one?

A 2-layer, 64-wide random model with the Qwen2.5 tokenizer (its 151,936-token vocabulary: the LM head dominates, so
a token costs a few milliseconds and the text path, the stop checks and the server's own work are what a long
answer could make grow) is served on the CPU, a fresh server per run; one streamed chat completion per length
(EOS ignored, `--stop` strings checked) is timed on the client: milliseconds per token from the first token to the
last, and each length against the shortest.

    python bench/long_stream.py [--lengths 1024,8192] [--drafter suffix]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx


def tiny_model(root: str) -> str:
    """A random 2-layer Qwen2 with the default target's tokenizer, saved as a transformers directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verispec.backends.loading import load_tokenizer
    from verispec.catalog import DEFAULT_TARGET

    tok = load_tokenizer(DEFAULT_TARGET)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = os.path.join(root, "tiny-qwen")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def serve(model: str, drafter: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "verispec.apps.cli", "serve", "--target", model, "--backend", "hf", "--device", "cpu",
           "--dtype", "fp32", "--port", str(port), "--max-tokens-cap", "65536", "--log-level", "warning"]
    cmd += ["--no-speculation"] if drafter == "none" else ["--drafter", drafter, "-k", "auto"]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def stream(port: int, n: int, stops: list[str]) -> dict:
    body = {"model": "verispec", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": n,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "stop": stops}
    first = last = None
    tokens, t0 = 0, time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                now = time.perf_counter()
                first, last = first or now, now
    return {"tokens": tokens, "ttft": first - t0, "ms_per_token": (last - first) * 1e3 / max(1, tokens - 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--drafter", default="suffix", help="suffix, ngram or none (plain decoding)")
    ap.add_argument("--stop", action="append", default=None, help="stop strings checked (default: two never found)")
    args = ap.parse_args()
    stops = args.stop or ["</never-a-stop>", "\n\n\n\n\n\n"]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = tiny_model(root)
        for n in [int(x) for x in args.lengths.split(",")]:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = serve(model, args.drafter, port)
            try:
                stream(port, 16, stops)  # warm-up: the first forwards pay for allocation
                rows.append({"length": n, **stream(port, n, stops)})
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(f"{n:>6} tokens: {rows[-1]['ms_per_token']:.3f} ms/token (TTFT {rows[-1]['ttft']:.2f} s)", flush=True)
    for r in rows:
        r["vs_shortest"] = r["ms_per_token"] / rows[0]["ms_per_token"]
    print(f"per token at {rows[-1]['length']} / at {rows[0]['length']}: {rows[-1]['vs_shortest']:.2f}x")
    print(json.dumps({"drafter": args.drafter, "rows": rows}))


if __name__ == "__main__":
    main()
