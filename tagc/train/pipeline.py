"""``train_gpt2.py --pp S``: the GPT-2 cut into S pipeline stages on
``torch.distributed.pipelining`` with TAGC's coded stage boundaries
(:mod:`tagc.pipeline`).

With S ranks each rank holds one stage and reads the same batch (no data parallelism).
With S x D ranks (``--fsdp 2``, PP x FSDP) each stage is an FSDP2 group of D ranks:
ranks ``s*D .. s*D+D-1`` hold stage ``s`` (torchrun numbers ranks host by host, so a
stage is a host and its FSDP2 traffic stays inside it), the ``(pp, dp)`` mesh's dp row
shards the stage's module (one unit per block, or TAGC's layout under
``--stage_tagc``) and the pp column is the pipeline; dp replica ``d`` reads batch ``d``.

Every rank builds the whole model from the same seed and keeps its stage
(:class:`~tagc.train.model.GPTStage`); the first stage feeds the token ids and the last
the targets.  ``--tagc`` names a ``tagc-pp-*`` preset (:class:`~tagc.pipeline.PipelineConfig`);
without it the boundaries send fp32, the uncompressed baseline, with the same
schedule and microbatches.  The gradient-norm clip is global (every rank's squared
norm of what it holds, summed); validation runs the pipeline's forward, codes included,
as the trained pipeline runs it (TAGC's parameter gathers exact, as for FSDP runs).
Checkpoints go through :mod:`tagc.train.checkpoint` with each stage's model, optimizer
and TAGC state under ``stage<s>`` keys; resume is bitwise (batches and learning rate are
functions of the step, nothing draws random numbers).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tagc import presets
from tagc.pipeline import BoundaryCounter, PipelineConfig, pipeline_stage
from tagc.train.checkpoint import load_checkpoint, save_checkpoint
from tagc.train.config import TrainConfig, parse_tagc_set
from tagc.train.data import TokenData
from tagc.train.metrics import MetricsLog, finish
from tagc.train.model import GPT, Block, GPTStage, stage_ranges
from tagc.train.optim import configure_optimizer, decayed_parameter_names, get_lr
from tagc.train.sharding import import_tagc, wrap_model

logger = logging.getLogger(__name__)


def pipeline_config(cfg: TrainConfig) -> PipelineConfig:
    """The run's boundary codes: ``--tagc`` (with ``--tagc_set``), or fp32."""
    if cfg.tagc is None:
        return PipelineConfig.from_dict({"format": "fp32", **parse_tagc_set(cfg.tagc_set)})
    return PipelineConfig.from_yaml(presets.resolve(cfg.tagc), parse_tagc_set(cfg.tagc_set))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class PipelineRun:
    """One rank's part of a pipelined GPT-2: its stage (sharded over the stage's dp
    group under PP x FSDP), the schedule, the optimizer.

    Args:
        cfg: the run config (``pp`` stages; ``world / pp`` ranks per stage).
        pcfg: the boundary codes.
        vocab_size: the tokenizer's vocabulary.
        rank, world: this rank and the number of ranks.
        device: this rank's device.

    Raises:
        ValueError: the ranks do not split into ``pp`` equal groups, more than one rank
            per stage without ``--fsdp 2``, ``--stage_tagc`` with one rank per stage, or
            a batch that the microbatches do not divide.
    """

    def __init__(self, cfg: TrainConfig, pcfg: PipelineConfig, vocab_size: int, rank: int,
                 world: int, device: torch.device) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if world % cfg.pp:
            raise ValueError(f"--pp {cfg.pp} needs a multiple of {cfg.pp} ranks (one "
                             f"stage each, or an FSDP2 group per stage), got {world}")
        if cfg.batch_size % pcfg.microbatches:
            raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of the "
                             f"preset's {pcfg.microbatches} microbatches")
        self.dp = world // cfg.pp
        if self.dp > 1 and cfg.fsdp != 2:
            raise ValueError(f"--pp {cfg.pp} on {world} ranks shards each stage over "
                             f"{self.dp} ranks with FSDP2: add --fsdp 2")
        if self.dp == 1 and cfg.stage_tagc is not None:
            raise ValueError("--stage_tagc codes FSDP2 inside each stage: it needs more "
                             "ranks than stages")
        self.cfg, self.pcfg, self.device = cfg, pcfg, device
        self.stages = cfg.pp
        # a stage is a host: its dp ranks are consecutive
        self.stage_index, self.dp_rank = divmod(rank, self.dp)
        self.first, self.last = self.stage_index == 0, self.stage_index == cfg.pp - 1
        gcfg = cfg.gpt_config(vocab_size)
        if pcfg.subspace_k:
            # every boundary inside the subspace: the blocks of all but the last stage
            gcfg = dataclasses.replace(
                gcfg, subspace_k=pcfg.subspace_k, subspace_seed=pcfg.subspace_seed,
                subspace_std=pcfg.subspace_std,
                subspace_layers=stage_ranges(gcfg.n_layer, cfg.pp)[-1][0])
        self.gcfg = gcfg
        full = GPT(gcfg)
        self.n_params = full.num_params()
        self.module = GPTStage(full, self.stage_index, cfg.pp).to(device)
        mesh = None
        if self.dp > 1:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(device.type, (cfg.pp, self.dp),
                                    mesh_dim_names=("pp", "dp"))
        mb = cfg.batch_size // pcfg.microbatches
        self.boundary = (mb, cfg.block_size, pcfg.subspace_k or gcfg.n_embd)
        self.counter = BoundaryCounter()
        self.stage = pipeline_stage(
            self.module, self.stage_index, cfg.pp, device, pcfg, boundary_shape=self.boundary,
            input_example=torch.zeros(mb, cfg.block_size, dtype=torch.int64),
            vocab_size=gcfg.vocab_size, counter=self.counter,
            group=mesh.get_group("pp") if mesh is not None else None)
        self.tagc_state = None
        if mesh is not None:
            tagc = import_tagc()
            tcfg = (tagc.TAGCConfig.from_yaml(presets.resolve(cfg.stage_tagc))
                    if cfg.stage_tagc is not None else None)
            # the stage module with its codec; torch.distributed.pipelining sees an
            # FSDPModule and syncs FSDP once per step, after the last microbatch
            wrap_model(self.stage.submod, cfg, tcfg, device, torch.float32, [Block],
                       mesh["dp"])
            if tcfg is not None:
                self.tagc_state = tagc.register(self.stage.submod, tcfg)
        sched = ScheduleGPipe if pcfg.schedule == "gpipe" else Schedule1F1B
        self.schedule = sched(self.stage, n_microbatches=pcfg.microbatches, loss_fn=_loss)
        self.optimizer = configure_optimizer(self.module, decayed_parameter_names(self.module),
                                             cfg.weight_decay, cfg.learning_rate,
                                             (cfg.beta1, cfg.beta2))
        layout = self.stage.submod.layout
        # what crosses all boundaries in one step, both ways, for one dp replica
        self.step_bytes = 2 * (cfg.pp - 1) * pcfg.microbatches * layout.message_bytes
        self.step_bytes_fp32 = 2 * (cfg.pp - 1) * pcfg.microbatches * 4 * math.prod(
            (mb, cfg.block_size, gcfg.n_embd))

    def _run(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
        """One pass of the schedule over a batch; the mean loss over the dp replicas'
        batches, on every rank."""
        losses: List[torch.Tensor] = []
        call = self.schedule.step if train else self.schedule.eval
        if self.first:
            call(x.to(self.device))
        elif self.last:
            call(target=y.to(self.device), losses=losses)
        else:
            call()
        total = torch.zeros(1, dtype=torch.float64)
        if self.last:
            total += sum(float(v.detach()) for v in losses) / len(losses)
        # the loss lives on the last stage's ranks: one 8-byte all-reduce tells every rank
        dist.all_reduce(total)
        return float(total.item()) / self.dp

    def train_step(self, data: TokenData, it: int, lr: float) -> float:
        """One optimizer step; returns the batch's mean loss."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # every stage of a dp replica reads that replica's batch
        x, y = data.get_batch("train", self.cfg.batch_size, self.cfg.block_size,
                              (self.cfg.seed, 0, it, self.dp_rank, 0))
        loss = self._run(x, y, train=True)
        if self.cfg.grad_clip > 0:
            self._clip(self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _clip(self, max_norm: float) -> None:
        """clip_grad_norm_ over the whole model: every rank's squared norm of what it
        holds (its stage, or its FSDP2 shard of it) summed over all ranks."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros(1, dtype=torch.float64)
        for g in local:
            sq += g.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        total = float(sq.sqrt().item())
        # torch.nn.utils.clip_grad_norm_'s rule
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in local:
                g.mul_(coef)

    @torch.no_grad()
    def val_loss(self, data: TokenData) -> float:
        """Mean validation loss over eval_iters fixed batches per dp replica (through
        the pipeline, its codes included; TAGC's parameter gathers exact)."""
        self.module.eval()
        exact = (self.tagc_state.exact_gathers() if self.tagc_state is not None
                 else contextlib.nullcontext())
        tot = 0.0
        with exact:
            for k in range(self.cfg.eval_iters):
                x, y = data.get_batch("val", self.cfg.batch_size, self.cfg.block_size,
                                      (self.cfg.seed, 1, k, self.dp_rank))
                tot += self._run(x, y, train=False)
        self.module.train()
        return tot / self.cfg.eval_iters

    def stage_bytes(self) -> torch.Tensor:
        """TAGC's traffic inside this rank's stage so far, and what plain fp32 FSDP2
        sends for the same calls (the hook's ideal ring counts at the call):
        ``[reduce-scatter sent, plain, gathers sent, plain]``, float64; zeros without
        ``--stage_tagc``.  Inside a pipeline FSDP2 gathers per microbatch, not twice a
        step, so plain FSDP2's bytes are counted at its calls, not from a formula."""
        out = torch.zeros(4, dtype=torch.float64)
        if self.tagc_state is not None:
            tot = self.tagc_state.stats()["total"]
            out += torch.tensor([tot["wire_bytes"], tot["default_wire_bytes"],
                                 tot["gather_wire_bytes"], tot["gather_default_wire_bytes"]],
                                dtype=torch.float64)
        return out

    # -- checkpoints --------------------------------------------------------------

    def _scope(self) -> str:
        return f"stage{self.stage_index}"

    def save(self, ckpt: Path, it: int) -> None:
        """Every stage's parameters, optimizer and TAGC state, under its stage's key."""
        save_checkpoint(ckpt, self.stage.submod, self.optimizer, self.tagc_state, it,
                        self.cfg, scope=self._scope())

    def load(self, ckpt: Path) -> int:
        """Restore this rank's part; returns the step it was saved at.

        Raises:
            FileNotFoundError: no complete checkpoint.
            ValueError: it was written by another stage count, rank count or code.
        """
        return load_checkpoint(ckpt, self.stage.submod, self.optimizer, self.tagc_state,
                               self.cfg, scope=self._scope(),
                               match=("pp", "tagc", "tagc_set", "stage_tagc", "fsdp"))


def run_pipeline(cfg: TrainConfig, env: Any, data: TokenData, tok: Any) -> Dict[str, Any]:
    """Train a pipelined GPT-2 (``--pp``); returns the summary (``summary.json``)."""
    if env.device.type != "cpu" and env.param_dtype != torch.float32:
        raise NotImplementedError("pipeline runs train in fp32 (--dtype float32)")
    pcfg = pipeline_config(cfg)
    torch.manual_seed(cfg.seed)
    run = PipelineRun(cfg, pcfg, tok.vocab_size, env.rank, env.world, env.device)
    logger.info("model %s: %d layers, %d wide, %.2fM params, untied; %d pipeline stages "
                "(%s, %d microbatches); boundary %s as %s forward / %s backward%s: %d bytes "
                "per step (fp32: %d, %.1fx fewer)", cfg.model, run.gcfg.n_layer,
                run.gcfg.n_embd, run.n_params / 1e6, cfg.pp, pcfg.schedule,
                pcfg.microbatches, run.boundary, pcfg.format, pcfg.grad_format,
                f", subspace k={pcfg.subspace_k} + token ids" if pcfg.subspace_k else "",
                run.step_bytes, run.step_bytes_fp32, run.step_bytes_fp32 / run.step_bytes)
    out_dir = Path(cfg.out_dir)
    ckpt = out_dir / "ckpt"
    it = 0
    if cfg.init_from == "resume":
        it = run.load(ckpt)
        logger.info("resumed from %s at iter %d", ckpt, it)
    metrics = MetricsLog(out_dir, env.master, cfg.tensorboard, cfg.init_from == "resume")
    if env.master:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {**dataclasses.asdict(cfg), "pipeline": dataclasses.asdict(pcfg)}, indent=1))
    step_times: List[float] = []
    val = float("nan")
    t_start = time.perf_counter()
    tokens = cfg.batch_size * cfg.block_size * run.dp
    inner0 = run.stage_bytes()
    while True:
        if it % cfg.eval_interval == 0 or it == cfg.max_iters:
            val = run.val_loss(data)
            logger.info("iter %d: val loss %.4f", it, val)
            metrics.write(kind="val", iter=it, loss=val,
                          elapsed_s=time.perf_counter() - t_start, train_s=sum(step_times))
        if cfg.ckpt_interval and it % cfg.ckpt_interval == 0 and 0 < it < cfg.max_iters:
            run.save(ckpt, it)
        if it >= cfg.max_iters:
            break
        t0 = time.perf_counter()
        lr = get_lr(it, cfg)
        loss = run.train_step(data, it, lr)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        it += 1
        if it % cfg.log_interval == 0 or it == cfg.max_iters:
            logger.info("iter %d: loss %.4f, lr %.2e, %.0f ms/step, %.0f tok/s, boundary "
                        "bytes/step %d", it, loss, lr, dt * 1000, tokens / dt, run.step_bytes)
            metrics.write(kind="train", iter=it, loss=loss, lr=lr, step_ms=dt * 1000,
                          tokens_per_s=tokens / dt, bytes_sent=run.step_bytes,
                          bytes_uncompressed=run.step_bytes_fp32,
                          elapsed_s=time.perf_counter() - t_start, train_s=sum(step_times))
    if cfg.save_checkpoint:
        run.save(ckpt, it)
    steady = step_times[min(5, len(step_times) // 2):]
    counts = torch.tensor([run.counter.counts[k] for k in sorted(run.counter.counts)],
                          dtype=torch.int64)
    dist.all_reduce(counts)  # each rank counted what it sent
    inner = run.stage_bytes() - inner0
    dist.all_reduce(inner)  # every rank's FSDP2 traffic inside its stage
    per_step = (inner / max(1, len(step_times))).tolist()
    summary = {
        "iters": it, "steps_this_run": len(step_times), "final_val_loss": val,
        "mean_step_ms": 1000 * sum(steady) / len(steady) if steady else float("nan"),
        "n_params": run.n_params, "world_size": env.world, "pp": cfg.pp, "dp": run.dp,
        "tokenizer": tok.name, "tagc": cfg.tagc, "pipeline": dataclasses.asdict(pcfg),
        "stage_tagc": cfg.stage_tagc,
        # one dp replica's boundaries (each replica has its own)
        "boundary_bytes_per_step": run.step_bytes,
        "boundary_bytes_per_step_fp32": run.step_bytes_fp32,
        "boundary_ratio": run.step_bytes_fp32 / run.step_bytes,
        # messages summed over every rank (dp replicas and stages)
        "sent": dict(zip(sorted(run.counter.counts), counts.tolist())),
    }
    if run.tagc_state is not None:
        # PP x FSDP with TAGC: all ranks' FSDP2 traffic inside the stages per step
        summary.update(stage_rs_bytes_per_step=per_step[0],
                       stage_rs_bytes_per_step_plain=per_step[1],
                       stage_gather_bytes_per_step=per_step[2],
                       stage_gather_bytes_per_step_plain=per_step[3])
    logger.info("final: iter %d, val loss %.4f, %.0f ms/step, boundary bytes/step %d "
                "(%.1fx fewer than fp32)", it, val, summary["mean_step_ms"], run.step_bytes,
                summary["boundary_ratio"])
    if run.tagc_state is not None:
        logger.info("inside the stages (FSDP2 over %d ranks each, %s): reduce-scatters %.0f "
                    "bytes/step (plain FSDP2: %.0f), gathers %.0f (%.0f), all ranks", run.dp,
                    cfg.stage_tagc, *per_step)
    return finish(env, out_dir, summary, metrics)
