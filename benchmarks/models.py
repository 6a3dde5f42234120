"""A Llama-like target model and an EAGLE-style draft model, in plain PyTorch, for the benchmarks.

The point is to look to a dumper exactly like a served model does:
  * module names as in Hugging Face / SGLang checkpoints (``model.embed_tokens``,
    ``model.layers.3.self_attn.q_proj``, ``model.norm``, ``lm_head``; the draft has ``model.fc``
    and ``model.layers.0...``), so dumps can be compared name by name;
  * a real, preallocated KV cache written in place, attention over the cached prefix, and rollback
    by resetting the cache length (speculative decoding);
  * a *fused, in-place* add+RMSNorm like vLLM/SGLang's ``fused_add_rms_norm``: it overwrites the
    residual stream and the normalized input buffer in place, i.e. it rewrites tensors that earlier
    hooks already saw (the embedding output, every ``o_proj``/``down_proj`` output). A dumper that
    does not snapshot at hook time records wrong values;
  * tuple outputs (rotary embedding, fused norm) like real engines;
  * the draft shares the target's embedding and LM head *module objects*, so hooks on those
    modules fire in both roles' passes.

Weights are random (seeded). The same code runs on CPU and CUDA; device and dtype are arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# Shapes and presets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Preset:
    """A model shape plus the decode-run defaults that make sense for it."""

    model: ModelConfig
    device: str
    dtype: str
    batch_size: int
    prompt_len: int
    rounds: int
    k: int
    reps: int
    # "speculative": EAGLE-style rounds (draft and target); "decode": the target alone, one token
    # per step, `rounds` steps.
    loop: str = "speculative"
    threads: int | None = None  # torch intra-op threads (None: torch's choice)


PRESETS: dict[str, Preset] = {
    # Seconds on 2 CPU cores, for smoke tests: every code path, no realism.
    "tiny": Preset(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    vocab_size=256, max_seq_len=128),
        device="cpu", dtype="fp32", batch_size=2, prompt_len=8, rounds=3, k=3, reps=2),
    # A decode step that is realistic for a CPU: ~120M parameters, 8 layers, GQA.
    "small": Preset(
        ModelConfig(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816,
                    vocab_size=32000, max_seq_len=512),
        device="cpu", dtype="fp32", batch_size=4, prompt_len=64, rounds=6, k=4, reps=8),
    # Issue 11's small CPU decode loop: so little compute per tensor (~30 us) that fastdump's
    # per-tensor cost shows. Target alone, one token per step, one torch thread.
    "micro": Preset(
        ModelConfig(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=4, intermediate_size=688,
                    vocab_size=1024, max_seq_len=512),
        device="cpu", dtype="fp32", batch_size=4, prompt_len=8, rounds=300, k=0, reps=7, loop="decode",
        threads=1),
    # Llama-3-8B shapes (bf16 on a GPU). Batch 1 and few rounds: one verify pass already dumps
    # ~25 MB of activations, and the dumps must fit the device machine's disk across all modes.
    "8b": Preset(
        ModelConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                    vocab_size=128256, max_seq_len=1024),
        device="cuda", dtype="bf16", batch_size=1, prompt_len=256, rounds=8, k=4, reps=3),
}


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


class KVCache:
    """Preallocated per-layer K/V tensors ``[batch, kv_heads, max_seq, head_dim]``.

    ``length`` is the number of positions that hold valid entries. A forward pass writes its new
    keys/values at ``[length, length + T)`` in place and then advances ``length``; speculative
    rollback is just ``cache.length = n`` (stale entries past ``length`` are never read).
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, device, dtype):
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.length = 0

    def reset(self) -> None:
        self.length = 0


# --------------------------------------------------------------------------------------------
# Leaf modules (the ones a dumper hooks)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual`` given it is the fused, in-place add+norm of serving engines.

    ``norm(x)`` returns a new tensor. ``norm(x, residual)`` does ``residual += x`` and writes
    ``rmsnorm(residual)`` into ``x``'s own storage, returning ``(x, residual)``: no allocation,
    and both inputs (outputs of earlier hooked modules) are modified after their hooks ran.
    """

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # statistics in fp32 even for bf16 models, as engines do
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._normalize(x)
        residual.add_(x)
        x.copy_(self._normalize(residual))
        return x, residual


class RotaryEmbedding(nn.Module):
    """Applies rotary position embedding to (q, k); returns the rotated pair (a tuple output)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        super().__init__()
        # Plain attributes, not buffers: the tables are shared by every layer and both models,
        # and are not weights.
        self.cos_table = cos
        self.sin_table = sin

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos_table[positions]  # [T, head_dim], broadcast over batch and heads
        sin = self.sin_table[positions]
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


def rotary_tables(config: ModelConfig, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


class CachedAttention(nn.Module):
    """The attention kernel with its KV cache (SGLang's ``RadixAttention`` leaf, simplified).

    Writes this pass's keys/values into the preallocated cache in place, then attends over the
    whole cached prefix with a causal mask offset by the cache length. GQA via ``enable_gqa``.
    """

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # q: [B, H, T, D]; k, v: [B, KVH, T, D]
        start, num_new = cache.length, q.shape[2]
        end = start + num_new
        cache.keys[self.layer_idx][:, :, start:end].copy_(k)
        cache.values[self.layer_idx][:, :, start:end].copy_(v)
        keys = cache.keys[self.layer_idx][:, :, :end]
        values = cache.values[self.layer_idx][:, :, :end]
        mask = None
        if num_new > 1:  # new token i (position start+i) sees cached positions <= start+i
            mask = torch.ones(num_new, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        batch, heads, _, head_dim = out.shape
        return out.transpose(1, 2).reshape(batch, num_new, heads * head_dim)


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.rotary_emb = RotaryEmbedding(*rotary)
        self.attn = CachedAttention(layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        batch, num_new, _ = hidden.shape
        q = self.q_proj(hidden).view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(batch, num_new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotary_emb(q, k, positions)
        return self.o_proj(self.attn(q, k, v, cache))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, cache):
        # Same residual handling as SGLang's LlamaDecoderLayer: the first layer adopts its input
        # as the residual stream (so the fused norms later overwrite the embedding output).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# --------------------------------------------------------------------------------------------
# Target and draft
# --------------------------------------------------------------------------------------------


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, cache):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, cache)
        hidden, residual = self.norm(hidden, residual)
        cache.length += input_ids.shape[1]
        return hidden, residual  # (normed for the LM head, pre-norm feature for the draft)


class LlamaForCausalLM(nn.Module):
    """The target. ``forward(input_ids, last_only)`` -> ``(logits, hidden)``, where ``hidden`` is the
    pre-norm last-layer feature EAGLE feeds to the draft. Uses and advances ``self.kv_cache``."""

    def __init__(self, config: ModelConfig, rotary):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, input_ids: torch.Tensor, last_only: bool = False):
        positions = _positions(self.kv_cache, input_ids)
        normed, hidden = self.model(input_ids, positions, self.kv_cache)
        if last_only:  # prefill/extend only need the next token, like a logits processor
            normed = normed[:, -1:]
        return self.lm_head(normed), hidden


class EagleDraftModel(nn.Module):
    """EAGLE-style draft: ``fc(concat(embed(token), feature)) -> 1 decoder layer -> norm -> lm_head``.

    ``model.embed_tokens`` and ``lm_head`` are the target's module objects (not copies).
    ``forward(input_ids, features, last_only)`` -> ``(logits, hidden)``.
    """

    def __init__(self, config: ModelConfig, rotary):
        super().__init__()
        self.config = config
        self.model = _EagleInner(config, rotary)
        self.register_module("lm_head", None)  # the target's, set by share_embed_and_head()
        self.kv_cache: KVCache | None = None

    def share_embed_and_head(self, target: LlamaForCausalLM) -> None:
        self.model.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, last_only: bool = False):
        positions = _positions(self.kv_cache, input_ids)
        normed, hidden = self.model(input_ids, features, positions, self.kv_cache)
        if last_only:
            normed = normed[:, -1:]
        return self.lm_head(normed), hidden


class _EagleInner(nn.Module):
    def __init__(self, config: ModelConfig, rotary):
        super().__init__()
        # A named slot now (so it is listed first, as in a checkpoint); the target's module later.
        self.register_module("embed_tokens", None)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, 0, rotary)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, features, positions, cache):
        embeds = self.embed_tokens(input_ids)
        hidden, residual = self.fc(torch.cat((embeds, features), dim=-1)), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, cache)
        hidden, residual = self.norm(hidden, residual)
        cache.length += input_ids.shape[1]
        return hidden, residual


def _positions(cache: KVCache | None, input_ids: torch.Tensor) -> torch.Tensor:
    if cache is None:
        raise RuntimeError("call allocate_kv_caches() before running the model")
    start, num_new = cache.length, input_ids.shape[1]
    if start + num_new > cache.max_seq_len:
        raise RuntimeError(f"KV cache overflow: {start}+{num_new} > max_seq_len {cache.max_seq_len}")
    return torch.arange(start, start + num_new, device=input_ids.device)


# --------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------


def _init_weights_(module: nn.Module, generator: torch.Generator) -> None:
    """Seeded random init, in a fixed (name) order so every run gets the same model."""
    for name, param in sorted(module.named_parameters(remove_duplicate=True)):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            # Random-ish gains around 1 so norms are not a no-op, without blowing up activations.
            param.normal_(1.0, 0.1, generator=generator)
        else:
            fan_in = param.shape[-1] if param.dim() > 1 and "embed" not in name else 1
            std = 1.0 if fan_in == 1 else 1.0 / math.sqrt(fan_in)
            param.normal_(0.0, std, generator=generator)


def _materialize(module: nn.Module, device, dtype) -> nn.Module:
    """Modules are built on the meta device (no default init: 8B parameters would take minutes on
    a CPU), then given real, uninitialized storage on ``device``."""
    return module.to(dtype=dtype).to_empty(device=device)  # dtype first: free on meta


@torch.no_grad()
def build_models(config: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0,
                 with_draft: bool = True):
    """Return ``(target, draft)`` in eval mode; ``draft`` is None when ``with_draft`` is False."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    rotary = rotary_tables(config, device, dtype)
    with torch.device("meta"):
        target = LlamaForCausalLM(config, rotary=(None, None))
        draft = EagleDraftModel(config, rotary=(None, None)) if with_draft else None
    # Rotary tables are real tensors shared by all layers; they must not go through the meta device.
    _materialize(target, device, dtype)
    _set_rotary(target, rotary)
    _init_weights_(target, generator)
    if draft is not None:
        _materialize(draft, device, dtype)
        _set_rotary(draft, rotary)
        _init_weights_(draft, generator)
        draft.share_embed_and_head(target)  # after init: the shared modules keep the target's weights
        draft.eval()
    return target.eval(), draft


def _set_rotary(model: nn.Module, rotary) -> None:
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos_table, module.sin_table = rotary


def allocate_kv_caches(models, batch_size: int, max_seq_len: int | None = None) -> None:
    """Give each model (target or draft) its own preallocated cache."""
    for model in models:
        if model is None:
            continue
        config = model.config
        param = next(model.parameters())
        model.kv_cache = KVCache(len(model.model.layers), batch_size, config.num_kv_heads,
                                 max_seq_len or config.max_seq_len, config.head_dim,
                                 param.device, param.dtype)


def preset_with_overrides(name: str, **overrides) -> Preset:
    """``PRESETS[name]`` with any non-None run setting replaced (batch_size=..., rounds=...)."""
    preset = PRESETS[name]
    return replace(preset, **{k: v for k, v in overrides.items() if v is not None})
