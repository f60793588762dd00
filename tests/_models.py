"""Small deterministic test models shared by the test modules (not a test module).

Every constructor takes a `seed` and initialises its parameters under a forked RNG, so building
a model neither depends on nor disturbs the global RNG state: the same arguments always give
bit-identical parameters. Models are float32 on CPU; use `.to(dtype)` for other dtypes.

Site names (the fp8fn call sites) are given in each class docstring.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


def tiny_hf_config(kind: str, **fields):
    """A tiny HF causal-LM config: 2 layers, 2 heads, hidden 32, vocab 64, 32 positions.

    Args:
      kind: `"llama"`, `"mistral"` (2 key-value heads, MLP width 64) or `"gpt2"` (token id 0 as
        BOS and EOS; its dropouts at their defaults).
      **fields: config fields that replace or add to these.

    Skips the calling test where transformers is not installed.
    """
    import pytest

    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        base = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                    bos_token_id=0, eos_token_id=0)  # fmt: skip
        return transformers.GPT2Config(**{**base, **fields})
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, intermediate_size=64,
                max_position_embeddings=32)  # fmt: skip
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    return config_cls(**{**base, **fields})


@contextlib.contextmanager
def _seeded(seed: int):
    """Run the body with the CPU RNG seeded with `seed`, restoring the global RNG after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class MLP(nn.Module):
    """`Linear -> ReLU -> ... -> Linear` over `sizes`; sites `layers.0`, `layers.1`, ...

    Args:
      sizes: feature sizes, e.g. `(16, 32, 8)` for two layers 16 -> 32 -> 8.
      bias: whether the layers have a bias.
      seed: initialisation seed.

    Input `(..., sizes[0])`, output `(..., sizes[-1])`, same dtype as the parameters.
    """

    def __init__(self, sizes, bias: bool = True, seed: int = 0):
        super().__init__()
        with _seeded(seed):
            self.layers = nn.ModuleList(
                nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:])
            )

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then a GELU MLP.

    Sites (relative to the block): `qkv`, `out` (attention projections), `fc1`, `fc2`.
    Input and output `(batch, seq, d_model)`.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        h = F.gelu(self.fc1(self.ln2(x)))
        h = F.dropout(h, self.dropout, self.training)
        return x + self.fc2(h)


class Transformer(nn.Module):
    """A tiny GPT: token + position embeddings, `n_blocks` `Block`s, final LayerNorm, head.

    Sites: `blocks.{i}.qkv`, `blocks.{i}.out`, `blocks.{i}.fc1`, `blocks.{i}.fc2`, `head`.

    Args:
      vocab: vocabulary size.
      d_model: model width (a multiple of `n_heads`).
      n_heads: attention heads.
      n_blocks: number of blocks.
      seq: maximum sequence length.
      dropout: dropout probability after the MLP activation (active in training mode only).
      torch_checkpoint: None, or `"reentrant"` / `"non_reentrant"` to run each block under
        `torch.utils.checkpoint` with that `use_reentrant` mode (a model that checkpoints
        itself; fp8fn refuses it).
      seed: initialisation seed.

    Input token ids `(batch, t)` int64 with `t <= seq`; output logits `(batch, t, vocab)`.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        n_heads: int,
        n_blocks: int,
        seq: int,
        dropout: float = 0.0,
        torch_checkpoint: str | None = None,
        seed: int = 0,
    ):
        super().__init__()
        if torch_checkpoint not in (None, "reentrant", "non_reentrant"):
            raise ValueError(f"unknown torch_checkpoint {torch_checkpoint!r}")
        self.torch_checkpoint = torch_checkpoint
        with _seeded(seed):
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq, d_model)
            self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_blocks))
            self.ln = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.torch_checkpoint is None:
                x = block(x)
            else:
                reentrant = self.torch_checkpoint == "reentrant"
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        return self.head(self.ln(x))


class ReusedLayer(nn.Module):
    """One nn.Linear called twice: `out(relu(fc(relu(fc(x)))))`.

    Sites: `fc`, `fc#1` (its second call), `out`. Input `(..., d)`, output `(..., d_out)`.
    """

    def __init__(self, d: int, d_out: int | None = None, seed: int = 0):
        super().__init__()
        with _seeded(seed):
            self.fc = nn.Linear(d, d)
            self.out = nn.Linear(d, d_out or d)

    def forward(self, x):
        x = F.relu(self.fc(x))
        x = F.relu(self.fc(x))
        return self.out(x)


class Branchy(nn.Module):
    """A conditional branch on a python flag: `fc2(relu(extra(relu(fc1(x)))))` if `use_extra`.

    Sites: `fc1`, `extra` (only called when `use_extra=True`), `fc2`.
    `forward(x, use_extra=False)`: input `(..., d)`, output `(..., d)`.
    """

    def __init__(self, d: int, seed: int = 0):
        super().__init__()
        with _seeded(seed):
            self.fc1 = nn.Linear(d, d)
            self.extra = nn.Linear(d, d)
            self.fc2 = nn.Linear(d, d)

    def forward(self, x, use_extra: bool = False):
        x = F.relu(self.fc1(x))
        if use_extra:
            x = F.relu(self.extra(x))
        return self.fc2(x)


class Tied(nn.Module):
    """Tied weights: `a` and `b` share one weight; the head is tied to the embedding.

    `head(relu(b(relu(a(emb(idx))))))` with `b.weight is a.weight` and
    `head.weight is emb.weight`. Sites: `a`, `b`, `head`.
    Input token ids `(...)` int64, output logits `(..., vocab)`.
    """

    def __init__(self, vocab: int, d: int, seed: int = 0):
        super().__init__()
        with _seeded(seed):
            self.emb = nn.Embedding(vocab, d)
            self.a = nn.Linear(d, d)
            self.b = nn.Linear(d, d)
            self.head = nn.Linear(d, vocab, bias=False)
        self.b.weight = self.a.weight
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = F.relu(self.a(self.emb(idx)))
        x = F.relu(self.b(x))
        return self.head(x)
