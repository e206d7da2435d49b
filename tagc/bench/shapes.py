"""The GPT-2 shapes the benchmarks and the cost model use, taken from the training code.

* ``bench``: the step benchmark's model (``scripts/bench/bench_step.py``):
  :class:`ModelShape`'s defaults;
* ``tiny``: the quality runs' model, the shipped ``train-tiny`` preset
  (``tagc.train.config.TrainConfig.gpt_config``) on the byte tokenizer
  (``tagc.train.data.byte_tokenizer``: 257 ids, padded to a multiple of 64);
* ``gpt2-124m``: GPT-2 small, ``tagc.train.model.GPTConfig``'s defaults.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Dict

from tagc.train.model import GPTConfig


@dataclass
class ModelShape:
    """GPT-2 shape and batch of the step benchmark (every trial of ``bench_step.py``).

    Args:
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: model width.
        vocab_size: token vocabulary (GPT-2: 50257).
        block_size: context length (the sequence length of each sample).
        batch: sequences per rank per step.
    """

    n_layer: int = 2
    n_head: int = 8
    n_embd: int = 512
    vocab_size: int = 16384
    block_size: int = 64
    batch: int = 1

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelShape.{k} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    def gpt_config(self) -> GPTConfig:
        """The architecture (``tagc.train.model.GPTConfig``; biases, tied head)."""
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         vocab_size=self.vocab_size, block_size=self.block_size)


def bench_gpt() -> GPTConfig:
    """The step benchmark's GPT-2: :class:`ModelShape`'s defaults."""
    return ModelShape().gpt_config()


def tiny_gpt() -> GPTConfig:
    """The quality runs' GPT-2: the ``train-tiny`` preset on the byte tokenizer."""
    from tagc.train.config import parse_config
    from tagc.train.data import byte_tokenizer

    return parse_config(["train-tiny.yaml"]).gpt_config(byte_tokenizer().vocab_size)


def gpt2_124m() -> GPTConfig:
    """GPT-2 small: ``GPTConfig``'s defaults (12 x 768, vocab 50304, block 1024)."""
    return GPTConfig()


# name -> the shape's architecture
GPT_SHAPES: Dict[str, Callable[[], GPTConfig]] = {
    "bench": bench_gpt, "tiny": tiny_gpt, "gpt2-124m": gpt2_124m}
