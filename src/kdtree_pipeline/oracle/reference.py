"""fp32 reference of the verify step, written from the math of docs/design.md section 4.

For request b with prefix length L and N drafts, keys are the L prefix latents
(``kv_buffer[kv_indices[kv_indptr[b] + i]]``) followed by the N drafts' own
latents (``k_ext[qo_indptr[b] + j]``). Draft row t sees every prefix key and
draft j iff ``custom_mask[mask_indptr[b] + t * (L + N) + L + j]`` is non-zero.

    s = (q . k) * sm_scale over all 576 dims;  p = softmax over visible keys
    out = sum p * v  (v = the first 512 dims);  lse = log(sum exp(s)) (natural log)

A row that sees no key at all gets out = 0 and lse = -inf (the kernel does the
same). Nothing here is copied from the kernel; the math runs in fp32 (TF32
off) on whatever device the inputs are on, in row chunks that bound memory.
"""

from __future__ import annotations

import torch

V_DIM = 512


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def verify_attention_ref(
    q: torch.Tensor,
    k_ext: torch.Tensor,
    kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    sm_scale: float,
    max_score_bytes: int = 1 << 29,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out [T, H, 512] fp32, lse [T, H] fp32)."""
    T, H, D = q.shape
    dev = q.device
    out = torch.zeros((T, H, V_DIM), dtype=torch.float32, device=dev)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=dev)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    mi = mask_indptr.tolist()
    pool = _rows(kv_buffer)
    ext = _rows(k_ext)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for b in range(len(qo) - 1):
            q0, q1 = qo[b], qo[b + 1]
            n = q1 - q0
            if n == 0:
                continue
            slots = kv_indices[kv[b] : kv[b + 1]].long()
            L = slots.numel()
            keys = torch.cat([pool[slots], ext[q0:q1]], 0).float()  # [L + n, 576]
            vals = keys[:, :V_DIM]
            m = custom_mask[mi[b] : mi[b] + n * (L + n)].view(n, L + n)[:, L:] != 0  # [n, n] drafts only
            visible = torch.ones((n, L + n), dtype=torch.bool, device=dev)
            visible[:, L:] = m
            # rows = (token, head) pairs of this request, in chunks of whole tokens
            tok_chunk = max(1, max_score_bytes // max(1, 4 * H * (L + n)))
            for t0 in range(0, n, tok_chunk):
                t1 = min(n, t0 + tok_chunk)
                qs = q[q0 + t0 : q0 + t1].float()  # [c, H, 576]
                s = torch.einsum("chd,kd->chk", qs, keys) * sm_scale
                s.masked_fill_(~visible[t0:t1, None, :], float("-inf"))
                lse_c = torch.logsumexp(s, dim=-1)  # [c, H]
                p = torch.exp(s - lse_c[..., None].clamp_min(torch.finfo(torch.float32).min))
                p = torch.nan_to_num(p, nan=0.0)  # rows with nothing visible
                out[q0 + t0 : q0 + t1] = torch.einsum("chk,kd->chd", p, vals)
                lse[q0 + t0 : q0 + t1] = lse_c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out, lse


def verify_attention_loop(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, parents, sm_scale):
    """An independent formulation for the oracle self-test: float64, one query
    row at a time, keys walked one by one with an online softmax, and the
    visible drafts found by walking the tree's parent pointers (not the mask).

    ``parents``: per request, a list with parents[j] < j (-1 for a root).
    """
    T, H, _ = q.shape
    out = torch.zeros((T, H, V_DIM), dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    pool = _rows(kv_buffer).double().cpu()
    ext = _rows(k_ext).double().cpu()
    qd = q.double().cpu()
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    idx = kv_indices.cpu().tolist()
    for b in range(len(qo) - 1):
        par = parents[b]
        for t in range(qo[b + 1] - qo[b]):
            ancestors = []
            j = t
            while j >= 0:
                ancestors.append(j)
                j = par[j]
            keys = [pool[idx[i]] for i in range(kv[b], kv[b + 1])] + [ext[qo[b] + j] for j in sorted(ancestors)]
            for h in range(H):
                m, s_sum = float("-inf"), 0.0
                acc = torch.zeros(V_DIM, dtype=torch.float64)
                for k in keys:
                    s = float(qd[qo[b] + t, h] @ k) * sm_scale
                    m_new = max(m, s)
                    scale = 0.0 if m == float("-inf") else torch.exp(torch.tensor(m - m_new)).item()
                    w = torch.exp(torch.tensor(s - m_new)).item()
                    acc = acc * scale + w * k[:V_DIM]
                    s_sum = s_sum * scale + w
                    m = m_new
                if s_sum > 0:
                    out[qo[b] + t, h] = acc / s_sum
                    lse[qo[b] + t, h] = m + torch.log(torch.tensor(s_sum)).item()
    return out, lse
