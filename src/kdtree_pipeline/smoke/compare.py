"""Greedy outputs of kernel on against kernel off, token by token, with a tolerance that bf16
logits justify.

The tolerance. SGLang computes the logits in bf16 (its LogitsProcessor multiplies in the lm
head's dtype, then converts to float), and this model's top logits sit around 16 to 32 (the
lm head's N(0, 0.05) over a unit-RMS hidden state of 7168 gives logits of standard deviation
about 4.2, whose maximum over 163,840 ids is about 4.4 of them), where one bf16 step is 0.125.
Two correct attention kernels differ in the last bits of their bf16 outputs, and any such
difference moves a logit by whole steps, so a logprob may move by a step or two:
``LOGPROB_TOL`` = 0.25 (two steps). For the same reason two ids whose logits are within two
steps are a tie that bf16 cannot order: greedy decoding may pick either. So:

- the first token of each prompt comes from the prefill, which the plugin never serves: it must
  be the same id with the same logprob (within the tolerance);
- until the first position where the ids differ, every chosen token's logprob agrees within
  ``LOGPROB_TOL``;
- at that position, the kernel-off run's top two must be within ``TIE_TOL`` and the kernel-on
  run must have picked its runner-up (a tie broken the other way); after it the two runs have
  different contexts, and the comparison of that prompt stops.

A wrong kernel (a wrong mask, wrong rows, a wrong scale) moves logits by whole units, far past
these bounds, and flips tokens at wide margins.
"""

from __future__ import annotations

from typing import Any

LOGPROB_TOL = 0.25
TIE_TOL = 0.25


def compare_one(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """One prompt's two greedy outputs (``ids``, ``logprobs``, ``top2`` from live.generate)."""
    a, b = off.get("ids") or [], on.get("ids") or []
    la, lb = off.get("logprobs") or [], on.get("logprobs") or []
    out: dict[str, Any] = {"tokens": len(a), "problems": []}
    p = out["problems"]
    if not a or len(a) != len(b):
        p.append(f"the runs produced {len(a)} and {len(b)} tokens")
        return out
    if len(la) != len(a) or len(lb) != len(b):
        p.append(f"logprobs missing: {len(la)} and {len(lb)} for {len(a)} tokens")
        return out
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    out["matched"] = k
    diffs = [abs(x - y) for x, y in zip(la[:k], lb[:k], strict=True)]
    out["max_logprob_diff"] = round(max(diffs), 5) if diffs else None
    out["mean_logprob_diff"] = round(sum(diffs) / len(diffs), 5) if diffs else None
    if k == 0:
        p.append(f"the first token (from the prefill, which the kernel does not serve) differs: {a[0]} vs {b[0]}")
    worst = max(range(len(diffs)), key=diffs.__getitem__, default=None)
    if worst is not None and diffs[worst] > LOGPROB_TOL:
        p.append(f"token {worst}: logprob {la[worst]:.4f} off vs {lb[worst]:.4f} on, more than {LOGPROB_TOL} apart")
    if 0 < k < len(a):
        top = (off.get("top2") or [])[k] if k < len(off.get("top2") or []) else []
        if len(top) < 2:
            p.append(f"token {k}: ids differ ({a[k]} vs {b[k]}) and the off run reported no top two")
        else:
            (lp1, id1), (lp2, id2) = top[0], top[1]
            margin = lp1 - lp2
            out["flip"] = {"at": k, "off": a[k], "on": b[k], "off_top2": [id1, id2], "margin": round(margin, 5)}
            if margin > TIE_TOL:
                p.append(f"token {k}: on picked {b[k]} where off's best {id1} led its runner-up by {margin:.3f} "
                         f"(> {TIE_TOL}, not a bf16 tie)")
            elif b[k] != id2:
                p.append(f"token {k}: on picked {b[k]}, neither off's best {id1} nor its runner-up {id2}")
    return out


def compare(off: dict[str, dict[str, Any]], on: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every prompt of two launches' ``outputs`` checks (prompt length -> generate's result)."""
    per = {n: compare_one(off[n], on[n]) for n in off if n in on}
    missing = sorted(set(off) ^ set(on))
    problems = [f"prompt {n}: {msg}" for n, r in per.items() for msg in r["problems"]]
    if missing:
        problems.append(f"prompts answered by one run only: {missing}")
    matched = sum(r.get("matched", 0) for r in per.values())
    diffs = [r["max_logprob_diff"] for r in per.values() if r.get("max_logprob_diff") is not None]
    return {"prompts": per, "passed": not problems, "problems": problems,
            "tokens": sum(r["tokens"] for r in per.values()), "matched": matched,
            "flips": sum(1 for r in per.values() if "flip" in r),
            "max_logprob_diff": max(diffs) if diffs else None,
            "tolerance": {"logprob": LOGPROB_TOL, "tie": TIE_TOL}}
