"""Train GPT-2 with PyTorch FSDP, with or without TAGC gradient compression.

One process per device, launched by torchrun, on one node or several:

    # tiny model, built-in offline corpus, 2 CPU processes (gloo), TAGC exact mode
    torchrun --standalone --nproc_per_node 2 scripts/train_gpt2.py --tagc configs/tagc-exact.yaml
    # baseline (plain FSDP), FSDP2, gradient accumulation 4
    torchrun --standalone --nproc_per_node 2 scripts/train_gpt2.py --fsdp 2 --grad_accum 4
    # the paper's setup on GPUs, 2 nodes
    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        scripts/train_gpt2.py configs/train-gpt2.yaml --tagc configs/tagc-10x-1bit.yaml

Settings come from the TrainConfig dataclass below, then an optional YAML file (a bare
``.yaml`` argument or ``--config PATH``), then ``--key=value`` / ``--key value`` overrides,
converted to the field's type; an unknown key raises.

Checkpoints (``out_dir/ckpt``): model, optimizer and TAGC state (each rank's residuals,
step counters, seeds) through torch.distributed.checkpoint, plus one ``rank{r}.pt`` per
rank with that rank's RNG state, and ``train_state.json`` (iteration, world size, config)
written last by rank 0.
``--init_from=resume`` continues bit-exactly on CPU (batches and learning rate are pure
functions of the iteration number).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import difflib
import json
import logging
import math
import os
import shutil
import sys
import time
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt2_data beside this file
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tagc_hook at repo root
import gpt2_data  # noqa: E402
from gpt2_model import GPT, MODEL_SIZES, Block, GPTConfig  # noqa: E402

logger = logging.getLogger("train_gpt2")

# =============================================================================== optimizer


def decayed_parameter_names(model: nn.Module) -> set:
    """Names of the parameters that get weight decay: matrices and embeddings (dim >= 2).

    Call on the unwrapped model: FSDP1 with use_orig_params shows sharded parameters as
    1-D views, so their shape no longer tells.
    """
    return {name for name, p in model.named_parameters() if p.dim() >= 2}


def _clean_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".")
                    if part not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def configure_optimizer(model: nn.Module, decayed: set, weight_decay: float, lr: float,
                        betas: Tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with weight decay on the `decayed` parameters only, as nanoGPT.

    Args:
        model: the (wrapped) model; FSDP1 must use use_orig_params=True.
        decayed: names from decayed_parameter_names() of the unwrapped model.
        weight_decay, lr, betas: AdamW settings.

    Returns:
        The optimizer.
    """
    groups: Tuple[List[nn.Parameter], List[nn.Parameter]] = ([], [])
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[0 if _clean_fqn(name) in decayed else 1].append(p)
    if not groups[0] or not groups[1]:
        raise RuntimeError("parameter groups by name failed: one group is empty")
    return torch.optim.AdamW([{"params": groups[0], "weight_decay": weight_decay},
                              {"params": groups[1], "weight_decay": 0.0}],
                             lr=lr, betas=betas)


# =============================================================================== config


def _opt(default: Any, help: str) -> Any:
    """A TrainConfig field with its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    """The knobs of any run (data, optimisation, distribution, logging); the model's
    own knobs live in a subclass (TrainConfig here, FinetuneConfig in finetune_hf.py)."""

    # I/O
    out_dir: str = _opt("out/gpt2", "run folder: metrics.csv, summary.json, ckpt/, tb/")
    init_from: str = _opt("scratch", "scratch | resume (from out_dir/ckpt)")
    eval_interval: int = _opt(50, "steps between validation estimates")
    eval_iters: int = _opt(8, "batches per rank in a validation estimate")
    log_interval: int = _opt(10, "steps between log lines and metrics rows")
    ckpt_interval: int = _opt(0, "steps between checkpoints; 0: only at the end")
    save_checkpoint: bool = _opt(True, "save a checkpoint at the end of the run")
    progress: bool = _opt(True, "tqdm progress bar on rank 0")
    tensorboard: bool = _opt(True, "TensorBoard logs in out_dir/tb (if installed)")
    # data
    data: str = _opt("stdlib", "stdlib (built-in, offline) | openwebtext | a folder of text files")
    tokenizer: str = _opt("auto", "auto (GPT-2 BPE if tiktoken's files are cached, else "
                                  "bytes) | gpt2 | byte")
    cache_dir: str = _opt("data_cache", "token cache folder")
    val_percent: float = _opt(5.0, "share of the documents kept for validation")
    block_size: int = _opt(128, "context length (tokens)")
    # optimisation
    batch_size: int = _opt(8, "sequences per rank per micro step")
    grad_accum: int = _opt(1, "micro steps per optimizer step")
    max_iters: int = _opt(150, "optimizer steps")
    learning_rate: float = _opt(1e-3, "peak learning rate (AdamW)")
    min_lr: float = _opt(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = _opt(20, "linear learning-rate warm-up steps")
    lr_decay_iters: int = _opt(0, "steps of the cosine decay; 0: max_iters")
    weight_decay: float = _opt(0.1, "AdamW weight decay of matrices and embeddings")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    grad_clip: float = _opt(1.0, "gradient-norm clip; 0: off")
    seed: int = _opt(1337, "seed of the model init and the batches")
    # distributed
    fsdp: int = _opt(1, "1: FullyShardedDataParallel, 2: fully_shard")
    sharding: str = _opt("FULL_SHARD", "FULL_SHARD | SHARD_GRAD_OP")
    replicas: int = _opt(1, "FSDP2: HSDP over this many replicas (nodes; ranks are numbered "
                            "node by node): shard inside a replica, replicate across; "
                            "TAGC's HSDP route with --tagc, native HSDP without")
    tagc: Optional[str] = _opt(None, "a TAGC preset (configs/tagc-*.yaml); none: plain FSDP")
    tagc_set: str = _opt("", "preset fields to override, e.g. dense_steps=2000,theta=0.9")
    wrap: str = _opt("auto", "unit layout: auto | block | tagc (tagc: the hook's layout)")
    device: str = _opt("auto", "auto | cpu | cuda")
    dtype: str = _opt("auto", "auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16")
    threads: int = _opt(0, "CPU threads per rank; 0: cores / local ranks")

    def validate(self) -> None:
        """Raise ValueError on any inconsistent setting."""
        def one_of(name: str, allowed: Sequence[Any]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        one_of("init_from", ("scratch", "resume"))
        one_of("tokenizer", ("auto", "gpt2", "byte"))
        one_of("fsdp", (1, 2))
        one_of("sharding", ("FULL_SHARD", "SHARD_GRAD_OP"))
        one_of("wrap", ("auto", "block", "tagc"))
        one_of("device", ("auto", "cpu", "cuda"))
        one_of("dtype", ("auto", "float32", "bfloat16"))
        for name in ("eval_interval", "eval_iters", "log_interval", "block_size",
                     "batch_size", "grad_accum", "max_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("ckpt_interval", "warmup_iters", "lr_decay_iters", "threads", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.learning_rate:
            raise ValueError("min_lr must not exceed learning_rate")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("beta1 and beta2 must be in [0, 1)")
        if not 0 < self.val_percent < 100:
            raise ValueError("val_percent must be in (0, 100)")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replicas > 1 and self.fsdp != 2:
            raise ValueError("replicas > 1 (HSDP) needs fsdp=2 (FSDP1 allows no comm hook "
                             "on HYBRID_SHARD)")
        if self.wrap == "tagc" and not self.tagc:
            raise ValueError("wrap=tagc needs --tagc (the preset decides the unit layout)")
        if self.tagc is not None and not Path(self.tagc).is_file():
            raise ValueError(f"--tagc {self.tagc}: no such file")
        if self.tagc_set and self.tagc is None:
            raise ValueError("--tagc_set needs --tagc (it overrides fields of the preset)")
        parse_tagc_set(self.tagc_set)


@dataclass
class TrainConfig(RunConfig):
    """Every knob of a GPT-2 run. Defaults: the tiny model on the built-in corpus,
    ~1-2 min on 2 cores."""

    model: str = _opt("tiny", f"model size: {' | '.join(MODEL_SIZES)}")
    n_layer: int = _opt(0, "transformer blocks; 0: from --model")
    n_head: int = _opt(0, "attention heads; 0: from --model")
    n_embd: int = _opt(0, "model width; 0: from --model")
    dropout: float = _opt(0.0, "dropout probability (0 keeps runs deterministic)")
    bias: bool = _opt(True, "biases in Linear and LayerNorm layers")
    tie_weights: bool = _opt(True, "share the token embedding with the LM head")

    def validate(self) -> None:
        super().validate()
        if self.model not in MODEL_SIZES:
            raise ValueError(f"model must be one of {list(MODEL_SIZES)}, got {self.model!r}")
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """The model architecture for a tokenizer of vocab_size ids (padded to 64)."""
        n_layer, n_head, n_embd = MODEL_SIZES[self.model]
        return GPTConfig(block_size=self.block_size, vocab_size=(vocab_size + 63) // 64 * 64,
                         n_layer=self.n_layer or n_layer, n_head=self.n_head or n_head,
                         n_embd=self.n_embd or n_embd, dropout=self.dropout, bias=self.bias,
                         tie_weights=self.tie_weights)


def parse_tagc_set(spec: str) -> Dict[str, Any]:
    """Parse ``--tagc_set``: comma-separated ``field=value`` pairs, values read as YAML.

    Args:
        spec: e.g. ``"dense_steps=2000,warmup_steps=10000,theta=0.9"`` (may be empty).
    Returns:
        the overrides; TAGCConfig.from_dict checks the names and values.
    Raises:
        ValueError: a pair without ``=`` or a field given twice.
    """
    import yaml

    out: Dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--tagc_set: expected field=value, got {part!r}")
        if key in out:
            raise ValueError(f"--tagc_set: {key} given twice")
        out[key] = yaml.safe_load(value)
    return out


def load_tagc_config(tagc: Any, cfg: "RunConfig") -> Any:
    """The TAGCConfig of ``--tagc`` with ``--tagc_set`` applied (unknown fields raise).

    The warm-up lengths of the presets are sized for train-tiny; a longer run
    scales them here, e.g. ``--tagc_set dense_steps=2000,warmup_steps=10000``.
    """
    base = tagc.TAGCConfig.from_yaml(cfg.tagc)
    overrides = parse_tagc_set(cfg.tagc_set)
    return tagc.TAGCConfig.from_dict({**base.to_dict(), **overrides}) if overrides else base


def _convert(name: str, tp: Any, raw: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            return None
        return _convert(name, args[0], raw)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{name}: expected a boolean, got {raw!r}")
    if tp is int:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError(f"--{name}: expected an integer, got {raw!r}")
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"--{name}: expected an integer, got {raw!r}") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"--{name}: expected a number, got {raw!r}") from None
    if tp is str:
        return str(raw)
    raise TypeError(f"unsupported field type {tp} for {name}")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of exiting (--help still exits 0)."""

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(message)


def _option_type(name: str, tp: Any) -> Any:
    """The argparse ``type`` of a field: _convert, its errors in argparse's words."""
    def convert(raw: str) -> Any:
        try:
            return _convert(name, tp, raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(tp, "__name__", str(tp))
    return convert


def build_parser(cls: type = None, prog: str = "train_gpt2.py",
                 description: str = "") -> argparse.ArgumentParser:
    """The command line of a config dataclass: one option per field (type, default and
    help from the dataclass), plus YAML files (positional or ``--config``).

    Args:
        cls: the config dataclass (default TrainConfig).
        prog, description: for --help.
    """
    cls = cls or TrainConfig
    hints = typing.get_type_hints(cls)
    p = _Parser(prog=prog, description=description or __doc__.split("\n\n")[0],
                epilog="Settings: the defaults, then YAML files in order, then the options "
                       "given. Booleans take true/false/1/0/yes/no or stand alone (true).",
                argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p.add_argument("yaml", nargs="*", help="YAML files of settings (configs/train-*.yaml)")
    p.add_argument("--config", action="append", dest="yaml_opt", metavar="PATH",
                   help="a YAML file of settings (same as a positional one)")
    for f in dataclasses.fields(cls):
        tp, flags = hints[f.name], [f"--{f.name}"]
        if "_" in f.name:
            flags.append(f"--{f.name.replace('_', '-')}")
        tname = "str or none" if typing.get_origin(tp) is typing.Union else tp.__name__
        kw: Dict[str, Any] = {"dest": f.name, "metavar": f.name.upper(),
                              "type": _option_type(f.name, tp),
                              "help": f"{f.metadata['help']} ({tname}; default: {f.default})"}
        if tp is bool:
            kw.update(nargs="?", const=True)
        p.add_argument(*flags, **kw)
    return p


def parse_config(argv: Optional[Sequence[str]] = None, cls: type = None,
                 prog: str = "train_gpt2.py", description: str = "") -> Any:
    """Build a config (default TrainConfig) from defaults, YAML files and options.

    Args:
        argv: arguments without the program name (default sys.argv[1:]). Accepted forms:
            ``file.yaml``, ``--config file.yaml``, ``--key=value``, ``--key value``, and a
            bare ``--flag`` for booleans.
        cls: the config dataclass.
        prog, description: the script's name in messages, its --help text.

    Returns:
        The validated config.

    Raises:
        ValueError: unknown key (with the nearest known one), bad value, or inconsistent
            settings.
    """
    cls = cls or TrainConfig
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(cls, prog, description)
    args, unknown = parser.parse_known_args(argv)
    names = [f.name for f in dataclasses.fields(cls)]
    for arg in unknown:
        key = arg[2:].partition("=")[0].replace("-", "_") if arg.startswith("--") else arg
        near = difflib.get_close_matches(key, names, n=1)
        raise ValueError(f"unknown config key {arg!r}"
                         + (f"; did you mean --{near[0]}?" if near else "")
                         + f" ({prog} --help lists them)")
    given = vars(args)
    yaml_files = list(given.pop("yaml", [])) + list(given.pop("yaml_opt", None) or [])
    hints = typing.get_type_hints(cls)
    values: Dict[str, Any] = {}
    for path in yaml_files:
        if not path.endswith((".yaml", ".yml")):
            raise ValueError(f"unexpected argument {path!r} (settings files end in .yaml; "
                             "options are --key=value)")
        import yaml
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        for key, value in loaded.items():
            if key not in hints:
                near = difflib.get_close_matches(str(key), names, n=1)
                raise ValueError(f"{path}: unknown config key {key!r}"
                                 + (f"; did you mean {near[0]}?" if near else ""))
            values[key] = _convert(key, hints[key], value)
    values.update(given)  # already converted by the options' types
    cfg = cls(**values)
    cfg.validate()
    return cfg


def require_launcher(script: str) -> None:
    """Exit with how to start ``script`` when no launcher set up the process group.

    torch's own error ("environment variable RANK expected") does not say that the
    script is meant to run under torchrun, one process per device.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise SystemExit(
            f"{script}: start it with torchrun, one process per device, e.g.\n"
            f"    torchrun --standalone --nproc_per_node 2 {script} [options]\n"
            f"(not set: {', '.join(missing)}; {script} --help lists the options)")


def get_lr(it: int, cfg: RunConfig) -> float:
    """Linear warmup then cosine decay to min_lr (nanoGPT's schedule)."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# =============================================================================== FSDP + TAGC


def import_tagc() -> Any:
    """Import tagc_hook (at the repository root), with a clear error if it is missing."""
    try:
        import tagc_hook
    except ImportError as exc:
        raise RuntimeError(f"--tagc needs tagc_hook.py and the _tagc extension "
                           f"(pip install -e . at the repository root): {exc}") from exc
    return tagc_hook


def device_mesh(cfg: RunConfig, device: torch.device) -> Any:
    """FSDP2's mesh: every rank on one dimension, or with ``replicas`` > 1 the HSDP
    ``(replicate, shard)`` mesh (torchrun numbers ranks node by node, so a row is one
    node).  None for FSDP1."""
    if cfg.fsdp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    if cfg.replicas == 1:
        return init_device_mesh(device.type, (world,))
    if world % cfg.replicas:
        raise ValueError(f"replicas={cfg.replicas} does not divide the {world} ranks")
    return init_device_mesh(device.type, (cfg.replicas, world // cfg.replicas),
                            mesh_dim_names=("replicate", "shard"))


def wrap_model(model: nn.Module, cfg: RunConfig, tagc_cfg: Any, device: torch.device,
               param_dtype: torch.dtype, blocks: Sequence[type], mesh: Any = None
               ) -> nn.Module:
    """Shard the model with FSDP1 or FSDP2.

    Unit layout: ``block`` puts each transformer block (a module of a class in
    ``blocks``) in its own unit (embeddings, final norm and a tied head stay in the root
    unit). ``tagc`` asks tagc_hook for its layout, which separates the parameters the
    preset compresses from the others.

    Args:
        model: the model on `device`.
        cfg: run config.
        tagc_cfg: a tagc_hook.TAGCConfig or None.
        device: this rank's device.
        param_dtype: compute dtype (bf16 on GPU by default); gradients are reduced in fp32.
        blocks: the transformer block classes (for the ``block`` layout).
        mesh: FSDP2's mesh (:func:`device_mesh`).

    Returns:
        The FSDP1 root module, or the model itself with fully_shard applied (FSDP2).
    """
    wrap = cfg.wrap if cfg.wrap != "auto" else ("tagc" if tagc_cfg is not None else "block")
    tagc = import_tagc() if wrap == "tagc" else None
    if cfg.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = None
        if param_dtype != torch.float32:
            mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                buffer_dtype=param_dtype)
        policy = (tagc.fsdp1_auto_wrap_policy(model, tagc_cfg) if tagc is not None
                  else ModuleWrapPolicy(set(blocks)))
        return FSDP(model, auto_wrap_policy=policy, mixed_precision=mp,
                    sharding_strategy=ShardingStrategy[cfg.sharding],
                    device_id=device,  # torch.device("cpu") is how FSDP1 runs on gloo
                    use_orig_params=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    kw: Dict[str, Any] = dict(mesh=mesh, reshard_after_forward=cfg.sharding == "FULL_SHARD")
    if param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                               reduce_dtype=torch.float32)
    if tagc is not None:
        return tagc.shard_model(model, tagc_cfg, **kw)
    for block in [m for m in model.modules() if isinstance(m, tuple(blocks))]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def grad_sync(model: nn.Module, fsdp: int, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro step: gradients are reduced only when sync is True."""
    if fsdp == 1:
        return contextlib.nullcontext() if sync else model.no_sync()
    model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


class GradBytes:
    """Gradient bytes this rank sent since the run (or the resumed part) started.

    With TAGC: the hook's own counters (``state.stats()``): ``wire_bytes`` (what this
    rank sent on an ideal network), ``default_wire_bytes`` (what FSDP's ideal ring
    reduce-scatter would have sent for the same calls), unpeeled/recovered entries, and
    the compressed units' wire bits per gradient element.  Plain FSDP: the ideal ring
    reduce-scatter volume, (N-1)/N of the fp32 gradient per synced step (padding
    ignored), sent and "uncompressed" alike; native HSDP: the ring all-reduce of this
    rank's shard over the R replicas, 2(R-1)/R of it (the bytes between nodes).

    Args:
        state: the TAGCState, or None for plain FSDP.
        n_params: the model's parameters.
        world: ranks.
        replicas: HSDP replicas (1: FULL_SHARD over every rank).
    """

    def __init__(self, state: Any, n_params: int, world: int, replicas: int = 1) -> None:
        self.state = state
        if replicas > 1:
            shard = n_params * 4 / (world // replicas)
            self.plain_per_step = int(shard * 2 * (replicas - 1) / replicas)
        else:
            self.plain_per_step = int(n_params * 4 * (world - 1) / world)
        self.steps = 0
        self.start = self._totals() if state is not None else None
        self.sent = self.uncompressed = self.unpeeled = self.recovered = 0.0
        self.guard_resets = 0.0  # calls the feedback guard sent plainly (guard_ratio)
        self.gather_sent = self.gather_uncompressed = 0.0
        self.comp_bits = float("nan")  # wire bits per gradient element, compressed units

    def _totals(self) -> Dict[str, float]:
        st = self.state.stats()
        total, comp = st["total"], st["compressed_total"]
        elems = sum(u["numel"] * u["calls"] for u in st["units"].values() if u["compressed"])
        return {"sent": float(total["wire_bytes"]),
                "uncompressed": float(total["default_wire_bytes"]),
                "gather_sent": float(total["gather_wire_bytes"]),
                "gather_uncompressed": float(total["gather_default_wire_bytes"]),
                "unpeeled": float(total["unpeeled"]), "recovered": float(total["recovered"]),
                "guard_resets": float(total["guard_resets"]),
                "comp_sent": float(comp["wire_bytes"]), "comp_elems": float(elems)}

    def step(self) -> None:
        """Account one more optimizer step."""
        self.steps += 1
        if self.state is None:
            self.sent = self.uncompressed = float(self.plain_per_step * self.steps)
            return
        now, s0 = self._totals(), self.start
        self.sent = now["sent"] - s0["sent"]
        self.uncompressed = now["uncompressed"] - s0["uncompressed"]
        self.unpeeled = now["unpeeled"] - s0["unpeeled"]
        self.recovered = now["recovered"] - s0["recovered"]
        self.guard_resets = now["guard_resets"] - s0["guard_resets"]
        self.gather_sent = now["gather_sent"] - s0["gather_sent"]
        self.gather_uncompressed = now["gather_uncompressed"] - s0["gather_uncompressed"]
        elems = now["comp_elems"] - s0["comp_elems"]
        if elems:
            self.comp_bits = 8 * (now["comp_sent"] - s0["comp_sent"]) / elems

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1 - self.sent / self.uncompressed) if self.uncompressed else 0.0

    def line(self) -> str:
        """``sent X of Y uncompressed (Z% saved)`` for the log (and the parameter
        gathers' when TAGC quantizes them)."""
        out = (f"sent {_fmt_bytes(self.sent)} of {_fmt_bytes(self.uncompressed)} "
               f"uncompressed ({self.saved_pct:.1f}% saved)")
        if self.gather_sent != self.gather_uncompressed:
            pct = 100.0 * (1 - self.gather_sent / self.gather_uncompressed)
            out += (f"; param gathers {_fmt_bytes(self.gather_sent)} of "
                    f"{_fmt_bytes(self.gather_uncompressed)} ({pct:.1f}% saved)")
        return out


# =============================================================================== checkpoint


@contextlib.contextmanager
def _quiet_checkpoint_warnings() -> typing.Iterator[None]:
    """FSDP1's sharded state dict path warns about its own deprecated internals on every
    call; they say nothing about this script, so keep them out of the training log."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, iter_num: int, cfg: RunConfig) -> None:
    """Write a checkpoint atomically (all ranks call this).

    Model, optimizer and TAGC state go through torch.distributed.checkpoint (each rank
    writes its shards and its own residual rows); the RNG state through torch.save into
    rank{r}.pt. The directory is assembled as path.tmp and renamed when complete.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    rank = dist.get_rank()
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    with _quiet_checkpoint_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: Dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if tagc_state is not None:
            state["tagc"] = tagc_state  # a DCP Stateful: state_dict() now, per-rank rows
        dcp.save(state, checkpoint_id=str(tmp))
    torch.save({"rng": torch.get_rng_state(), "iter_num": iter_num}, tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "train_state.json").write_text(json.dumps(
            {"iter_num": iter_num, "world_size": dist.get_world_size(),
             "config": dataclasses.asdict(cfg)}, indent=1))
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    tagc_state: Any, cfg: RunConfig) -> int:
    """Restore what save_checkpoint wrote; returns the iteration to continue from.

    Raises:
        FileNotFoundError: no complete checkpoint at path.
        ValueError: the checkpoint was written with another world size or TAGC setting.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    meta_path = path / "train_state.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"no complete checkpoint at {path}")
    meta = json.loads(meta_path.read_text())
    if meta["world_size"] != dist.get_world_size():
        raise ValueError(f"checkpoint has world size {meta['world_size']}, this run "
                         f"{dist.get_world_size()} (the per-rank TAGC residuals need the same)")
    saved_tagc = meta["config"].get("tagc")
    if (saved_tagc is None) != (cfg.tagc is None):
        raise ValueError(f"checkpoint was written with tagc={saved_tagc}, this run uses "
                         f"tagc={cfg.tagc}")
    with _quiet_checkpoint_warnings():
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if tagc_state is not None:
            state["tagc"] = tagc_state  # dcp.load calls its load_state_dict (checks config)
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    local = torch.load(path / f"rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(local["rng"])
    return int(local["iter_num"])


# =============================================================================== logging


class _TqdmHandler(logging.Handler):
    """Log through tqdm.write so lines do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        tqdm.write(self.format(record), file=sys.stdout)


class MetricsLog:
    """CSV (always) and TensorBoard (if installed) metrics, written by rank 0 only."""

    # elapsed_s: wall time since the loop started (evaluations included); train_s: the
    # training steps' time alone (what a time-to-loss comparison should add up)
    FIELDS = ["kind", "iter", "loss", "lr", "step_ms", "tokens_per_s", "bytes_sent",
              "bytes_uncompressed", "unpeeled", "elapsed_s", "train_s"]

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool, resume: bool) -> None:
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "metrics.csv"
        append = resume and path.exists()
        self.f = open(path, "a" if append else "w", newline="")
        self.w = csv.DictWriter(self.f, fieldnames=self.FIELDS)
        if not append:
            self.w.writeheader()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(log_dir=str(out_dir / "tb"))
            except ImportError:
                logger.warning("TensorBoard logging skipped: `pip install tensorboard` "
                               "to enable it")

    def write(self, **row: Any) -> None:
        """Append one row (missing fields stay empty) and mirror numbers to TensorBoard."""
        if not self.enabled:
            return
        self.w.writerow(row)
        self.f.flush()
        if self.tb is not None:
            for key in ("loss", "lr", "step_ms", "tokens_per_s", "bytes_sent"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"{row['kind']}/{key}", row[key], row["iter"])

    def close(self) -> None:
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"


# =============================================================================== main


@torch.no_grad()
def estimate_val_loss(model: nn.Module, data: gpt2_data.TokenData, cfg: RunConfig,
                      device: torch.device, loss_fn: Callable[..., torch.Tensor],
                      tagc_state: Any = None) -> float:
    """Mean validation loss over eval_iters fixed batches per rank, averaged over ranks.

    With TAGC's quantized parameter gathers (``gather``), the weights are gathered
    exactly here: the loss reported is the model's, not its quantized view.
    """
    model.eval()
    total = torch.zeros(1, dtype=torch.float64, device=device)
    rank = dist.get_rank()
    exact = tagc_state.exact_gathers() if tagc_state is not None else contextlib.nullcontext()
    with exact, torch.no_grad():
        for k in range(cfg.eval_iters):
            x, y = data.get_batch("val", cfg.batch_size, cfg.block_size, (cfg.seed, 1, k, rank))
            total += loss_fn(model, x.to(device), y.to(device)).double()
    dist.all_reduce(total)  # SUM: gloo's AVG is not trusted
    model.train()
    return total.item() / (cfg.eval_iters * dist.get_world_size())


@dataclass
class Env:
    """Where this rank runs (set up once by :func:`setup`)."""

    rank: int
    world: int
    master: bool
    device: torch.device
    param_dtype: torch.dtype
    own_pg: bool


@dataclass
class ModelSpec:
    """What the training core needs of a model family.

    Attributes:
        module: the unwrapped model on this rank's device, the same weights on every rank.
        n_params: its number of distinct parameters.
        decayed: names of the parameters that get weight decay.
        blocks: the transformer block classes (the ``block`` unit layout).
        loss: ``loss(model, x, y)``: mean next-token cross-entropy of a batch.
        describe: one line for the log.
    """

    module: nn.Module
    n_params: int
    decayed: set
    blocks: Sequence[type]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def setup(cfg: RunConfig, script: str) -> Env:
    """Process group (from torchrun's environment unless one exists), device, dtype, logging."""
    # Linear layers wrapped on their own (TAGC's unit layout) return views of their matmul;
    # FSDP2 warns in case the caller modifies them in place, which these models never do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    own_pg = not dist.is_initialized()
    if own_pg:
        require_launcher(script)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local_world))
    if cfg.dtype == "auto":
        param_dtype = (torch.bfloat16 if use_cuda and torch.cuda.is_bf16_supported()
                       else torch.float32)
    else:
        param_dtype = getattr(torch, cfg.dtype)
    if not logger.handlers:
        handler = _TqdmHandler() if cfg.progress else logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    return Env(rank, world, rank == 0, device, param_dtype, own_pg)


def load_data(cfg: RunConfig, tokenizer: Any = None) -> Tuple[gpt2_data.TokenData, Any]:
    """The token data of ``--data`` (prepared by local rank 0), and its tokenizer.

    Args:
        cfg: run config.
        tokenizer: a gpt2_data.Tokenizer to use instead of ``cfg.tokenizer``.
    """
    meta, tok = gpt2_data.prepare_distributed(cfg.data, tokenizer or cfg.tokenizer,
                                              Path(cfg.cache_dir), cfg.val_percent)
    logger.info("data: %s, tokenizer: %s (vocab %d)%s, tokens train %d / val %d",
                meta["source"], tok.name, tok.vocab_size,
                " - GPT-2 BPE files not in tiktoken's cache, byte-level fallback"
                if tok.name == "byte" and cfg.tokenizer == "auto" and tokenizer is None else "",
                meta["tokens"]["train"], meta["tokens"]["val"])
    return gpt2_data.TokenData(meta), tok


def gpt_spec(cfg: TrainConfig, env: Env, vocab_size: int) -> ModelSpec:
    """This script's GPT-2 (scripts/gpt2_model.py)."""
    gcfg = cfg.gpt_config(vocab_size)
    model = GPT(gcfg).to(env.device)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(x, y)[1]

    return ModelSpec(model, model.num_params(), decayed_parameter_names(model), [Block], loss,
                     f"model {cfg.model}: {gcfg.n_layer} layers, {gcfg.n_head} heads, "
                     f"{gcfg.n_embd} wide, block {gcfg.block_size}")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run one training job; returns the summary dict (also written to out_dir/summary.json).

    Args:
        argv: command-line arguments without the program name (default sys.argv[1:]).
            The process group is taken from the torchrun environment unless the caller
            already initialised one (tests do), in which case it is left open.
    """
    try:
        cfg = parse_config(argv)
    except ValueError as exc:
        if argv is not None:
            raise
        build_parser().exit(2, f"train_gpt2.py: error: {exc}\n")
    env = setup(cfg, "scripts/train_gpt2.py")
    data, tok = load_data(cfg)
    return run(cfg, env, gpt_spec(cfg, env, tok.vocab_size), data, tok)


def run(cfg: RunConfig, env: Env, spec: ModelSpec, data: gpt2_data.TokenData,
        tok: Any) -> Dict[str, Any]:
    """Shard, register TAGC, train, evaluate, checkpoint; returns the summary."""
    tagc_cfg = tagc_state = None
    if cfg.tagc is not None:
        tagc = import_tagc()
        tagc_cfg = load_tagc_config(tagc, cfg)
    mesh = device_mesh(cfg, env.device)
    model = wrap_model(spec.module, cfg, tagc_cfg, env.device, env.param_dtype, spec.blocks,
                       mesh)
    if tagc_cfg is not None:
        tagc_state = tagc.register(model, tagc_cfg,
                                   mesh=mesh if cfg.replicas > 1 else None)
    optimizer = configure_optimizer(model, spec.decayed, cfg.weight_decay, cfg.learning_rate,
                                    (cfg.beta1, cfg.beta2))
    logger.info("%s, %.2fM params; FSDP%d %s, world %d on %s (%s), %s", spec.describe,
                spec.n_params / 1e6, cfg.fsdp, cfg.sharding, env.world, env.device.type,
                str(env.param_dtype).replace("torch.", ""),
                f"TAGC {cfg.tagc}" + (f" with {cfg.tagc_set}" if cfg.tagc_set else "")
                if cfg.tagc else "no compression (plain FSDP)")
    out_dir = Path(cfg.out_dir)
    iter_num = 0
    ckpt_path = out_dir / "ckpt"
    if cfg.init_from == "resume":
        iter_num = load_checkpoint(ckpt_path, model, optimizer, tagc_state, cfg)
        logger.info("resumed from %s at iter %d", ckpt_path, iter_num)
    metrics = MetricsLog(out_dir, env.master, cfg.tensorboard, cfg.init_from == "resume")
    if env.master:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    summary = train_loop(cfg, env, spec, model, optimizer, tagc_state, data, metrics,
                         iter_num, ckpt_path)
    summary.update(n_params=spec.n_params, world_size=env.world, tokenizer=tok.name,
                   tagc=cfg.tagc, fsdp=cfg.fsdp, sharding=cfg.sharding,
                   replicas=cfg.replicas)
    if env.master:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.close()
    if env.own_pg:
        # every rank past its last collective before any tears the group down: a
        # gloo peer that closes its pairs while the other still reads from them
        # can abort the other process at exit
        dist.barrier()
        dist.destroy_process_group()
    return summary


def train_step(cfg: RunConfig, env: Env, spec: ModelSpec, model: nn.Module,
               optimizer: torch.optim.Optimizer, data: gpt2_data.TokenData, iter_num: int,
               lr: float) -> float:
    """One optimizer step (``grad_accum`` micro-batches); returns the mean train loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(cfg.grad_accum):
        x, y = data.get_batch("train", cfg.batch_size, cfg.block_size,
                              (cfg.seed, 0, iter_num, micro, env.rank))
        # FSDP's mixed-precision policy casts parameters; no autocast needed
        with grad_sync(model, cfg.fsdp, micro == cfg.grad_accum - 1):
            loss = spec.loss(model, x.to(env.device), y.to(env.device))
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach()
    if cfg.grad_clip > 0:
        if cfg.fsdp == 1:
            model.clip_grad_norm_(cfg.grad_clip)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / cfg.grad_accum  # .item() also waits for the device


def train_loop(cfg: RunConfig, env: Env, spec: ModelSpec, model: nn.Module,
               optimizer: torch.optim.Optimizer, tagc_state: Any, data: gpt2_data.TokenData,
               metrics: "MetricsLog", iter_num: int, ckpt_path: Path) -> Dict[str, Any]:
    """The steps from ``iter_num`` to ``max_iters``; returns the run's numbers."""
    device, world = env.device, env.world
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.grad_accum * world
    grad_bytes = GradBytes(tagc_state, spec.n_params, world, cfg.replicas)
    step_times: List[float] = []
    val_loss = float("nan")
    from tqdm import tqdm
    bar = tqdm(total=cfg.max_iters, initial=iter_num, disable=not (env.master and cfg.progress),
               dynamic_ncols=True, desc="train", file=sys.stderr)
    t_start = time.perf_counter()
    model.train()
    while True:
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            val_loss = estimate_val_loss(model, data, cfg, device, spec.loss, tagc_state)
            logger.info("iter %d: val loss %.4f", iter_num, val_loss)
            metrics.write(kind="val", iter=iter_num, loss=val_loss,
                          elapsed_s=time.perf_counter() - t_start, train_s=sum(step_times))
            bar.set_postfix(val=f"{val_loss:.3f}")
        if cfg.ckpt_interval and iter_num % cfg.ckpt_interval == 0 and iter_num > 0 \
                and iter_num < cfg.max_iters:
            save_checkpoint(ckpt_path, model, optimizer, tagc_state, iter_num, cfg)
        if iter_num >= cfg.max_iters:
            break

        t0 = time.perf_counter()
        lr = get_lr(iter_num, cfg)
        train_loss = train_step(cfg, env, spec, model, optimizer, data, iter_num, lr)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        iter_num += 1
        bar.update(1)

        grad_bytes.step()
        if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
            gb = grad_bytes
            logger.info("iter %d: loss %.4f, lr %.2e, %.0f ms/step, %.0f tok/s, grad bytes/rank "
                        "%s%s", iter_num, train_loss, lr, dt * 1000, tokens_per_iter / dt,
                        gb.line(), f", unpeeled {int(gb.unpeeled)} (recovered "
                        f"{int(gb.recovered)})" if gb.unpeeled else "")
            metrics.write(kind="train", iter=iter_num, loss=train_loss, lr=lr,
                          step_ms=dt * 1000, tokens_per_s=tokens_per_iter / dt,
                          bytes_sent=gb.sent, bytes_uncompressed=gb.uncompressed,
                          unpeeled=gb.unpeeled, elapsed_s=time.perf_counter() - t_start,
                          train_s=sum(step_times))
            bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{val_loss:.3f}")
    bar.close()

    if cfg.save_checkpoint:
        save_checkpoint(ckpt_path, model, optimizer, tagc_state, iter_num, cfg)
    # first steps include warm-up allocations; report the steady state when there is one
    steady = step_times[min(5, len(step_times) // 2):] if step_times else []
    steps = len(step_times)
    gb = grad_bytes
    summary = {
        "iters": iter_num, "steps_this_run": steps, "final_val_loss": val_loss,
        "mean_step_ms": 1000 * sum(steady) / len(steady) if steady else float("nan"),
        "bytes_sent": gb.sent, "bytes_uncompressed": gb.uncompressed,
        "saved_pct": gb.saved_pct, "gather_bytes_sent": gb.gather_sent,
        "gather_bytes_uncompressed": gb.gather_uncompressed,
        "bits_per_param": 8 * gb.sent / (steps * spec.n_params) if steps else float("nan"),
        "compressed_bits_per_param": gb.comp_bits, "unpeeled": gb.unpeeled,
        "recovered": gb.recovered, "guard_resets": gb.guard_resets,
    }
    logger.info("final: iter %d, val loss %.4f, %.0f ms/step, grad bytes/rank %s "
                "(gradients: %.2f bits/param/step, %s on compressed units)", iter_num,
                val_loss, summary["mean_step_ms"], gb.line(), summary["bits_per_param"],
                "none" if math.isnan(gb.comp_bits) else f"{gb.comp_bits:.2f}")
    return summary


if __name__ == "__main__":
    main()
