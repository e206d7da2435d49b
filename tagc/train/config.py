"""Run configuration: the config dataclasses and their command line.

Settings come from the dataclass defaults, then YAML files (a bare ``.yaml`` argument or
``--config PATH``), then ``--key=value`` / ``--key value`` overrides, converted to the
field's type; an unknown key raises (with the nearest known one).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from tagc import presets
from tagc.train.model import MODEL_SIZES, GPTConfig

# the first line of --help of the GPT-2 trainer (the default of build_parser)
DESCRIPTION = "Train GPT-2 with PyTorch FSDP, with or without TAGC gradient compression."

# the module a wheel user runs; scripts/train_gpt2.py exists in a checkout only
MODULE = "tagc.train"


def entry_point() -> Tuple[str, str]:
    """How this process was started, for usage lines and launch hints.

    Returns:
        ``(command, target)``: ``("python -m tagc.train", "-m tagc.train")`` when the
        module runs (``python -m`` or ``torchrun -m``) or the caller is not a script
        (tests, a notebook), else the script's path as typed twice
        (``("scripts/train_gpt2.py", "scripts/train_gpt2.py")``).
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv0 = sys.argv[0] if sys.argv else ""
    if (spec is None or spec.name is None) and argv0.endswith(".py") \
            and Path(argv0).name != "__main__.py":
        return argv0, argv0
    return f"python -m {MODULE}", f"-m {MODULE}"


def _help_text(target: str) -> str:
    """The GPT-2 trainer's --help description: examples, then the presets by purpose.

    Args:
        target: what torchrun starts (:func:`entry_point`'s second item).
    Returns:
        the text, laid out for argparse.RawDescriptionHelpFormatter.
    """
    run = f"torchrun --standalone --nproc_per_node 2 {target}"
    lines = [DESCRIPTION, "", "examples:",
             "  # tiny GPT-2 on 2 CPU processes, gradients compressed as recommended",
             f"  {run} --tagc tagc-balanced",
             "  # FSDP2, its gradients and its parameter all-gathers compressed",
             f"  {run} --fsdp 2 --tagc tagc-full",
             "  # the paper's GPT-2 small on 2 nodes, one GPU each",
             "  torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d "
             "--rdzv_endpoint HOST:29500 \\",
             f"      {target} train-gpt2.yaml --tagc tagc-balanced",
             "", "presets (--tagc NAME; tagc-pp-* with --pp; train-* as a YAML argument):"]
    names = presets.names()
    width = max(map(len, names))
    lines += [f"  {n:<{width}}  {presets.purpose(n)}" for n in names]
    return "\n".join(lines)


def option(default: Any, help: str) -> Any:
    """A config dataclass field with its --help text.

    Args:
        default: the field's default.
        help: its line in --help.

    Returns:
        The dataclasses.field.
    """
    return field(default=default, metadata={"help": help})


@dataclass
class RunConfig:
    """The knobs of any run (data, optimisation, distribution, logging); the model's
    own knobs live in a subclass (TrainConfig here, FinetuneConfig in finetune_hf.py)."""

    # I/O
    out_dir: str = option("out/gpt2", "run folder: metrics.csv, summary.json, ckpt/, tb/")
    init_from: str = option("scratch", "scratch | resume (from out_dir/ckpt)")
    eval_interval: int = option(50, "steps between validation estimates")
    eval_iters: int = option(8, "batches per rank in a validation estimate")
    log_interval: int = option(10, "steps between log lines and metrics rows")
    ckpt_interval: int = option(0, "steps between checkpoints; 0: only at the end")
    save_checkpoint: bool = option(True, "save a checkpoint at the end of the run")
    keep_checkpoints: int = option(2, "checkpoints kept in out_dir/ckpt (the newest K; >= 1)")
    resume_from: str = option("latest", "with init_from=resume: latest | previous (the one "
                                        "before the newest) | a step number")
    nonfinite_patience: int = option(0, "consecutive steps with a non-finite train loss "
                                        "tolerated before the run stops with an error")
    timeout: float = option(300.0, "seconds a collective may wait for a peer before the "
                                   "process group fails (init_process_group's timeout)")
    progress: bool = option(True, "tqdm progress bar on rank 0")
    tensorboard: bool = option(True, "TensorBoard logs in out_dir/tb (if installed)")
    # data
    data: str = option("stdlib", "stdlib (built-in, offline) | openwebtext | a folder of "
                                 "text files")
    tokenizer: str = option("auto", "auto (GPT-2 BPE if tiktoken's files are cached, else "
                                    "bytes) | gpt2 | byte")
    cache_dir: str = option("data_cache", "token cache folder")
    val_percent: float = option(5.0, "share of the documents kept for validation")
    block_size: int = option(128, "context length (tokens)")
    # optimisation
    batch_size: int = option(8, "sequences per rank per micro step")
    grad_accum: int = option(1, "micro steps per optimizer step")
    max_iters: int = option(150, "optimizer steps")
    learning_rate: float = option(1e-3, "peak learning rate (AdamW)")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = option(20, "linear learning-rate warm-up steps")
    lr_decay_iters: int = option(0, "steps of the cosine decay; 0: max_iters")
    weight_decay: float = option(0.1, "AdamW weight decay of matrices and embeddings")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    grad_clip: float = option(1.0, "gradient-norm clip; 0: off")
    seed: int = option(1337, "seed of the model init and the batches")
    # distributed
    fsdp: int = option(1, "1: FullyShardedDataParallel, 2: fully_shard")
    sharding: str = option("FULL_SHARD", "FULL_SHARD | SHARD_GRAD_OP")
    replicas: int = option(1, "FSDP2: HSDP over this many replicas (nodes; ranks are numbered "
                              "node by node): shard inside a replica, replicate across; "
                              "TAGC's HSDP route with --tagc, native HSDP without")
    ft_lighthouse: str = option("", "torchft: the Lighthouse's address (http://HOST:PORT); "
                                    "this torchrun job is then one replica group of a run "
                                    "that goes on when groups fail and rejoin (FSDP2 inside, "
                                    "--tagc or fp32 between groups; docs/TORCHFT.md)")
    ft_replica: int = option(0, "torchft: this replica group's index (its name and its data)")
    ft_min_replicas: int = option(1, "torchft: the fewest replica groups a step commits with")
    ft_hostname: str = option("", "torchft: the address other groups reach this one's "
                                  "manager at (default: this machine's host name)")
    ft_allreduce: str = option("tagc", "torchft: tagc (--tagc's codes between groups) | "
                                       "torchft (its fp32 all-reduce, the preset's local "
                                       "steps kept: a baseline)")
    tagc: Optional[str] = option(None, "a TAGC preset by name (tagc-balanced, full, lean, ...) "
                                 "or a YAML file; none: plain FSDP")
    tagc_set: str = option("", "preset fields to override, e.g. dense_steps=2000,theta=0.9")
    wrap: str = option("auto", "unit layout: auto | block | tagc (tagc: the hook's layout)")
    device: str = option("auto", "auto | cpu | cuda")
    dtype: str = option("auto", "auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16")
    threads: int = option(0, "CPU threads per rank; 0: cores / local ranks")

    def validate(self) -> None:
        """Raise ValueError on any inconsistent setting."""
        def one_of(name: str, allowed: Sequence[Any]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name} must be one of {list(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        one_of("init_from", ("scratch", "resume"))
        one_of("tokenizer", ("auto", "gpt2", "byte"))
        one_of("fsdp", (1, 2))
        one_of("sharding", ("FULL_SHARD", "SHARD_GRAD_OP"))
        one_of("wrap", ("auto", "block", "tagc"))
        one_of("device", ("auto", "cpu", "cuda"))
        one_of("dtype", ("auto", "float32", "bfloat16"))
        one_of("ft_allreduce", ("tagc", "torchft"))
        for name in ("eval_interval", "eval_iters", "log_interval", "block_size",
                     "batch_size", "grad_accum", "max_iters"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"--keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.resume_from not in ("latest", "previous") and not self.resume_from.isdigit():
            raise ValueError("--resume_from must be latest, previous or a step number, got "
                             f"{self.resume_from!r}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")
        for name in ("ckpt_interval", "warmup_iters", "lr_decay_iters", "threads", "seed",
                     "nonfinite_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.learning_rate:
            raise ValueError("--min_lr must not exceed --learning_rate")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("--beta1 and --beta2 must be in [0, 1)")
        if not 0 < self.val_percent < 100:
            raise ValueError("--val_percent must be in (0, 100)")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replicas > 1 and self.fsdp != 2:
            raise ValueError("--replicas > 1 (HSDP) needs --fsdp 2 (FSDP1 allows no comm hook "
                             "on HYBRID_SHARD)")
        if self.ft_lighthouse:
            if self.fsdp != 2 or self.replicas != 1:
                raise ValueError("--ft_lighthouse needs --fsdp 2 and --replicas 1: each "
                                 "torchrun job is one replica group, torchft replicates "
                                 "across the jobs")
        if self.ft_replica < 0 or self.ft_min_replicas < 1:
            raise ValueError("--ft_replica must be >= 0 and --ft_min_replicas >= 1, got "
                             f"{self.ft_replica} and {self.ft_min_replicas}")
        if self.wrap == "tagc" and not self.tagc:
            raise ValueError("--wrap tagc needs --tagc (the preset decides the unit layout)")
        if self.tagc_set and self.tagc is None:
            raise ValueError("--tagc_set needs --tagc (it overrides fields of the preset)")
        parse_tagc_set(self.tagc_set)
        # built here, before any rank loads data or meets its peers: a misspelt field
        # or a preset this run cannot take fails once, at the start
        self.check_tagc()

    def check_tagc(self) -> None:
        """Build ``--tagc`` with ``--tagc_set`` and check it fits this run.

        Raises:
            ValueError: unknown field (with the nearest), bad value, a pipeline preset,
                or a preset that needs FSDP2 (or HSDP) under other settings, each
                naming the option that fixes it.
        """
        if self.tagc is None:
            return
        path = presets.resolve(self.tagc)  # a clear error naming the shipped presets
        if path.name.startswith(presets.PIPELINE_PREFIX):
            raise ValueError(f"--tagc {self.tagc} codes pipeline stage boundaries: run "
                             "with --pp 2 --tie_weights=false")
        check_fsdp_needs(self, load_tagc_config(None, self))


@dataclass
class TrainConfig(RunConfig):
    """Every knob of a GPT-2 run. Defaults: the tiny model on the built-in corpus,
    ~1-2 min on 2 cores."""

    model: str = option("tiny", f"model size: {' | '.join(MODEL_SIZES)}")
    n_layer: int = option(0, "transformer blocks; 0: from --model")
    n_head: int = option(0, "attention heads; 0: from --model")
    n_embd: int = option(0, "model width; 0: from --model")
    dropout: float = option(0.0, "dropout probability (0 keeps runs deterministic)")
    bias: bool = option(True, "biases in Linear and LayerNorm layers")
    tie_weights: bool = option(True, "share the token embedding with the LM head")
    pp: int = option(1, "pipeline stages, one per rank (torch.distributed.pipelining); "
                        "--tagc then names a tagc-pp-* preset (the stage boundaries' "
                        "codes), none: fp32 boundaries; needs --tie_weights=false")
    stage_tagc: Optional[str] = option(
        None, "PP x FSDP (--pp with pp x dp ranks, --fsdp 2): the TAGC preset of FSDP2's "
              "exchanges inside each stage's dp group (tagc-full, tagc-balanced, ...); "
              "none: plain FSDP2 there")

    def validate(self) -> None:
        super().validate()
        if self.model not in MODEL_SIZES:
            raise ValueError(f"--model must be one of {list(MODEL_SIZES)}, got {self.model!r}")
        if self.pp < 1:
            raise ValueError(f"--pp must be >= 1, got {self.pp}")
        if self.pp > 1:
            # the embedding and the LM head sit on different stages, in every run of a
            # comparison (the fp32 baseline too): untying must be asked for, not implied
            if self.tie_weights:
                raise ValueError("--pp needs --tie_weights=false (the token embedding and "
                                 "the LM head sit on different stages)")
            if self.dropout:
                raise ValueError("--pp keeps dropout 0 (bitwise resume, exact subspace)")
            if self.replicas > 1 or self.grad_accum > 1:
                raise ValueError("--pp takes neither --replicas nor --grad_accum (the "
                                 "preset's microbatches split the batch)")
        if self.stage_tagc is not None:
            if self.pp == 1:
                raise ValueError("--stage_tagc needs --pp (it codes FSDP2 inside each "
                                 "stage; without a pipeline, --tagc does that)")
            build_preset("tagc", self.stage_tagc, "", "--stage_tagc")
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")

    def check_tagc(self) -> None:
        """With ``--pp``, ``--tagc`` names the stage boundaries' codes (a tagc-pp-*
        preset, :class:`~tagc.pipeline.PipelineConfig`); else as RunConfig."""
        if self.pp == 1:
            super().check_tagc()
        elif self.tagc is not None:
            path = presets.resolve(self.tagc)
            # a shipped data-parallel preset here is a mix-up; a user's file is a
            # PipelineConfig or fails on its first unknown field
            if path.parent.resolve() == presets.config_dir().resolve() and \
                    not path.name.startswith(presets.PIPELINE_PREFIX):
                raise ValueError(f"--pp: --tagc names the stage boundaries' codes, a "
                                 f"{presets.PIPELINE_PREFIX}* preset, not {self.tagc!r}; "
                                 "--stage_tagc codes FSDP2 inside each stage")
            build_preset("pipeline", self.tagc, self.tagc_set)

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
    scales them here, e.g. ``--tagc_set dense_steps=2000,warmup_steps=10000``.  The
    overrides apply to the fields the preset file writes, so a knob whose default
    follows another (``ef21_damping`` follows ``ef21``, ``guard_ratio`` the feedback)
    follows the override too: ``--tagc_set ef21=false`` on an EF21 preset works.

    Args:
        tagc: TAGC's entry points (``tagc.train.sharding.import_tagc()``) or None
            (tagc.config's TAGCConfig).
        cfg: the run config.
    Returns:
        the validated TAGCConfig.
    Raises:
        ValueError: see :func:`build_preset`.
    """
    cls = tagc.TAGCConfig if tagc is not None else None
    return build_preset("tagc", cfg.tagc, cfg.tagc_set, cls=cls)


def build_preset(kind: str, name: str, spec: str, flag: str = "--tagc",
                 cls: Any = None) -> Any:
    """A preset file with ``--tagc_set`` overrides, its errors in the options' words.

    Args:
        kind: ``"tagc"`` (TAGCConfig) or ``"pipeline"`` (PipelineConfig, ``--pp``).
        name: the preset's name or YAML file.
        spec: the ``--tagc_set`` text (may be empty).
        flag: the option that named the preset, for messages.
        cls: the config class to build instead of kind's.
    Returns:
        the validated config.
    Raises:
        ValueError: an unknown field (with the nearest known one) in the file or in
            ``--tagc_set``, or a bad value (the config's message, then the options).
    """
    if cls is None:
        if kind == "pipeline":
            from tagc.pipeline import PipelineConfig as cls
        else:
            from tagc.config import TAGCConfig as cls
    path = presets.resolve(name)
    mapping, overrides = presets.load_mapping(path), parse_tagc_set(spec)
    known = [f.name for f in dataclasses.fields(cls)]
    for where, keys in ((f"{flag} {name}: {path.name}", mapping),
                        ("--tagc_set", overrides)):
        for key in keys:
            if key not in known:
                raise ValueError(f"{where}: unknown field {key!r}{_did_you_mean(key, known)}")
    try:
        return cls.from_dict({**mapping, **overrides})
    except ValueError as exc:
        raise ValueError(f"{exc} ({flag} {name}"
                         + (f" --tagc_set {spec})" if spec else ")")) from None


def check_fsdp_needs(cfg: "RunConfig", tcfg: Any) -> None:
    """Refuse a TAGC config whose features this run's sharding does not have.

    Args:
        cfg: the run config.
        tcfg: its TAGCConfig.
    Raises:
        ValueError: naming the option that fixes it.
    """
    via = f"--tagc {cfg.tagc}" + (f" --tagc_set {cfg.tagc_set}" if cfg.tagc_set else "")
    if cfg.ft_lighthouse:
        # FTAllReduce's refusals, what torchft's DiLoCo (the fp32 baseline) lacks, and
        # the gathers inside a group (FSDP2 runs plain there): each with the override
        # that lifts it
        fp32 = cfg.ft_allreduce == "torchft"
        if fp32 and tcfg.outer_every and cfg.init_from == "resume":
            raise ValueError(f"{via} --ft_allreduce torchft runs torchft's DiLoCo, whose "
                             "outer state is not in the checkpoint: --init_from resume "
                             "takes --ft_allreduce tagc")
        for key, bad, fix in (("outer_fragments", fp32 and tcfg.outer_fragments > 1, 1),
                              ("ef21", tcfg.ef21, "false"),
                              ("bypass_every", tcfg.bypass_every, 0),
                              ("gather", tcfg.gather != "none", "none")):
            if bad:
                raise ValueError(f"{via} sets {key}={getattr(tcfg, key)}, which "
                                 "--ft_lighthouse does not take yet (docs/TORCHFT.md): add "
                                 f"--tagc_set {key}={fix}")
        return
    if tcfg.gather != "none" and cfg.fsdp != 2:
        # FSDP1 has no hook on its parameter all-gathers: register would refuse
        raise ValueError(f"{via} quantizes FSDP2's parameter all-gathers "
                         f"(gather={tcfg.gather}): run with --fsdp 2 (or --tagc_set "
                         "gather=none)")
    if tcfg.outer_every and cfg.replicas < 2:
        raise ValueError(f"{via} takes local steps between nodes (outer_every="
                         f"{tcfg.outer_every}) on TAGC's HSDP route: run with --fsdp 2 "
                         "--replicas R (R > 1 nodes)")


def _did_you_mean(key: Any, known: Sequence[str], prefix: str = "") -> str:
    """``"; did you mean X?"`` for the nearest known name, or nothing."""
    near = difflib.get_close_matches(str(key), known, n=1)
    return f"; did you mean {prefix}{near[0]}?" if near else ""


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

    def print_help(self, file: Any = None) -> None:
        # under torchrun every rank parses the same line: one copy of --help is enough
        if os.environ.get("RANK", "0") == "0":
            super().print_help(file)


def _option_type(name: str, tp: Any) -> Any:
    """The argparse ``type`` of a field: _convert, its errors in argparse's words."""
    def convert(raw: str) -> Any:
        try:
            return _convert(name, tp, raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(tp, "__name__", str(tp))
    return convert


def build_parser(cls: type = None, prog: Optional[str] = None,
                 description: str = "") -> argparse.ArgumentParser:
    """The command line of a config dataclass: one option per field (type, default and
    help from the dataclass), plus YAML files (positional or ``--config``).

    Args:
        cls: the config dataclass (default TrainConfig).
        prog: the command in the usage line (default: how this process was started,
            :func:`entry_point`).
        description: the --help text before the options (default: the GPT-2
            trainer's, with examples and the shipped presets).

    Returns:
        The parser (its ``error`` raises ValueError).
    """
    cls = cls or TrainConfig
    command, target = entry_point()
    hints = typing.get_type_hints(cls)
    p = _Parser(prog=prog or command, description=description or _help_text(target),
                usage="%(prog)s [YAML ...] [--KEY VALUE ...]",
                formatter_class=argparse.RawDescriptionHelpFormatter,
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
                 prog: Optional[str] = None, description: str = "") -> Any:
    """Build a config (default TrainConfig) from defaults, YAML files and options.

    Args:
        argv: arguments without the program name (default sys.argv[1:]). Accepted forms:
            ``file.yaml``, ``--config file.yaml``, ``--key=value``, ``--key value``, and a
            bare ``--flag`` for booleans.
        cls: the config dataclass.
        prog, description: the command in messages (default: how this process was
            started), its --help text.

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
        raise ValueError(f"unknown config key {arg.partition('=')[0]!r}"
                         f"{_did_you_mean(key, names, '--')} "
                         f"({parser.prog} --help lists them)")
    given = vars(args)
    yaml_files = list(given.pop("yaml", [])) + list(given.pop("yaml_opt", None) or [])
    hints = typing.get_type_hints(cls)
    values: Dict[str, Any] = {}
    for path in yaml_files:
        if not path.endswith((".yaml", ".yml")):
            raise ValueError(f"unexpected argument {path!r} (settings files end in .yaml; "
                             "options are --key=value)")
        import yaml
        with open(presets.resolve(path)) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        for key, value in loaded.items():
            if key not in hints:
                raise ValueError(f"{path}: unknown config key {key!r}"
                                 f"{_did_you_mean(key, names)}")
            values[key] = _convert(key, hints[key], value)
    values.update(given)  # already converted by the options' types
    cfg = cls(**values)
    cfg.validate()
    return cfg
