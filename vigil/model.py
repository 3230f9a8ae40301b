"""A GPT-style byte-level language model, readable top to bottom (after karpathy/nanoGPT ``model.py``).

The vocabulary is the 256 byte values, so there is no tokenizer to ship or download: any text on
any machine is already tokenized. The model is the usual pre-norm decoder-only transformer:

    bytes -> token embedding + learned position embedding
          -> n_layer x [LayerNorm -> causal self-attention -> residual,
                        LayerNorm -> MLP (4x, GELU)         -> residual]
          -> LayerNorm -> linear head tied to the token embedding -> logits over 256 bytes

Everything the optimizers and the communication layer see is ``model.parameters()``; nothing here
knows about ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vigil.contract.schemas import ModelSpec

VOCAB_SIZE = 256
"""One token per byte value."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. Build it from a job spec with :meth:`from_spec`."""

    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 2
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Embedding width (the residual stream)."""
    context: int = 64
    """Longest sequence the model accepts (size of the position embedding)."""
    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings; 0 for deterministic runs."""
    vocab_size: int = VOCAB_SIZE
    """Bytes: 256."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 style)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> GPTConfig:
        return cls(
            n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model, context=spec.context, dropout=spec.dropout
        )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # One matmul produces q, k and v for all heads: fewer, larger kernels.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim): SDPA attends over the last two dims per head.
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        # is_causal applies the lower-triangular mask inside the fused kernel; no mask buffer needed.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward block, 4x wide as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: normalising before each branch keeps the residual stream clean,
    which trains stably without warmup tricks at this size."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT. ``forward(idx, targets)`` returns ``(logits, loss)``; loss is None without targets."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Weight tying: the input embedding and the output head share one matrix. It saves
        # parameters (and bytes on the wire for every optimizer) and helps small models.
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small normal weights, zero biases: logits start near zero, so the loss at init is
        # close to ln(256), the loss of a uniform guess; a far higher start means a broken init.
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied embedding/head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: (B, T) int64 bytes with T <= context. Loss is the mean next-byte cross-entropy."""
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(spec: ModelSpec) -> GPT:
    """The model a job spec describes, freshly initialised from torch's current RNG state."""
    return GPT(GPTConfig.from_spec(spec))
