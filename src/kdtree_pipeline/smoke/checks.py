"""The smoke checks: short prompt, long-context passkey, streaming, concurrency,
speculative metrics. Each returns a :class:`CheckResult` with its latency.

Token counts on the client side are approximate: the long prompt is sized by
whitespace-separated words, counting one token per word. English words and the
punctuation of the filler are at least one token each in the BPE tokenizers of
the DeepSeek/Kimi family (the filler measures about 1.2-1.3 tokens per word), so
the word count is a lower bound. The server's ``usage.prompt_tokens`` is the
authoritative count and the check requires it to be >= the target when reported.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .client import HttpError, SmokeClient

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
LONG_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
LONG_QUESTION = "What is the pass key? The pass key is"
TOKEN_COUNT_METHOD = (
    "client-side: 1 token per whitespace-separated word (a lower bound for this English "
    "filler; real tokenizers give about 1.2-1.3 per word); server usage.prompt_tokens is "
    "authoritative and must be >= the target"
)


@dataclass
class CheckResult:
    """One check's verdict. ``detail`` is the human line; ``data`` goes to evidence."""

    name: str
    passed: bool
    latency_s: float | None
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        lat = None if self.latency_s is None else round(self.latency_s, 3)
        return {"passed": self.passed, "latency_s": lat}


def approx_tokens(text: str) -> int:
    """Approximate token count of ``text``: its whitespace-separated words."""
    return len(text.split())


@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    passkey: str
    approx_tokens: int


def passkey_prompt(target_tokens: int, seed: int = 0, depth: float = 0.5) -> PasskeyPrompt:
    """A prompt of at least ``target_tokens`` approximate tokens with a 5-digit pass
    key (from ``seed``) buried at ``depth`` (0 = start, 1 = end) of the filler."""
    if target_tokens < 1:
        raise ValueError(f"--long-tokens: expected a positive token count, got {target_tokens}")
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    fixed = approx_tokens(LONG_INTRO) + approx_tokens(needle) + approx_tokens(LONG_QUESTION)
    per = approx_tokens(FILLER)
    reps = max(1, -(-(target_tokens - fixed) // per))
    before = round(reps * depth)
    text = " ".join(
        [LONG_INTRO, *[FILLER] * before, needle, *[FILLER] * (reps - before), LONG_QUESTION]
    )
    return PasskeyPrompt(text, key, approx_tokens(text))


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (the model's pass-key answer), or None."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _completion_text(body: Any) -> str:
    try:
        return str(body["choices"][0]["text"])
    except (KeyError, IndexError, TypeError):
        raise HttpError("POST /v1/completions", "bad shape",
                        f"expected choices[0].text in the answer, got {str(body)[:500]!r}") from None


def _failed(name: str, e: HttpError, t0: float) -> CheckResult:
    return CheckResult(name, False, time.monotonic() - t0, str(e),
                       {"error": str(e), "error_kind": e.kind, "status": e.status})


def check_short(
    client: SmokeClient, model: str, prompt: str, expect: str, max_tokens: int
) -> CheckResult:
    """The deterministic short prompt: the continuation must start with ``expect``."""
    t0 = time.monotonic()
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    try:
        body, lat = client.post_json("/v1/completions", payload)
        text = _completion_text(body)
    except HttpError as e:
        return _failed("short", e, t0)
    ok = text.startswith(expect)
    detail = (f"{prompt!r} -> {text!r}" if ok
              else f"wrong answer: {prompt!r} -> {text!r}, expected it to start with {expect!r}")
    return CheckResult("short", ok, lat, detail,
                       {"prompt": prompt, "text": text, "expect": expect, "usage": body.get("usage")})


def check_long(
    client: SmokeClient, model: str, target_tokens: int, seed: int, max_tokens: int = 16
) -> CheckResult:
    """The long-context passkey prompt: the answer must contain the pass key and the
    server-reported prompt length (when reported) must reach ``target_tokens``."""
    p = passkey_prompt(target_tokens, seed)
    t0 = time.monotonic()
    payload = {"model": model, "prompt": p.text, "max_tokens": max_tokens, "temperature": 0}
    try:
        body, lat = client.post_json("/v1/completions", payload)
        text = _completion_text(body)
    except HttpError as e:
        r = _failed("long", e, t0)
        r.data.update(passkey=p.passkey, approx_tokens=p.approx_tokens)
        return r
    answer = first_number(text)
    usage = body.get("usage") if isinstance(body, dict) else None
    server_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    problems = []
    if answer != p.passkey:
        problems.append(f"wrong answer: expected pass key {p.passkey}, got {text!r}")
    if server_tokens is None:
        count = f"~{p.approx_tokens} tokens (approximate; server reported no usage.prompt_tokens)"
    else:
        count = f"{server_tokens} prompt tokens (server-reported)"
        if server_tokens < target_tokens:
            problems.append(
                f"the server counted {server_tokens} prompt tokens, fewer than the "
                f"{target_tokens} target (raise --long-tokens)"
            )
    detail = "; ".join(problems) if problems else f"pass key {p.passkey} found at {count}"
    return CheckResult("long", not problems, lat, detail, {
        "passkey": p.passkey, "answer": answer, "text": text, "target_tokens": target_tokens,
        "approx_tokens": p.approx_tokens, "server_prompt_tokens": server_tokens,
        "token_count_method": TOKEN_COUNT_METHOD,
    })


def check_stream(
    client: SmokeClient, model: str, prompt: str, expect: str, max_tokens: int,
    read_timeout: float,
) -> CheckResult:
    """A streamed completion: events parsed, ``[DONE]`` seen, text starts with ``expect``."""
    t0 = time.monotonic()
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "stream_options": {"include_usage": True}}
    try:
        r = client.stream_completion(payload, read_timeout=read_timeout)
    except HttpError as e:
        return _failed("stream", e, t0)
    ok = r.chunks > 0 and r.text.startswith(expect)
    ttft = f"{r.first_chunk_s:.3f}s" if r.first_chunk_s is not None else "n/a"
    detail = (f"{r.chunks} events, first after {ttft}, text {r.text!r}" if ok else
              f"wrong answer: streamed {r.text!r} in {r.chunks} events, expected it to start "
              f"with {expect!r}")
    return CheckResult("stream", ok, r.latency_s, detail, {
        "text": r.text, "events": r.chunks, "first_event_s": r.first_chunk_s, "usage": r.usage})


def check_concurrent(
    client: SmokeClient, model: str, prompt: str, expect: str, max_tokens: int, n: int
) -> CheckResult:
    """``n`` short requests at once; each must answer and start with ``expect``."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(
            lambda _: check_short(client, model, prompt, expect, max_tokens), range(n)))
    wall = time.monotonic() - t0
    bad = [f"request {i}: {r.detail}" for i, r in enumerate(results) if not r.passed]
    lats = [round(r.latency_s, 3) for r in results if r.latency_s is not None]
    kinds = Counter(r.detail for r in results if not r.passed)
    detail = (f"{n} requests, wall {wall:.3f}s, slowest {max(lats):.3f}s" if not bad
              else f"{len(bad)} of {n} failed: "
              + " | ".join(f"{d} (x{k})" if k > 1 else d for d, k in kinds.items()))
    return CheckResult("concurrent", not bad, wall, detail,
                       {"n": n, "latencies_s": lats, "texts": [r.data.get("text") for r in results],
                        "failures": bad})


SPEC_KEYS = ("spec_verify_ct", "spec_accept_length", "spec_accept_rate",
             "spec_num_correct_drafts", "spec_num_proposed_drafts")


def check_spec(
    client: SmokeClient, prompt: str, max_tokens: int, require: bool
) -> CheckResult:
    """Native ``/generate``: report the speculative figures in ``meta_info``. With
    ``require`` the check fails unless ``spec_verify_ct`` > 0 (verify steps ran)."""
    t0 = time.monotonic()
    payload = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
    try:
        body, lat = client.post_json("/generate", payload)
    except HttpError as e:
        return _failed("spec", e, t0)
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        return CheckResult("spec", False, lat,
                           f"POST /generate: no meta_info in the answer: {str(body)[:500]!r}")
    spec = {k: meta[k] for k in SPEC_KEYS if k in meta}
    verify_ct = spec.get("spec_verify_ct")
    ran = isinstance(verify_ct, (int, float)) and verify_ct > 0
    if ran:
        acc = spec.get("spec_accept_length")
        acc_s = f"{acc:.2f}" if isinstance(acc, (int, float)) else "n/a"
        detail = f"spec_verify_ct={verify_ct}, accept length {acc_s}"
    else:
        detail = ("the server reported no speculative metrics (spec_verify_ct) in /generate "
                  "meta_info, so no verify step is proven to have run; launch SGLang with "
                  "--speculative-algorithm EAGLE" + ("" if require else " (allowed by --allow-no-spec)"))
    return CheckResult("spec", ran or not require, lat, detail,
                       {"reported": ran, **spec, "completion_tokens": meta.get("completion_tokens")})
