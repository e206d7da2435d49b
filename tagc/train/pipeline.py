"""``train_gpt2.py --pp S``: the GPT-2 cut into S pipeline stages, one per rank, on
``torch.distributed.pipelining`` with TAGC's coded stage boundaries
(:mod:`tagc.pipeline`).

Every rank builds the whole model from the same seed and keeps its stage
(:class:`~tagc.train.model.GPTStage`); every rank reads the same batch (there is no
data parallelism), the first stage feeds the token ids and the last the targets.
``--tagc`` names a ``tagc-pp-*`` preset (:class:`~tagc.pipeline.PipelineConfig`);
without it the boundaries send fp32, the uncompressed baseline, with the same
schedule and microbatches.  The gradient-norm clip is global (the stages' squared
norms summed); validation runs the pipeline's forward, codes included, as the trained
pipeline runs it.  Checkpoints: one file per stage (``ckpt/stage<s>.pt``, its
parameters and optimizer state), written atomically; resume is bitwise (batches and
learning rate are functions of the step, nothing draws random numbers).
"""
from __future__ import annotations

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
from tagc.train.config import TrainConfig, parse_tagc_set
from tagc.train.data import TokenData
from tagc.train.metrics import MetricsLog, finish
from tagc.train.model import GPT, GPTStage, stage_ranges
from tagc.train.optim import configure_optimizer, decayed_parameter_names, get_lr

logger = logging.getLogger(__name__)


def pipeline_config(cfg: TrainConfig) -> PipelineConfig:
    """The run's boundary codes: ``--tagc`` (with ``--tagc_set``), or fp32."""
    if cfg.tagc is None:
        return PipelineConfig.from_dict({"format": "fp32", **parse_tagc_set(cfg.tagc_set)})
    return PipelineConfig.from_yaml(presets.resolve(cfg.tagc), parse_tagc_set(cfg.tagc_set))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class PipelineRun:
    """One rank's stage of a pipelined GPT-2: the model part, its schedule, optimizer.

    Args:
        cfg: the run config (``pp`` stages, one per rank).
        pcfg: the boundary codes.
        vocab_size: the tokenizer's vocabulary.
        rank, device: this rank.
    """

    def __init__(self, cfg: TrainConfig, pcfg: PipelineConfig, vocab_size: int, rank: int,
                 device: torch.device) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        if cfg.batch_size % pcfg.microbatches:
            raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of the "
                             f"preset's {pcfg.microbatches} microbatches")
        self.cfg, self.pcfg, self.rank, self.device = cfg, pcfg, rank, device
        self.stages = cfg.pp
        self.first, self.last = rank == 0, rank == cfg.pp - 1
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
        self.module = GPTStage(full, rank, cfg.pp).to(device)
        mb = cfg.batch_size // pcfg.microbatches
        self.boundary = (mb, cfg.block_size, pcfg.subspace_k or gcfg.n_embd)
        self.counter = BoundaryCounter()
        self.stage = pipeline_stage(
            self.module, rank, cfg.pp, device, pcfg, boundary_shape=self.boundary,
            input_example=torch.zeros(mb, cfg.block_size, dtype=torch.int64),
            vocab_size=gcfg.vocab_size, counter=self.counter)
        sched = ScheduleGPipe if pcfg.schedule == "gpipe" else Schedule1F1B
        self.schedule = sched(self.stage, n_microbatches=pcfg.microbatches, loss_fn=_loss)
        self.optimizer = configure_optimizer(self.module, decayed_parameter_names(self.module),
                                             cfg.weight_decay, cfg.learning_rate,
                                             (cfg.beta1, cfg.beta2))
        layout = self.stage.submod.layout
        # what crosses all boundaries in one step, both ways
        self.step_bytes = 2 * (cfg.pp - 1) * pcfg.microbatches * layout.message_bytes
        self.step_bytes_fp32 = 2 * (cfg.pp - 1) * pcfg.microbatches * 4 * math.prod(
            (mb, cfg.block_size, gcfg.n_embd))

    def _run(self, x: torch.Tensor, y: torch.Tensor, train: bool) -> float:
        """One pass of the schedule over a batch; the mean loss, on every rank."""
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
        # the loss lives on the last stage: one 8-byte all-reduce tells every rank
        dist.all_reduce(total)
        return float(total.item())

    def train_step(self, data: TokenData, it: int, lr: float) -> float:
        """One optimizer step; returns the batch's mean loss."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # the same batch on every stage: the pipeline is the only parallelism
        x, y = data.get_batch("train", self.cfg.batch_size, self.cfg.block_size,
                              (self.cfg.seed, 0, it, 0, 0))
        loss = self._run(x, y, train=True)
        if self.cfg.grad_clip > 0:
            self._clip(self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def _clip(self, max_norm: float) -> None:
        """clip_grad_norm_ over the whole model: the stages' squared norms summed."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        dist.all_reduce(sq)
        total = float(sq.sqrt().item())
        # torch.nn.utils.clip_grad_norm_'s rule
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    @torch.no_grad()
    def val_loss(self, data: TokenData) -> float:
        """Mean validation loss over eval_iters fixed batches (through the pipeline)."""
        self.module.eval()
        tot = 0.0
        for k in range(self.cfg.eval_iters):
            x, y = data.get_batch("val", self.cfg.batch_size, self.cfg.block_size,
                                  (self.cfg.seed, 1, k, 0))
            tot += self._run(x, y, train=False)
        self.module.train()
        return tot / self.cfg.eval_iters

    # -- checkpoints --------------------------------------------------------------

    def _file(self, ckpt: Path) -> Path:
        return ckpt / f"stage{self.rank}.pt"

    def save(self, ckpt: Path, it: int) -> None:
        """This stage's parameters and optimizer state (written to a temp file, renamed)."""
        ckpt.mkdir(parents=True, exist_ok=True)
        path = self._file(ckpt)
        tmp = path.with_suffix(".tmp")
        torch.save({"iter": it, "stages": self.stages, "stage": self.rank,
                    "pipeline": dataclasses.asdict(self.pcfg),
                    "model": self.module.state_dict(),
                    "optim": self.optimizer.state_dict()}, tmp)
        os.replace(tmp, path)
        dist.barrier()

    def load(self, ckpt: Path) -> int:
        """Restore this stage; returns the step it was saved at.

        Raises:
            FileNotFoundError: no checkpoint of this stage.
            ValueError: it was written by another stage count, stage or code.
        """
        path = self._file(ckpt)
        if not path.is_file():
            raise FileNotFoundError(f"--init_from=resume: no {path}")
        state = torch.load(path, map_location=self.device, weights_only=False)
        if (state["stages"], state["stage"]) != (self.stages, self.rank) or \
                state["pipeline"] != dataclasses.asdict(self.pcfg):
            raise ValueError(f"{path}: saved by stage {state['stage']} of {state['stages']} "
                             f"with {state['pipeline']}; this is stage {self.rank} of "
                             f"{self.stages} with {dataclasses.asdict(self.pcfg)}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        its = torch.tensor([state["iter"]], dtype=torch.int64)
        dist.all_reduce(its, op=dist.ReduceOp.MAX)
        if int(its.item()) != state["iter"]:
            raise ValueError(f"{path}: the stages' checkpoints are of different steps")
        return int(state["iter"])


def run_pipeline(cfg: TrainConfig, env: Any, data: TokenData, tok: Any) -> Dict[str, Any]:
    """Train a pipelined GPT-2 (``--pp``); returns the summary (``summary.json``)."""
    if env.world != cfg.pp:
        raise ValueError(f"--pp {cfg.pp} needs {cfg.pp} ranks (one stage each), got "
                         f"{env.world}")
    if env.device.type != "cpu" and env.param_dtype != torch.float32:
        raise NotImplementedError("pipeline runs train in fp32 (--dtype float32)")
    pcfg = pipeline_config(cfg)
    torch.manual_seed(cfg.seed)
    run = PipelineRun(cfg, pcfg, tok.vocab_size, env.rank, env.device)
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
    tokens = cfg.batch_size * cfg.block_size
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
    dist.all_reduce(counts)  # each stage counted what it sent
    summary = {
        "iters": it, "steps_this_run": len(step_times), "final_val_loss": val,
        "mean_step_ms": 1000 * sum(steady) / len(steady) if steady else float("nan"),
        "n_params": run.n_params, "world_size": env.world, "pp": cfg.pp,
        "tokenizer": tok.name, "tagc": cfg.tagc, "pipeline": dataclasses.asdict(pcfg),
        "boundary_bytes_per_step": run.step_bytes,
        "boundary_bytes_per_step_fp32": run.step_bytes_fp32,
        "boundary_ratio": run.step_bytes_fp32 / run.step_bytes,
        "sent": dict(zip(sorted(run.counter.counts), counts.tolist())),
    }
    logger.info("final: iter %d, val loss %.4f, %.0f ms/step, boundary bytes/step %d "
                "(%.1fx fewer than fp32)", it, val, summary["mean_step_ms"], run.step_bytes,
                summary["boundary_ratio"])
    return finish(env, out_dir, summary, metrics)
