"""GPT-2 (nanoGPT layout: transformer.{wte,wpe,h,ln_f}, lm_head), the model of
scripts/train_gpt2.py (:mod:`tagc.train.loop`), the benchmarks and the tests.

Module names matter to TAGC's default selection: the attention QKV projection is
``attn.c_attn`` (never compressed), the output projection ``attn.c_proj`` and the MLP's
``mlp.c_fc``/``mlp.c_proj`` are compressed, as is the token embedding (tied with the
LM head, so it stays in the root unit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """GPT-2 architecture.

    Attributes:
        block_size: context length.
        vocab_size: embedding rows (pad the tokenizer's vocabulary to a multiple of 64).
        n_layer, n_head, n_embd: depth, heads, width.
        dropout: dropout probability (0 keeps runs deterministic).
        bias: biases in Linear and LayerNorm layers, as GPT-2.
        tie_weights: share the token embedding with the LM head, as GPT-2 (124M). The
            paper's ~162M model matches GPT-2 small with an untied head.
        subspace_k: 0, or Protocol Models' subspace dimension (arXiv 2506.01260;
            :class:`tagc.pipeline.Subspace`): the first ``subspace_layers`` blocks
            write their attention and MLP outputs only into a fixed k-dimensional
            subspace ``U`` (``c_proj`` maps to k coefficients, ``U`` to the width),
            the token and position embeddings are frozen random tables plus trainable
            ones inside ``U``, and the residual stream up to there is kept as
            ``x0(tokens) + U c``: a pipeline boundary there sends ``c`` and the ids.
        subspace_layers: how many leading blocks are constrained (a pipeline's stages
            before the last boundary; the last stage's blocks write the full width).
        subspace_seed: seed of ``U`` and of the frozen tables (the same on every rank).
        subspace_std: standard deviation of the frozen tables.
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    subspace_k: int = 0
    subspace_layers: int = 0
    subspace_seed: int = 0
    subspace_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("dropout must be in [0, 1)")
        if not 0 <= self.subspace_k <= self.n_embd:
            raise ValueError(f"subspace_k must be in [0, n_embd={self.n_embd}]")
        if not 0 <= self.subspace_layers <= self.n_layer:
            raise ValueError(f"subspace_layers must be in [0, n_layer={self.n_layer}]")
        if self.subspace_k and self.tie_weights:
            raise ValueError("a subspace model has no full token table to tie: "
                             "tie_weights=False")


# name -> (n_layer, n_head, n_embd); 'tiny' trains in minutes on 2 CPU cores and still has
# non-attention Linear layers of >= 2**16 weights, which TAGC's default policy compresses.
MODEL_SIZES: Dict[str, Tuple[int, int, int]] = {
    "tiny": (2, 4, 256),
    "mini": (4, 4, 384),
    "gpt2": (12, 12, 768),          # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; QKV projection (c_attn) is its own Linear."""

    def __init__(self, cfg: GPTConfig, out: int = 0) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, out or cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2 feed-forward block: c_fc (4x up), GELU, c_proj (down)."""

    def __init__(self, cfg: GPTConfig, out: int = 0) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, out or cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, out: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, out)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SubspaceBlock(Block):
    """A block that writes only into the subspace: it updates the coefficients c of
    the stream ``x0 + U c`` (Protocol Models' constraint as a reparametrisation, the
    output projections being ``U W'`` with ``W'`` trained)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg, out=cfg.subspace_k)

    def forward(self, c: torch.Tensor, x0: torch.Tensor,  # type: ignore[override]
                U: torch.Tensor) -> torch.Tensor:
        c = c + self.attn(self.ln_1(x0 + c @ U.t()))
        return c + self.mlp(self.ln_2(x0 + c @ U.t()))


# The residual stream between blocks: the full-width x, or (c, token ids) while the
# stream is x0(ids) + U c (subspace blocks).
Stream = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


class GPT(nn.Module):
    """GPT-2 language model (nanoGPT layout: transformer.{wte,wpe,h,ln_f}, lm_head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        # with a subspace the trained embeddings live in it (k wide); the frozen
        # high-rank part is self.subspace's tables
        emb = cfg.subspace_k or cfg.n_embd
        n_sub = cfg.subspace_layers if cfg.subspace_k else 0
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, emb),
            wpe=nn.Embedding(cfg.block_size, emb),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([SubspaceBlock(cfg) if i < n_sub else Block(cfg)
                             for i in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.subspace: Optional[nn.Module] = None
        if cfg.subspace_k:
            from tagc.pipeline import Subspace
            self.subspace = Subspace(cfg.n_embd, cfg.subspace_k, cfg.vocab_size,
                                     cfg.block_size, cfg.subspace_seed, cfg.subspace_std)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor) -> Stream:
        """The stream entering block 0: x, or (c, ids) for a subspace model.

        Args:
            idx: (B, T) int64 token ids, T <= block_size.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        h = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if self.subspace is None:
            return h
        if self.config.subspace_layers == 0:
            return self.subspace.expand(self.subspace.base(idx), h)
        return h, idx

    def blocks(self, h: Stream, start: int, stop: int) -> Stream:
        """The stream after blocks ``start..stop-1``, given the stream before ``start``."""
        n_sub = self.config.subspace_layers if self.subspace is not None else 0
        if isinstance(h, tuple):
            c, idx = h
            x0 = self.subspace.base(idx)
            for i in range(start, min(stop, n_sub)):
                c = self.transformer.h[i](c, x0, self.subspace.U)
            if stop <= n_sub:
                return c, idx
            h = self.subspace.expand(x0, c)
        for i in range(max(start, n_sub), stop):
            h = self.transformer.h[i](h)
        return h

    def head(self, h: Stream) -> torch.Tensor:
        """Logits of the stream after the last block."""
        if isinstance(h, tuple):
            c, idx = h
            h = self.subspace.expand(self.subspace.base(idx), c)
        return self.lm_head(self.transformer.ln_f(h))

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits for every position, and the mean cross-entropy if targets are given.

        Args:
            idx: (B, T) int64 token ids, T <= block_size.
            targets: (B, T) int64 next-token ids, or None.

        Returns:
            (logits (B, T, vocab), loss or None).
        """
        logits = self.head(self.blocks(self.embed(idx), 0, self.config.n_layer))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def stage_ranges(n_layer: int, stages: int) -> List[Tuple[int, int]]:
    """Blocks of each pipeline stage: ``stages`` contiguous ranges, sizes differing by
    at most one (the earlier stages the larger)."""
    if not 1 <= stages <= n_layer:
        raise ValueError(f"{stages} stages for {n_layer} blocks: need 1 <= stages <= blocks")
    q, r = divmod(n_layer, stages)
    out, start = [], 0
    for s in range(stages):
        stop = start + q + (s < r)
        out.append((start, stop))
        start = stop
    return out


class GPTStage(nn.Module):
    """One pipeline stage of a :class:`GPT`: the model with every module another stage
    owns removed (parameter names stay the full model's, so a stage's checkpoint and
    gradients compare with the one-process model's by name).

    A first stage takes token ids; a later one the stream (x, or c and the ids); a last
    stage returns logits, an earlier one the stream.

    Args:
        model: the full model (the same weights on every rank); it is cut in place.
        stage: this stage's index.
        stages: the number of stages.
    """

    def __init__(self, model: GPT, stage: int, stages: int) -> None:
        super().__init__()
        cfg = model.config
        ranges = stage_ranges(cfg.n_layer, stages)
        self.start, self.stop = ranges[stage]
        self.first, self.last = stage == 0, stage == stages - 1
        if cfg.subspace_k and cfg.subspace_layers < ranges[-1][0]:
            raise ValueError(f"subspace_layers {cfg.subspace_layers}: every boundary must "
                             f"sit inside the subspace (>= {ranges[-1][0]})")
        for i in range(cfg.n_layer):
            if not self.start <= i < self.stop:
                model.transformer.h[i] = nn.Identity()
        if not self.first:
            model.transformer.wte = model.transformer.wpe = None
        if not self.last:
            model.transformer.ln_f = None
            model.lm_head = None
        self.model = model

    def forward(self, *inp: torch.Tensor) -> Union[Stream, torch.Tensor]:
        if self.first:
            (idx,) = inp
            h: Stream = self.model.embed(idx)
        else:
            h = inp if len(inp) == 2 else inp[0]
        h = self.model.blocks(h, self.start, self.stop)
        return self.model.head(h) if self.last else h
