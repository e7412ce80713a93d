"""The live smoke's model: a DeepSeek-V3-architecture checkpoint with one tensor-parallel rank
of Kimi K2.6 at TP8 in every layer, written from a seed (no weights are downloaded).

Per layer (one TP8 rank of Kimi K2.6): hidden 7168, 8 query heads (64 / 8), q_lora 1536,
kv_lora 512, rope 64, nope 128, v 128, so the verify step's attention is the production
shape (q [T, 8, 576] over a 576-wide latent pool). A few main layers, all dense (the dense
MLP of one rank: 18432 / 8 = 2304), and one MTP (NextN) layer, which SGLang always builds as
a mixture of experts (``DeepseekV2DecoderLayer`` with ``is_nextn``): 8 small experts keep it
light. ``--speculative-algorithm EAGLE`` drafts with that layer.

Why generated weights and not ``--load-format dummy``: SGLang's dummy loader gives every
float parameter, RMSNorm weights included, uniform(-1e-3, 1e-3) from one seed, so what
attention adds to the residual stream is about 1e-4 of the embedding, under bf16's
resolution: the greedy token then depends on the last token alone, and no attention kernel,
right or wrong, could change an output. Here matrices are N(0, 0.02) (the lm head 0.05),
norms 1 and the router's correction bias 0: attention logits have a standard deviation
around 1.6 and attention moves the logits, so kernel on vs off is a real comparison.

The tensor names are the ones SGLang's DeepSeek loader reads: the NextN layer is stored at
``model.layers.{L}`` (L = the main layers' count; SGLang reads ``model.layers.0`` when L is
1, so L must be at least 2) without its own embedding and head, which the draft worker
shares from the target model.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: What the checkpoint's files are named after; the stamp says which config and seed wrote them.
STAMP = "kdtree-model.json"


@dataclass(frozen=True)
class ModelSpec:
    """What the checkpoint is: its layers and the few sizes that are not Kimi K2.6's."""

    layers: int = 4
    heads: int = 8  # Kimi K2.6's 64 query heads over TP8
    hidden_size: int = 7168
    intermediate_size: int = 18432 // 8  # the dense MLP of one TP8 rank
    vocab_size: int = 163840
    max_position_embeddings: int = 262144
    experts: int = 8  # the MTP layer's routed experts (Kimi K2.6 has 384; 8 keep it small)
    experts_per_token: int = 2
    moe_intermediate_size: int = 256  # one TP8 rank of Kimi K2.6's 2048
    seed: int = 0
    std: float = 0.02
    lm_head_std: float = 0.05

    def __post_init__(self) -> None:
        if self.layers < 2:
            raise ValueError(f"layers: expected at least 2 (SGLang reads the MTP layer of a 1-layer "
                             f"model from model.layers.0, where layer 0 is), got {self.layers}")
        if self.heads < 1 or self.heads > 128:
            raise ValueError(f"heads: expected 1..128 query heads, got {self.heads}")


def config(spec: ModelSpec) -> dict[str, Any]:
    """The HuggingFace ``config.json`` of ``spec`` (DeepseekV3ForCausalLM, one MTP layer)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": spec.std,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        # Kimi K2.6's RoPE: theta 50000, yarn x64 over 4096 positions
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 64.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        # every main layer dense; the MoE fields are the MTP layer's (SGLang builds it as MoE)
        "first_k_dense_replace": spec.layers,
        "moe_layer_freq": 1,
        "n_routed_experts": spec.experts,
        "num_experts_per_tok": spec.experts_per_token,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,
    }


def tensors(spec: ModelSpec) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, init, std) of every tensor, init one of normal / ones / zeros; all bf16 but
    the router's fp32 correction bias."""
    c = config(spec)
    D, V, L, H = spec.hidden_size, spec.vocab_size, spec.layers, spec.heads
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    std = spec.std
    out = [("model.embed_tokens.weight", (V, D), "normal", std),
           ("lm_head.weight", (V, D), "normal", spec.lm_head_std),
           ("model.norm.weight", (D,), "ones", 0.0)]

    def attention(p: str) -> list[tuple[str, tuple[int, ...], str, float]]:
        return [(f"{p}.input_layernorm.weight", (D,), "ones", 0.0),
                (f"{p}.post_attention_layernorm.weight", (D,), "ones", 0.0),
                (f"{p}.self_attn.q_a_proj.weight", (c["q_lora_rank"], D), "normal", std),
                (f"{p}.self_attn.q_a_layernorm.weight", (c["q_lora_rank"],), "ones", 0.0),
                (f"{p}.self_attn.q_b_proj.weight", (H * qk, c["q_lora_rank"]), "normal", std),
                (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], D),
                 "normal", std),
                (f"{p}.self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],), "ones", 0.0),
                (f"{p}.self_attn.kv_b_proj.weight", (H * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                                     c["kv_lora_rank"]), "normal", std),
                (f"{p}.self_attn.o_proj.weight", (D, H * c["v_head_dim"]), "normal", std)]

    def mlp(p: str, inter: int) -> list[tuple[str, tuple[int, ...], str, float]]:
        return [(f"{p}.gate_proj.weight", (inter, D), "normal", std),
                (f"{p}.up_proj.weight", (inter, D), "normal", std),
                (f"{p}.down_proj.weight", (D, inter), "normal", std)]

    for layer in range(L):
        out += attention(f"model.layers.{layer}") + mlp(f"model.layers.{layer}.mlp", spec.intermediate_size)
    p = f"model.layers.{L}"  # the MTP layer
    out += [(f"{p}.enorm.weight", (D,), "ones", 0.0), (f"{p}.hnorm.weight", (D,), "ones", 0.0),
            (f"{p}.shared_head.norm.weight", (D,), "ones", 0.0), (f"{p}.eh_proj.weight", (D, 2 * D), "normal", std)]
    out += attention(p)
    out += [(f"{p}.mlp.gate.weight", (spec.experts, D), "normal", std),
            (f"{p}.mlp.gate.e_score_correction_bias", (spec.experts,), "zeros", 0.0)]
    for e in range(spec.experts):
        out += mlp(f"{p}.mlp.experts.{e}", spec.moe_intermediate_size)
    out += mlp(f"{p}.mlp.shared_experts", spec.moe_intermediate_size)
    return out


def nbytes(spec: ModelSpec) -> int:
    """The checkpoint's size in bytes (bf16, the correction bias fp32)."""
    total = 0
    for name, shape, _, _ in tensors(spec):
        n = 1
        for s in shape:
            n *= s
        total += n * (4 if name.endswith("e_score_correction_bias") else 2)
    return total


def _seed(seed: int, name: str) -> int:
    """One seed per tensor name: a tensor's values do not depend on the order of writing."""
    return (seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)) % (2**63)


def stamp(spec: ModelSpec) -> dict[str, Any]:
    return {"spec": asdict(spec), "config_sha256": hashlib.sha256(
        json.dumps(config(spec), sort_keys=True).encode()).hexdigest()}


def write(out_dir: Path, spec: ModelSpec, *, device: str | None = None,
          shard_bytes: int = 4 << 30) -> dict[str, Any]:
    """Write ``config.json``, the safetensors shards and their index into ``out_dir``; a folder
    whose stamp matches ``spec`` is kept as it is. Returns what was written and how long it took."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    want = stamp(spec)
    stamp_file = out_dir / STAMP
    if stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == want:
                return {"dir": str(out_dir), "written": False, "bytes": nbytes(spec), "seconds": 0.0}
        except ValueError:
            pass
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)  # a half-written folder is never taken as done
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    (out_dir / "config.json").write_text(json.dumps(config(spec), indent=1) + "\n")
    specs = tensors(spec)
    shards: list[list[tuple[str, tuple[int, ...], str, float]]] = [[]]
    size = 0
    for t in specs:
        n = 2
        for s in t[1]:
            n *= s
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    weight_map = {}
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name, shape, init, std in group:
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            if init == "ones":
                t = torch.ones(shape, dtype=dtype, device=device)
            elif init == "zeros":
                t = torch.zeros(shape, dtype=dtype, device=device)
            else:
                g = torch.Generator(device=device)
                g.manual_seed(_seed(spec.seed, name))
                t = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(std).to(dtype)
            out[name] = t.cpu().contiguous()
            weight_map[name] = fname
        save_file(out, str(out_dir / fname), metadata={"format": "pt"})
        del out
    if device != "cpu":
        torch.cuda.empty_cache()  # the servers this process starts get the memory back
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes(spec)}, "weight_map": weight_map}, indent=1) + "\n")
    stamp_file.write_text(json.dumps(want, indent=1) + "\n")
    return {"dir": str(out_dir), "written": True, "bytes": nbytes(spec), "shards": len(shards),
            "seconds": round(time.monotonic() - t0, 1), "device": device}
