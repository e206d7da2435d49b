"""The GPT-2 shapes the benchmarks and the cost model use, taken from the training code.

* ``bench``: the step benchmark's model (``scripts/bench/bench_step.py``):
  :class:`ModelShape`'s defaults;
* ``tiny``: the quality runs' model, the shipped ``train-tiny`` preset
  (``tagc.train.config.TrainConfig.gpt_config``) on the byte tokenizer
  (``tagc.train.data.byte_tokenizer``: 257 ids, padded to a multiple of 64);
* ``gpt2-124m``: GPT-2 small, ``tagc.train.model.GPTConfig``'s defaults;
* ``gpt2-124m-c256``: GPT-2 small as the step benchmark runs it (``bench_step.py
  --model gpt2-124m``): GPT-2's own vocabulary of 50257 tokens, a context of 256.

:data:`BENCH_MODELS` are the models ``bench_step.py --model`` runs, each with the run
plan its defaults follow (a 124M model's step is seconds of compute on this CPU, the
default model's a fraction of one).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Dict, Tuple

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


@dataclass(frozen=True)
class BenchModel:
    """A model of ``bench_step.py --model`` and the defaults of its run plan.

    Args:
        shape: the model and batch.
        layout: its name in :data:`GPT_SHAPES` (the cost model's layout of it).
        warmup: untimed steps per trial.
        steps: timed steps per trial.
        repeats: round-robin passes on each shaped link.
        unshaped_repeats: passes on the unshaped link.
        configs: the configurations run when ``--configs`` is left out (names of
            ``tagc.cost.rows.ROWS``).
    """

    shape: ModelShape
    layout: str
    warmup: int
    steps: int
    repeats: int
    unshaped_repeats: int
    configs: Tuple[str, ...]


BENCH_MODELS: Dict[str, BenchModel] = {
    # the default model: steps of a fraction of a second, so several repeats; every row
    # but the gather-once and int4-gather ones
    "bench": BenchModel(ModelShape(), "bench", warmup=1, steps=3, repeats=4, unshaped_repeats=2,
                        configs=("fsdp", "dense", "10x-1bit", "10x-4bit", "exact", "sparse",
                                 "auto", "balanced", "lean", "full", "fsdp-bf16",
                                 "full-bf16")),
    # GPT-2 small at the sizes users train: 5-7 s of compute per step on this
    # CPU and up to a minute on a 200 Mbit/s link, so one warm-up step, two timed steps
    # and two shaped passes keep 9 rows at 3 link rates within about 45 minutes
    # (cost_model.py's estimate from its predictions)
    "gpt2-124m": BenchModel(ModelShape(n_layer=12, n_head=12, n_embd=768, vocab_size=50257,
                                       block_size=256, batch=1), "gpt2-124m-c256",
                            warmup=1, steps=2, repeats=2, unshaped_repeats=1,
                            configs=("fsdp", "fsdp-bf16", "fsdp-noreshard", "balanced", "full",
                                     "full-bf16", "full-int4g", "full-noreshard", "full4")),
}


def gpt2_124m_c256() -> GPTConfig:
    """GPT-2 small as ``bench_step.py --model gpt2-124m`` runs it (vocab 50257, block 256)."""
    return BENCH_MODELS["gpt2-124m"].shape.gpt_config()


# name -> the shape's architecture
GPT_SHAPES: Dict[str, Callable[[], GPTConfig]] = {
    "bench": bench_gpt, "tiny": tiny_gpt, "gpt2-124m": gpt2_124m,
    "gpt2-124m-c256": gpt2_124m_c256}
