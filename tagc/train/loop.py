"""The training loop: process group and device, data, sharding, TAGC, steps, evaluation,
metrics and checkpoints; ``main(argv)`` is scripts/train_gpt2.py.

A model family plugs in as a :class:`ModelSpec` (``gpt_spec`` here, ``hf_spec`` in
:mod:`tagc.train.hf`) and a :class:`~tagc.train.config.RunConfig` subclass.
``--init_from=resume`` continues bit-exactly on CPU (batches and learning rate are pure
functions of the iteration number).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import signal
import sys
import time
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc import teardown
from tagc.train.checkpoint import load_checkpoint, save_checkpoint
from tagc.train.data import TokenData, prepare_distributed
from tagc.train.health import StepHealth
from tagc.train.config import (RunConfig, TrainConfig, entry_point, load_tagc_config,
                               parse_config)
from tagc.train.metrics import GradBytes, MetricsLog, finish
from tagc.train.model import GPT, Block
from tagc.train.optim import configure_optimizer, decayed_parameter_names, get_lr
from tagc.train.sharding import device_mesh, grad_sync, import_tagc, wrap_model

logger = logging.getLogger(__name__)


# seconds a rank other than 0 waits before exiting on a config error (config_error)
QUIET_RANK_DELAY_S = 3.0


def require_launcher(script: str, target: Optional[str] = None) -> None:
    """Exit with how to start ``script`` when no launcher set up the process group.

    torch's own error ("environment variable RANK expected") does not say that the
    script is meant to run under torchrun, one process per device.

    Args:
        script: the command as the user runs it (``python -m tagc.train``).
        target: what torchrun starts (``-m tagc.train``); default ``script``.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise SystemExit(
            f"{script}: start it with torchrun, one process per device, e.g.\n"
            f"    torchrun --standalone --nproc_per_node 2 {target or script} [options]\n"
            f"(not set: {', '.join(missing)}; {script} --help lists the options)")


def config_error(command: str, exc: Exception) -> typing.NoReturn:
    """Exit 2 on a bad command line, the message printed by rank 0 only.

    Every rank parses the same command line and fails the same way, before any of
    them loads data or joins the process group, so one copy tells it all.

    Args:
        command: the command in the message (:func:`entry_point`).
        exc: the error.
    """
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"usage: {command} [YAML ...] [--KEY VALUE ...]\n"
                         f"{command}: error: {exc}\n")
    else:
        # torchrun stops every rank once one exits: the others give rank 0 the time
        # to print before they do
        time.sleep(QUIET_RANK_DELAY_S)
    sys.exit(2)


class _TqdmHandler(logging.Handler):
    """Log through tqdm.write so lines do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        tqdm.write(self.format(record), file=sys.stdout)


@torch.no_grad()
def estimate_val_loss(model: nn.Module, data: TokenData, cfg: RunConfig,
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


def setup(cfg: RunConfig, script: str, target: Optional[str] = None) -> Env:
    """Process group (from torchrun's environment unless one exists), device, dtype, logging.

    Args:
        cfg: the run config.
        script: the command, for the message when torchrun did not start it.
        target: what torchrun starts (default ``script``).
    Returns:
        this rank's :class:`Env`.
    """
    # Linear layers wrapped on their own (TAGC's unit layout) return views of their matmul;
    # FSDP2 warns in case the caller modifies them in place, which these models never do.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    own_pg = not dist.is_initialized()
    if own_pg:
        require_launcher(script, target)
        # a collective waits at most this long for a peer (a stalled one included)
        # before the group fails; torch's default, 30 minutes, passes for a hang
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.timeout))
        # plain runs too: gloo's workers may touch Python at exit (tagc/teardown.py)
        teardown.install()
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
    log = logging.getLogger("tagc.train")  # the package's log: every module's lines
    if not log.handlers:
        handler = _TqdmHandler() if cfg.progress else logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # the token cache's details (tokenizer fallback, tokenizing) stay out of the run's
    # log: load_data logs the line that matters
    logging.getLogger(TokenData.__module__).setLevel(logging.WARNING)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    return Env(rank, world, rank == 0, device, param_dtype, own_pg)


def load_data(cfg: RunConfig, tokenizer: Any = None) -> Tuple[TokenData, Any]:
    """The token data of ``--data`` (prepared by local rank 0), and its tokenizer.

    Args:
        cfg: run config.
        tokenizer: a :class:`~tagc.train.data.Tokenizer` to use instead of ``cfg.tokenizer``.
    """
    meta, tok = prepare_distributed(cfg.data, tokenizer or cfg.tokenizer,
                                    Path(cfg.cache_dir), cfg.val_percent)
    logger.info("data: %s, tokenizer: %s (vocab %d)%s, tokens train %d / val %d",
                meta["source"], tok.name, tok.vocab_size,
                " - GPT-2 BPE files not in tiktoken's cache, byte-level fallback"
                if tok.name == "byte" and cfg.tokenizer == "auto" and tokenizer is None else "",
                meta["tokens"]["train"], meta["tokens"]["val"])
    return TokenData(meta), tok


def gpt_spec(cfg: TrainConfig, env: Env, vocab_size: int) -> ModelSpec:
    """The GPT-2 of :mod:`tagc.train.model`, sized by ``cfg``."""
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
    command, target = entry_point()
    try:
        cfg = parse_config(argv, prog=command)  # the TAGC config too: before any data
    except ValueError as exc:
        if argv is not None:
            raise
        config_error(command, exc)
    env = setup(cfg, command, target)
    data, tok = load_data(cfg)
    if cfg.pp > 1:
        from tagc.train.pipeline import run_pipeline
        return run_pipeline(cfg, env, data, tok)
    return run(cfg, env, gpt_spec(cfg, env, tok.vocab_size), data, tok)


def run(cfg: RunConfig, env: Env, spec: ModelSpec, data: TokenData,
        tok: Any) -> Dict[str, Any]:
    """Shard, register TAGC, train, evaluate, checkpoint; returns the summary."""
    tagc_cfg = tagc_state = None
    if cfg.tagc is not None:
        tagc = import_tagc()
        tagc_cfg = load_tagc_config(tagc, cfg)
    mesh = device_mesh(cfg, env.device)
    model = wrap_model(spec.module, cfg, tagc_cfg, env.device, env.param_dtype, spec.blocks,
                       mesh)
    optimizer = configure_optimizer(model, spec.decayed, cfg.weight_decay, cfg.learning_rate,
                                    (cfg.beta1, cfg.beta2))
    replica_group = None
    if cfg.ft_lighthouse:
        from tagc.train.ft import ReplicaGroup
        replica_group = ReplicaGroup(cfg, model, optimizer, tagc_cfg)
    elif tagc_cfg is not None:
        # local steps (outer_every) end each round from the optimizer's step hook
        tagc_state = tagc.register(model, tagc_cfg,
                                   mesh=mesh if cfg.replicas > 1 else None,
                                   optimizer=optimizer if tagc_cfg.outer_every else None)
    logger.info("%s, %.2fM params; FSDP%d %s, world %d on %s (%s), %s", spec.describe,
                spec.n_params / 1e6, cfg.fsdp, cfg.sharding, env.world, env.device.type,
                str(env.param_dtype).replace("torch.", ""),
                f"TAGC {cfg.tagc}" + (f" with {cfg.tagc_set}" if cfg.tagc_set else "")
                if cfg.tagc else "no compression (plain FSDP)")
    out_dir = Path(cfg.out_dir)
    if cfg.ft_lighthouse:  # each replica group its own metrics and checkpoints
        out_dir = out_dir / f"replica-{cfg.ft_replica}"
    iter_num = 0
    ckpt_path = out_dir / "ckpt"
    if cfg.init_from == "resume":
        own: Optional[Dict[str, Any]] = {} if replica_group is not None else None
        iter_num = load_checkpoint(ckpt_path, model, optimizer, tagc_state, cfg,
                                   rank_state=own)
        if replica_group is not None:
            replica_group.resume(own)
        logger.info("resumed from %s at iter %d", ckpt_path, iter_num)
    metrics = MetricsLog(out_dir, env.master, cfg.tensorboard, cfg.init_from == "resume")
    if env.master:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    try:
        summary = train_loop(cfg, env, spec, model, optimizer, tagc_state, data, metrics,
                             iter_num, ckpt_path, replica_group)
    finally:
        if replica_group is not None:
            replica_group.close()
    if tagc_state is not None:
        # this rank's counters since registration (resumed runs: this part)
        logger.info("%s", tagc_state.summary(cfg.tagc))
    summary.update(n_params=spec.n_params, world_size=env.world, tokenizer=tok.name,
                   tagc=cfg.tagc, fsdp=cfg.fsdp, sharding=cfg.sharding,
                   replicas=cfg.replicas)
    return finish(env, out_dir, summary, metrics)


def train_step(cfg: RunConfig, env: Env, spec: ModelSpec, model: nn.Module,
               optimizer: torch.optim.Optimizer, data: TokenData, iter_num: int,
               lr: float, commit: Optional[Callable[[], bool]] = None) -> Tuple[float, bool]:
    """One optimizer step (``grad_accum`` micro-batches).

    Args:
        commit: asked after the backward, before the optimizer steps (torchft's vote);
            False: the gradients are dropped, the optimizer does not step.
    Returns:
        the mean train loss, and whether the optimizer stepped.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    # torchft's replica groups each draw their own batches (same ranks in every group)
    shard = (env.rank, cfg.ft_replica) if cfg.ft_lighthouse else (env.rank,)
    loss_sum = torch.zeros((), device=env.device)
    for micro in range(cfg.grad_accum):
        x, y = data.get_batch("train", cfg.batch_size, cfg.block_size,
                              (cfg.seed, 0, iter_num, micro, *shard))
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
    stepped = commit is None or commit()
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / cfg.grad_accum, stepped  # .item() also waits for the device


def train_loop(cfg: RunConfig, env: Env, spec: ModelSpec, model: nn.Module,
               optimizer: torch.optim.Optimizer, tagc_state: Any, data: TokenData,
               metrics: "MetricsLog", iter_num: int, ckpt_path: Path,
               replica_group: Any = None) -> Dict[str, Any]:
    """The steps from ``iter_num`` to ``max_iters``; returns the run's numbers.

    With ``replica_group`` (:class:`tagc.train.ft.ReplicaGroup`) each step first joins
    torchft's quorum, whose committed steps are ``iter_num`` (a healed group jumps to
    its peer's), and an uncommitted step runs again.
    """
    device, world = env.device, env.world
    tokens_per_iter = cfg.batch_size * cfg.block_size * cfg.grad_accum * world
    grad_bytes = GradBytes(tagc_state, spec.n_params, world, cfg.replicas)
    step_times: List[float] = []
    val_loss = float("nan")
    from tqdm import tqdm
    bar = tqdm(total=cfg.max_iters, initial=iter_num, disable=not (env.master and cfg.progress),
               dynamic_ncols=True, desc="train", file=sys.stderr)
    t_start = time.perf_counter()
    health = StepHealth(cfg.nonfinite_patience, device)
    try:
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
                _save(cfg, model, optimizer, tagc_state, iter_num, ckpt_path, health, val_loss,
                      replica_group)
            if iter_num >= cfg.max_iters:
                break

            t0 = time.perf_counter()
            start = iter_num
            if replica_group is not None:
                iter_num = replica_group.begin(iter_num)
                if iter_num >= cfg.max_iters:
                    bar.update(iter_num - start)
                    continue  # healed to the end: the last evaluation
            lr = get_lr(iter_num, cfg)
            train_loss, stepped = train_step(
                cfg, env, spec, model, optimizer, data, iter_num, lr,
                replica_group.vote if replica_group is not None else None)
            dt = time.perf_counter() - t0
            if not stepped:
                continue
            step_times.append(dt)
            iter_num += 1
            if replica_group is not None:
                iter_num = replica_group.after_step(iter_num)
            bar.update(iter_num - start)
            if health.after_step(train_loss, iter_num):
                _save(cfg, model, optimizer, tagc_state, iter_num, ckpt_path, health, val_loss,
                      replica_group)
                logger.warning("iter %d: SIGTERM, checkpoint saved; exiting", iter_num)
                raise SystemExit(128 + signal.SIGTERM)

            grad_bytes.step()
            if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
                gb = grad_bytes
                logger.info("iter %d: loss %.4f, lr %.2e, %.0f ms/step, %.0f tok/s, grad "
                            "bytes/rank %s%s%s", iter_num, train_loss, lr, dt * 1000,
                            tokens_per_iter / dt,
                            gb.line(), f", unpeeled {int(gb.unpeeled)} (recovered "
                            f"{int(gb.recovered)})" if gb.unpeeled else "",
                            replica_group.line() if replica_group is not None else "")
                metrics.write(kind="train", iter=iter_num, loss=train_loss, lr=lr,
                              step_ms=dt * 1000, tokens_per_s=tokens_per_iter / dt,
                              bytes_sent=gb.sent, bytes_uncompressed=gb.uncompressed,
                              unpeeled=gb.unpeeled, elapsed_s=time.perf_counter() - t_start,
                              train_s=sum(step_times))
                bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{val_loss:.3f}")
        if cfg.save_checkpoint:
            _save(cfg, model, optimizer, tagc_state, iter_num, ckpt_path, health, val_loss,
                  replica_group)
    finally:
        health.close()
        bar.close()
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
    if replica_group is not None:
        summary.update(replica_group.summary())
    # what TAGC keeps across steps on this rank (the presets' budget is one
    # byte per parameter)
    mem = tagc_state.memory() if tagc_state is not None else None
    summary["feedback_bytes"] = mem["feedback_bytes"] if mem else 0
    summary["feedback_bytes_per_param"] = mem["feedback_bytes_per_param"] if mem else 0.0
    logger.info("final: iter %d, val loss %.4f, %.0f ms/step, grad bytes/rank %s "
                "(gradients: %.2f bits/param/step, %s on compressed units)%s", iter_num,
                val_loss, summary["mean_step_ms"], gb.line(), summary["bits_per_param"],
                "none" if math.isnan(gb.comp_bits) else f"{gb.comp_bits:.2f}",
                f"; feedback state {mem['feedback_bytes'] / 1e6:.1f} MB/rank "
                f"({mem['feedback_bytes_per_param']:.2f} bytes/param)" if mem else "")
    return summary


def _save(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
          tagc_state: Any, iter_num: int, ckpt_path: Path, health: StepHealth,
          val_loss: float, replica_group: Any = None) -> None:
    """Save unless the state is not finite: a checkpoint of a diverged run would push
    the last good one out of the kept ones.  A torchft replica group adds its own
    (:meth:`tagc.train.ft.ReplicaGroup.checkpoint_state`)."""
    measured = iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters
    if not health.finite or (measured and not math.isfinite(val_loss)):
        logger.warning("iter %d: not saved, the state is not finite (the newest checkpoint "
                       "is kept)", iter_num)
        return
    save_checkpoint(ckpt_path, model, optimizer, tagc_state, iter_num, cfg,
                    rank_state=replica_group.checkpoint_state()
                    if replica_group is not None else None)

