"""Small reference models and synthetic data for the demo, the benchmarks and the tests.

Example:
    >>> model = GPT(GPTConfig(d_model=64, n_layers=1, block_size=16))
    >>> idx, targets = make_batch("gpt", 2, vocab=1000, block_size=16)
    >>> model(idx, targets).shape
    torch.Size([])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ortlab.errors import ConfigError

__all__ = ["GPT", "GPTConfig", "MLP", "TinyMLP", "make_batch"]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab: Number of token ids.
        d_model: Width of the residual stream; must be divisible by ``n_heads``.
        n_heads: Attention heads per block.
        n_layers: Number of transformer blocks.
        block_size: Longest sequence the position embedding covers.
        dropout: Dropout probability for attention weights and residual branches.
    """

    vocab: int = 1000
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    block_size: int = 128
    dropout: float = 0.0


class _Block(nn.Module):
    """Pre-LN transformer block: causal self-attention then a 4x GELU MLP, each residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A small decoder-only transformer (token + position embeddings, pre-LN blocks, LM head).

    Example:
        >>> logits = GPT()(torch.zeros(2, 8, dtype=torch.long))
        >>> logits.shape
        torch.Size([2, 8, 1000])
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or GPTConfig()
        if cfg.d_model % cfg.n_heads:
            raise ConfigError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        for m in self.modules():  # GPT-2 style init, so the first loss is close to ln(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits ``(B, T, vocab)``, or the scalar cross-entropy loss when ``targets`` is given."""
        T = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(nn.Module):
    """A ReLU multi-layer perceptron classifier.

    Args:
        sizes: Layer widths from the input features to the number of classes.

    Example:
        >>> MLP((8, 16, 3))(torch.randn(4, 8)).shape
        torch.Size([4, 3])
    """

    def __init__(self, sizes: tuple[int, ...] = (784, 1024, 1024, 10)) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ConfigError(f"sizes needs at least an input and an output width, got {sizes}")
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            layers += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits, or the scalar cross-entropy loss when labels ``y`` are given."""
        logits = self.net(x)
        return logits if y is None else F.cross_entropy(logits, y)


class TinyMLP(MLP):
    """The smallest model: Linear(64, 128), ReLU, Linear(128, 10)."""

    def __init__(self) -> None:
        super().__init__((64, 128, 10))


_MLP_SHAPES = {"mlp": (784, 10), "tiny": (64, 10)}


@functools.lru_cache(maxsize=None)
def _teacher(in_features: int, num_classes: int) -> torch.Tensor:
    """A fixed random linear map whose argmax labels the MLP data (the same for every call)."""
    return torch.randn(in_features, num_classes, generator=torch.Generator().manual_seed(1234))


def make_batch(
    kind: str,
    batch: int,
    generator: torch.Generator | None = None,
    *,
    vocab: int = 1000,
    block_size: int = 128,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate one synthetic, learnable batch for a reference model.

    For ``"gpt"`` each row follows ``next = (token * 7 + 3) % vocab`` from a random start token, so a
    model that learns the rule drives the loss towards zero. For ``"mlp"`` and ``"tiny"`` the inputs
    are standard normal and the labels come from a fixed random linear teacher.

    Args:
        kind: One of ``"gpt"``, ``"mlp"``, ``"tiny"``.
        batch: Number of rows.
        generator: Random generator for reproducible batches; the global one when None.
        vocab: Vocabulary size (``"gpt"`` only).
        block_size: Sequence length (``"gpt"`` only).
        device: Where to put the returned tensors.

    Returns:
        ``(idx, targets)`` of shape ``(batch, block_size)`` for ``"gpt"``, else ``(x, labels)``.

    Example:
        >>> x, y = make_batch("tiny", 16, torch.Generator().manual_seed(0))
        >>> x.shape, y.shape
        (torch.Size([16, 64]), torch.Size([16]))
    """
    if kind == "gpt":
        idx = torch.empty(batch, block_size, dtype=torch.long)
        idx[:, 0] = torch.randint(vocab, (batch,), generator=generator)
        for t in range(1, block_size):
            idx[:, t] = (idx[:, t - 1] * 7 + 3) % vocab
        return idx.to(device), ((idx * 7 + 3) % vocab).to(device)
    if kind not in _MLP_SHAPES:
        raise ConfigError(f"unknown batch kind {kind!r}; expected one of 'gpt', {', '.join(map(repr, _MLP_SHAPES))}")
    x = torch.randn(batch, _MLP_SHAPES[kind][0], generator=generator)
    return x.to(device), (x @ _teacher(*_MLP_SHAPES[kind])).argmax(dim=1).to(device)
