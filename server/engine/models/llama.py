"""One Llama-family model for Llama 2/3, Mistral, Qwen2 and Qwen3 on pagoda's paged-attention layers.

The families differ only in details that `LlamaFamilyConfig.from_hf` reads off the HF config:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, Qwen2/3 when
enabled), llama3 rope scaling, explicit head_dim, GQA and tied embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from pagoda.server.engine.attention_metadata import AttentionMetadata
from pagoda.server.engine.layers.attention import PagedAttention
from pagoda.server.engine.layers.embedding import LMHead, VocabEmbedding
from pagoda.server.engine.layers.linear import MergedLinear, RowParallelLinear
from pagoda.server.engine.layers.mlp import GatedMLP
from pagoda.server.engine.layers.norm import RMSNorm
from pagoda.server.engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pagoda.server.engine.models.native_decode import NativeDecode
from pagoda.server.engine.parallel.group import SINGLE, TensorParallel
from pagoda.server.engine.parallel.sharding import LocalShape, Slice, local_shape, slice_of
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of this step's positions


@dataclass(frozen=True)
class LlamaFamilyConfig:
    """What the model needs from an HF config, with the per-family differences made explicit."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer; None = full attention

    @classmethod
    def from_hf(cls, config: Any) -> LlamaFamilyConfig:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        num_heads = config.num_attention_heads
        num_layers = config.num_hidden_layers
        attention_bias = bool(getattr(config, "attention_bias", False))
        # Sliding window: every layer for Mistral; the layers `layer_types` marks for Qwen2/3 (whose
        # config already sets sliding_window to None unless use_sliding_window).
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        windows = tuple(
            window if window and (layer_types is None or layer_types[i] == "sliding_attention") else None
            for i in range(num_layers)
        )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope=rope_parameters(config),
            qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2: q/k/v biased, o_proj not
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=windows,
        )


class LlamaAttention(nn.Module):
    """This rank's attention heads (all of them without tensor parallelism)."""

    def __init__(self, cfg: LlamaFamilyConfig, layer_idx: int, local: LocalShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, cfg.qkv_bias
        )
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_proj_bias, local.tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            cfg.head_dim,
            scale=cfg.head_dim**-0.5,
            sliding_window=cfg.sliding_windows[layer_idx],
        )

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.stacked(hidden).view(-1, heads + 2 * kv_heads, head_dim)
        v = qkv[:, heads + kv_heads :]
        if self.qk_norm:
            q = apply_rotary(self.q_norm(qkv[:, :heads]), *rope)
            k = apply_rotary(self.k_norm(qkv[:, heads : heads + kv_heads]), *rope)
        else:  # q and k rotate as one tensor: one set of rotary ops per layer, not two
            qk = apply_rotary(qkv[:, : heads + kv_heads], *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.attn(q, k, v, attn_metadata, kv_cache)
        return self.o_proj(out.flatten(1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, layer_idx: int, local: LocalShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, local)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, local.intermediate_size, cfg.mlp_bias, local.tp)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each residual add is fused into
        the norm after it, the last one into the model's final norm."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, attn_metadata, kv_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaFamilyConfig, local: LocalShape) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, local.tp)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, local) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.native_decode = NativeDecode(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if hidden.dtype != self.norm.weight.dtype:  # a table kept in bf16: widened
            hidden = hidden.to(self.norm.weight.dtype)
        native = self.native_decode(hidden, positions, attn_metadata, kv_caches)  # CPU decode steps
        if native is not None:
            return native
        rope = self.rotary_emb(positions, hidden.dtype)  # once per step, shared by every layer
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, attn_metadata, kv_cache)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """`forward` gives final hidden states for the packed step; `compute_logits` the logits (model dtype).

    With `tp` of size N the instance is one rank's shard (`parallel/sharding.py`): `num_kv_heads` is
    this rank's, and every rank must run each forward and `compute_logits` together (collectives).
    """

    def __init__(self, hf_config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.cfg = LlamaFamilyConfig.from_hf(hf_config)
        self.local = local_shape(self.cfg, tp)
        self.num_layers = self.cfg.num_layers
        self.num_kv_heads = self.local.num_kv_heads
        self.head_dim = self.cfg.head_dim
        self.model = LlamaModel(self.cfg, self.local)
        tied = self.model.embed_tokens if self.cfg.tie_word_embeddings else None
        self.lm_head = LMHead(self.cfg.vocab_size, self.cfg.hidden_size, tied_to=tied, tp=tp)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the weights may be stored narrower: `layers/bf16_storage.py`)."""
        return self.model.norm.weight.dtype

    @property
    def vocab_size(self) -> int:
        """The embedding rows (over every tensor-parallel rank): every token id the model can index is
        below this."""
        return self.cfg.vocab_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, attn_metadata, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def shard_slice(self, hf_name: str) -> Slice | None:
        """The slice of checkpoint tensor `hf_name` this rank holds (None: all of it)."""
        return slice_of(hf_name, self.cfg, self.local)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to each parameter's dtype); every parameter must be set.
        Under tensor parallelism each tensor is already this rank's `shard_slice` of the checkpoint's."""
        targets = self.checkpoint_targets()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb." in hf_name:
                continue  # recomputed from the config
            if hf_name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if hf_name not in targets:
                raise ValueError(f"unexpected checkpoint tensor {hf_name!r}")
            target = targets[hf_name]
            if self.local.tp.size > 1 and hf_name.endswith(("embed_tokens.weight", "lm_head.weight")):
                target[tensor.shape[0] :].zero_()  # the last rank's vocab padding rows
                target = target[: tensor.shape[0]]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(hf_name)
        missing = sorted(targets.keys() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter data (or slice of a fused one) it loads into."""
        targets: dict[str, torch.Tensor] = {}
        for module_name, module in self.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for kind, param in module.named_parameters(recurse=False):
                if isinstance(module, MergedLinear):
                    parent = module_name.rpartition(".")[0]
                    for shard in module.shard_sizes:
                        targets[f"{parent}.{shard}.{kind}"] = param.data[module.shard_rows(shard)]
                elif not (module is self.lm_head and self.cfg.tie_word_embeddings):
                    targets[prefix + kind] = param.data
        return targets


def hf_tensor_names(num_layers: int) -> list[str]:
    """Every HF tensor name a Llama-family checkpoint of `num_layers` layers can hold (a superset:
    biases and q/k norms exist only in some families)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")),
        *(f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")),
    ]
    for i in range(num_layers):
        names += [f"model.layers.{i}.{name}" for name in per_layer]
    return names


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
