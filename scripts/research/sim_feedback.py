"""Feedback and quantizer probe: N simulated ranks in one process, FSDP2's unit layout.

The research probe behind docs/DESIGN.md section 5 ("When feedback drifts", issue 22):
it trains the teacher-student MLP of ``tagc_bench.teacher_student`` or the tiny GPT-2 of
``scripts/research/sim_ablation.py`` with quant mode's exchange simulated exactly as the hook
does it (each compressed module one unit; row r of the unit = chunk r of every
parameter, dim 0 padded to N; the owner's own row exact, the others coded in blocks
from the row's start; EF21's per-rank ``h`` and the owner's estimate), and measures:

* ``est_err``: the ranks' relative estimate error ``sum_i ||g_i - h_i||^2 / sum_i
  ||g_i||^2`` per unit before each call (EF21; with the residual feedback ``sum_i
  ||e_i||^2 / sum_i ||g_i||^2``): the statistic the hook's guard watches;
* ``out_err``: what the optimizer gets against the true sum, ``||out - sum g||^2 /
  ||sum g||^2`` (only a simulation knows the true sum);
* ``alpha``: per block of what is coded (``v = g - h`` for EF21), the contraction
  ``1 - ||C(x) - x||^2 / ||x||^2`` of several codes on the *same* blocks (median,
  5th percentile, minimum over every block of every sampled step).

Quantizers (``q=``): ``exact`` (no code: the control of an exchange's own rule), the
codec's ``sign``, ``ternary``, ``int4``, ``int8``, ``tls`` (``tagc.codec.quant_encode``
itself), and pure-torch prototypes: ``tl2`` (the L2-optimal
ternary per block: for |x| sorted descending with prefix sums c_m, keep the m entries
maximising c_m^2 / m at s = c_m / m; the same wire format as ``ternary``, only the
scale differs), ``tmax`` (ternary at s = max|x|), ``trot`` (ternary of blocks rotated by
``_tagc.rht``, a new seed per call, unrotated after decoding), ``tsr`` / ``tsrmax``
(stochastic ternary at the codec's scale / at max|x|), ``tzZ`` (ternary with a dead zone
of Z/100 mean|x| and the L2-optimal scale of what it keeps, Z in :data:`ZONES`),
``ternaryB`` / ``int4bB`` (the codec's ternary / int4 at block B, fp32 scales),
``tlogB`` (ternary with 8-bit scales: a block costs 1.75 bits per value at B = 64, as
``ternary`` at 256) and ``tsubBrR`` (ternary with two-level scales: a 4-bit log scale per
B values, R steps per octave, below each 512's largest; the prototype of the codec's
``tls``, whose group scale is coded on 8 bits where this keeps it exact).

    python3 scripts/research/sim_feedback.py --task ts ef21:q=ternary ef21:q=tl2 res:q=ternary
    python3 scripts/research/sim_feedback.py --task gpt2 --steps 300 ef21:q=ternary ef21:q=int4

Methods ``FEEDBACK:q=Q[,store=S][,guard=R][,resp=zero][,damp=1[,cut=T]][,down=Q2[,downfb=F]]``:
FEEDBACK is ``none``, ``res`` (residual) or ``ef21``; ``beta=F`` feeds back F times the
residual (``res``; 1 the default, 0 no feedback: the optimizer's per-step error is
``F e_t - e_{t+1}`` and what the telescoping leaves ``(1 - F)`` of the errors' sum); ``store=S`` keeps the residual
between calls as ``fp32`` (default), ``bf16``, ``int8`` or ``int4`` (block codes: the
memory question of issue 42); ``q=int4sr`` is int4 with stochastic rounding; ``guard=R`` resets a unit through the exact path when its
pooled ``est_err`` exceeds R (the hook's ``guard_ratio``), or with ``resp=zero``
restarts EF21 from h = 0 instead (that call sends C(g), as without feedback, at the
same bytes); ``damp=1``: every rank compresses ``g - lam h`` with the lam in [0, 1]
minimising the pooled ``||g - lam h||^2`` (the owners scale their estimates by the
same lam, which the ranks could agree on in the guard's vote), logging the pooled
``rho2 = <g, h>^2 / (||g||^2 ||h||^2)``, the fraction of the gradient's energy the
estimate predicts (0 when ``<g, h> <= 0``: lam is clipped to 0 there, so it predicts
nothing); with ``cut=T`` lam is 0 (no feedback this call) when rho2 < T.
``down=Q2``: HSDP's two-phase form with one rank per node (``--ranks`` = R): after the to-the-owner
exchange every owner codes its row of the sum on ``Q2`` again, with ``downfb`` ``ef21``
(the default with EF21: the change of an estimate every replica holds, damped by the
ranks' lam), ``ef21d`` (the owner's own lam for its row), ``res`` or ``none``; what the
optimizer gets is every owner's decoded row (DESIGN section 9).

``mom:q=Q[,warm=W][,v=frozen[,floor=F]]``: error-compensated momentum in the spirit of 1-bit Adam
(Tang et al. 2021): every rank keeps a local momentum ``m_i = b m_i + (1 - b) g_i`` (b the
optimizer's beta1) and codes ``m_i + e_i`` with residual feedback ``e_i`` instead of its
gradient; the owner's sum of the decoded momenta ``M_t`` is what the optimizer's momentum
must be, so the optimizer is handed ``(M_t - b M_{t-1}) / (1 - b)``, whose AdamW
momentum is ``M_t`` exactly (its second moment sees that reconstruction).  ``warm=W``:
the first W steps exact (the momenta still kept), as 1-bit Adam's warm-up; ``v=frozen``:
from step W on, AdamW's second moment frozen at its bias-corrected value (1-bit Adam's
own rule; needs W >= 1); ``floor=F``: each frozen denominator at least F times its
tensor's mean (a coordinate the warm-up saw no gradient on has ``eps`` and would step
lr m / eps once it gets one).  Teacher-student task only (the GPT-2 task clips gradients,
which would scale the momentum the ranks coded).  ``--layers all``
takes the presets' selection for the gpt2 task.  ``plain`` (exact averaging) is
always run first, unless ``--plain_loss`` gives its loss from an earlier run.  Prints
the final validation loss of each and its change vs plain, then the mechanism table;
appends JSON lines to ``--out``.

The two tasks come from the package, as every script takes shared code: the
teacher-student task from ``tagc_bench.teacher_student``, the tiny GPT-2's schedule and
evaluation (``sim_ablation.py``'s) from ``tagc_bench.probes``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

# the scripts' helpers, scripts/bench/tagc_bench, from the folder beside this one
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from tagc_bench.rows import UnitRows  # noqa: E402 - after the path

BLOCK = 256
CODEC_FORMATS = ("sign", "ternary", "int4", "int8", "tls")
ALPHA_CODES = ("ternary", "tl2", "int4")  # measured on every coded block
ZONES = (0, 25, 50, 75, 100, 125, 150)  # tzZ: ternary_zone at Z / 100 mean|x|
BLOCKS = (16, 32, 64, 128)  # ternaryB: the codec's ternary at block B
GUARD_GRID = (2, 4, 8, 16, 32, 64, 128, 256)  # thresholds whose exceedances are counted


# --------------------------------------------------------------------------- quantizers

def _blocks(x: torch.Tensor, block: int) -> Tuple[torch.Tensor, int]:
    """``x`` (1-D) as rows of ``block``, zero-padded; and the pad."""
    pad = (-x.numel()) % block
    return torch.nn.functional.pad(x, (0, pad)).view(-1, block), pad


def ternary_l2(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The L2-optimal ternary code per block: {-s, 0, +s} minimising ||C(x) - x||.

    For a fixed set of m kept entries the best s is their mean |x|, which leaves an
    error ``||x||^2 - c_m^2 / m`` (c_m: their sum of |x|); the best set of a given size
    is the m largest, so the code keeps the top m with m maximising ``c_m^2 / m``.
    Every kept |x| is then >= s/2 and every dropped one <= s/2, so rounding x/s to the
    nearest of -1, 0, 1 gives the same codes: only the encoder's scale changes.

    Args:
        x: 1-D float32 values (a shard; blocks start at its first entry).
        block: entries per scale.
    Returns:
        the decoded code, like x.
    """
    b, pad = _blocks(x, block)
    a = b.abs()
    srt, _ = a.sort(dim=1, descending=True)
    c = srt.cumsum(1)
    m = torch.arange(1, block + 1, dtype=x.dtype)
    best = (c * c / m).argmax(dim=1, keepdim=True)
    s = c.gather(1, best) / (best + 1).to(x.dtype)
    q = torch.where(s > 0, torch.round(b / s.clamp_min(1e-38)).clamp(-1, 1), torch.zeros_like(b))
    out = (q * s).reshape(-1)
    return out[:x.numel()] if pad else out


def ternary_max(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Ternary at s = max|x| per block (the largest entry exact, a coarse rest)."""
    b, pad = _blocks(x, block)
    s = b.abs().amax(dim=1, keepdim=True)
    q = torch.where(s > 0, torch.round(b / s.clamp_min(1e-38)).clamp(-1, 1), torch.zeros_like(b))
    out = (q * s).reshape(-1)
    return out[:x.numel()] if pad else out


def int4_stochastic(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """int4's grid (15 levels of max|x|/7 per block) with stochastic rounding: x/s
    rounds up with probability equal to its fraction, so the code is unbiased
    (E[C(x)] = x) and needs no feedback to deliver small entries on average.  A
    prototype in torch (the generator is torch's global one, not a seed per rank,
    unit and step as the codec would derive it)."""
    b, pad = _blocks(x, block)
    s = b.abs().amax(dim=1, keepdim=True) / 7
    y = b / s.clamp_min(1e-38)
    q = torch.floor(y + torch.rand_like(y)).clamp(-7, 7)
    out = torch.where(s > 0, q * s, torch.zeros_like(b)).reshape(-1)
    return out[:x.numel()] if pad else out


_ROT_CALLS = [0]


def ternary_rotated(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The codec's ternary code of the rotated blocks (``_tagc.rht``: a seeded block
    Hadamard, a new seed per call as a (seed, unit, step) hash would give), decoded
    and unrotated: a block's dropped entries become an error spread over the block
    in a basis that changes every step instead of the same entries dropped again."""
    import _tagc

    _ROT_CALLS[0] += 1
    seed = _tagc.seed_derive(7, 0, _ROT_CALLS[0])
    y = torch.empty_like(x)
    _tagc.rht(y, x.contiguous(), block, seed)
    c = codec("ternary", y, block)
    out = torch.empty_like(c)
    _tagc.rht(out, c, block, seed, inverse=True)
    return out


def _ternary_scale(a: torch.Tensor) -> torch.Tensor:
    """The codec's ternary scale of each row of block magnitudes ``a``:
    min(2.5 mean|x|, max|x|) (csrc/quant.c)."""
    return torch.minimum(a.amax(dim=1, keepdim=True), 2.5 * a.mean(dim=1, keepdim=True))


def ternary_stochastic(x: torch.Tensor, block: int = BLOCK, top: str = "codec") -> torch.Tensor:
    """Ternary with stochastic rounding (TernGrad's code): per block s as the codec's
    (``top=codec``: min(2.5 mean|x|, max|x|)) or max|x| (``top=max``: unbiased), and
    |x| < s sent as s with probability |x|/s, else 0 (torch's global generator)."""
    b, pad = _blocks(x, block)
    a = b.abs()
    s = _ternary_scale(a) if top == "codec" else a.amax(dim=1, keepdim=True)
    keep = (a / s.clamp_min(1e-38) >= torch.rand_like(a)).to(b.dtype)
    out = torch.where(s > 0, torch.sign(b) * keep * s, torch.zeros_like(b)).reshape(-1)
    return out[:x.numel()] if pad else out


def ternary_zone(x: torch.Tensor, zone: float, block: int = BLOCK) -> torch.Tensor:
    """Ternary with a dead zone of ``zone`` mean|x| per block: entries above it are
    sent as +-s at s = their mean |x| (the L2-optimal scale for that set), the rest
    0; the codec's wire format, only the encoder's choice of codes and scale differs
    (the codec's own: zone 1.25, s = min(2.5 mean|x|, max|x|))."""
    b, pad = _blocks(x, block)
    a = b.abs()
    keep = a > zone * a.mean(dim=1, keepdim=True)
    cnt = keep.sum(dim=1, keepdim=True).clamp_min(1)
    s = (a * keep).sum(dim=1, keepdim=True) / cnt
    out = (torch.sign(b) * keep * s).reshape(-1)
    return out[:x.numel()] if pad else out


def ternary_log8(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The codec's ternary (s = min(2.5 mean|x|, max|x|) per block) with each block's
    scale on 8 bits: s = S 2^(-k/16), S the message's largest block scale (fp32, sent
    once), k in [0, 254] rounded in the log domain (at most 2.2% off), 255 a zero
    block; the codes are those of the coded scale."""
    b, pad = _blocks(x, block)
    s = _ternary_scale(b.abs())
    big = float(s.max())
    if big == 0:
        return torch.zeros_like(x)
    k = torch.round(-16 * torch.log2(s.clamp_min(1e-38) / big)).clamp(0, 255)
    sq = torch.where((k < 255) & (s > 0), big * torch.exp2(-k / 16), torch.zeros_like(s))
    q = torch.where(sq > 0, torch.round(b / sq.clamp_min(1e-38)).clamp(-1, 1), torch.zeros_like(b))
    out = (q * sq).reshape(-1)
    return out[:x.numel()] if pad else out


def ternary_sub(x: torch.Tensor, block: int = 32, group: int = 512, steps: int = 3) -> torch.Tensor:
    """Ternary with two-level scales: each ``block`` has the codec's ternary scale on 4
    bits relative to its ``group``'s largest, s = M 2^(-k/steps), k in [0, 14] rounded
    in the log domain (clamped at 14: a block more than 14/steps octaves below the
    group's largest gets that scale, 15 a zero block), M on 8 bits as ``tlogB``'s
    (its 2.2% ignored here).  With the codes packed 5 per byte across the message,
    block 32 and group 512 cost 1.6 + 4/32 + 8/512 = 1.74 bits per value."""
    b, pad = _blocks(x, block)
    s = _ternary_scale(b.abs())
    g, gpad = _blocks(s.reshape(-1), group // block)
    m = g.amax(dim=1, keepdim=True).expand_as(g).reshape(-1)[:s.numel()].view_as(s)
    k = torch.round(-steps * torch.log2(s.clamp_min(1e-38) / m.clamp_min(1e-38))).clamp(0, 14)
    sq = torch.where(s > 0, m * torch.exp2(-k / steps), torch.zeros_like(s))
    q = torch.where(sq > 0, torch.round(b / sq.clamp_min(1e-38)).clamp(-1, 1), torch.zeros_like(b))
    out = (q * sq).reshape(-1)
    return out[:x.numel()] if pad else out


def stored(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a residual is kept between calls (``store=``): ``fp32`` as is, ``bf16``
    rounded to bfloat16, or a codec format (``int8``, ``int4``: block codes with
    one fp32 scale per 256, round to nearest); what storing rounds away is lost."""
    if name == "fp32":
        return lambda x: x
    if name == "bf16":
        return lambda x: x.to(torch.bfloat16).float()
    if name in CODEC_FORMATS:
        return lambda x: codec(name, x)
    raise SystemExit(f"store= must be fp32, bf16 or one of {CODEC_FORMATS}, got {name!r}")


def codec(fmt: str, x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The codec's code of ``x`` (``tagc.codec.quant_encode`` then ``quant_decode_add``,
    the hook's own calls)."""
    from tagc import codec as tc

    x = x.contiguous()
    buf = torch.empty(tc.quant_bytes(x.numel(), fmt, block), dtype=torch.uint8)
    tc.quant_encode(buf, None, x, fmt, block)
    out = torch.zeros_like(x)
    tc.quant_decode_add(out, buf, fmt, block)
    return out


# every quantizer name (see the module docstring) -> its code C
QUANTIZERS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    **{f: (lambda x, f=f: codec(f, x)) for f in CODEC_FORMATS},
    "exact": lambda x: x.clone(),  # no code: a control that isolates an exchange's rule
    "tl2": ternary_l2, "tmax": ternary_max, "int4sr": int4_stochastic,
    "trot": ternary_rotated, "tsr": ternary_stochastic,
    "tsrmax": lambda x: ternary_stochastic(x, top="max"),
    **{f"tz{z}": (lambda x, z=z: ternary_zone(x, z / 100)) for z in ZONES},
    **{f"ternary{b}": (lambda x, b=b: codec("ternary", x, b)) for b in BLOCKS},
    **{f"tlog{b}": (lambda x, b=b: ternary_log8(x, b)) for b in BLOCKS},
    **{f"int4b{b}": (lambda x, b=b: codec("int4", x, b)) for b in BLOCKS},
    **{f"tsub{b}r{r}": (lambda x, b=b, r=r: ternary_sub(x, b, steps=r))
       for b in (16, 32) for r in (2, 3, 4)},
}


def quantizer(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The code ``C`` of a quantizer name (see the module docstring)."""
    return QUANTIZERS[name]


def lam_of(gh: float, hh: float) -> float:
    """The lam in [0, 1] minimising ``||g - lam h||^2`` from ``<g, h>`` and ``||h||^2``
    (1 when h is zero)."""
    return min(max(gh / hh, 0.0), 1.0) if hh > 0 else 1.0


def best_lam(g: torch.Tensor, h: torch.Tensor) -> float:
    """:func:`lam_of` of the tensors."""
    return lam_of(float((g * h).sum()), float(h.pow(2).sum()))


def out_error(out: torch.Tensor, true: torch.Tensor) -> float:
    """``||out - true||^2 / ||true||^2``: what the optimizer gets against the true sum."""
    return float((out - true).pow(2).sum()) / max(float(true.pow(2).sum()), 1e-30)


def block_alpha(x: torch.Tensor, cx: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per block of x: ``1 - ||C(x) - x||^2 / ||x||^2`` (blocks with x == 0 left out)."""
    xb, _ = _blocks(x, block)
    eb, _ = _blocks(cx - x, block)
    n2 = xb.pow(2).sum(1)
    keep = n2 > 0
    return 1.0 - eb.pow(2).sum(1)[keep] / n2[keep]


# --------------------------------------------------------------------------- units

class Exchange:
    """Quant mode's reduction of one unit over N simulated ranks, with feedback.

    Args:
        unit: the unit.
        feedback: ``none``, ``res`` or ``ef21``.
        q: the quantizer name.
        guard: the guard's threshold on the pooled estimate error (0: off).
        alpha_now: whether to measure the per-block alphas this call.
    """

    def __init__(self, unit: UnitRows, feedback: str, q: str, guard: float,
                 response: str = "exact", damp: bool = False, down: str = "",
                 down_fb: str = "", cut: float = 0.0, store: str = "fp32",
                 beta: float = 1.0, momentum: float = 0.9) -> None:
        self.unit, self.fb, self.qname, self.guard = unit, feedback, q, guard
        self.beta = beta
        # mom: beta1, and whether this call is exact (the warm-up)
        self.momentum = momentum
        self.exact = False
        self.store = stored(store)
        self.cut = cut
        self.response, self.damp = response, damp
        self.C = quantizer(q)
        n, s = unit.n, unit.row
        # EF21: h (per rank, all rows) and the owners' estimates; res: the residuals
        self.state = torch.zeros(n, n, s)
        self.est = torch.zeros(n, s)
        # mom: the ranks' local momenta (all rows) and the owners' last sum of the
        # decoded momenta
        self.mom = torch.zeros(n, n, s) if feedback == "mom" else None
        self.prev = torch.zeros(n, s) if feedback == "mom" else None
        # HSDP two-phase's to-everyone phase: each owner's row of the sum coded again
        # (``down``) with EF21 (est_out, held alike by every replica) or residual
        # feedback (res_out, the owner's)
        self.down = quantizer(down) if down else None
        self.down_fb = down_fb or feedback
        self.est_out = torch.zeros(n, s)
        self.res_out = torch.zeros(n, s)
        self.resets = 0
        self.log: Dict[str, List[float]] = {"est_err": [], "out_err": [], "lam": [], "rho2": []}
        self.alphas: Dict[str, List[torch.Tensor]] = {c: [] for c in ALPHA_CODES}

    def reduce(self, g: torch.Tensor, measure_alpha: bool) -> torch.Tensor:
        """``g`` (N ranks, N rows, S): the (N, S) mean the optimizer gets."""
        if self.fb == "mom":
            return self._reduce_momentum(g)
        n = self.unit.n
        true = g.sum(0)
        den = float(g.pow(2).sum())
        if self.fb == "ef21":
            num = float((g - self.state).pow(2).sum())
        elif self.fb == "res":
            num = float(self.state.pow(2).sum())
        else:
            num = 0.0
        ratio = num / den if den > 0 else 0.0
        self.log["est_err"].append(ratio)
        fire = bool(self.guard) and self.fb != "none" and not (num <= self.guard * den)
        if fire and self.response == "zero" and self.fb == "ef21":
            # restart EF21 from h = 0: this call sends C(g), as without feedback
            self.resets += 1
            self.state.zero_()
            self.est.zero_()
        elif fire:
            # the guard: the exact path, settling the feedback state
            self.resets += 1
            if self.fb == "ef21":
                self.state.copy_(g)
                self.est.copy_(true)
                out = true.clone()
            else:
                out = (g + self.state).sum(0)
                self.state.zero_()
            self.est_out.copy_(out)
            self.res_out.zero_()
            self.log["out_err"].append(out_error(out, true))
            return out / n
        if self.damp and self.fb == "ef21":
            # damped EF21: every rank compresses g - lam h with the lam minimising the
            # pooled ||g - lam h||^2 (clipped to [0, 1]); the owners scale their
            # estimates by the same lam, so est == sum of h stays exact
            # one pass of sums for both lam and rho2 (den is ||g||^2)
            gh, hh = float((g * self.state).sum()), float(self.state.pow(2).sum())
            lam = lam_of(gh, hh)
            rho2 = gh * gh / (den * hh) if gh > 0 and den > 0 and hh > 0 else 0.0
            self.log["rho2"].append(rho2)
            if rho2 < self.cut:
                lam = 0.0
            self.log["lam"].append(lam)
            self.state.mul_(lam)
            self.est.mul_(lam)
            if self.down_fb != "ef21d":  # ef21d damps the to-everyone phase by its own lam
                self.est_out.mul_(lam)
        out = torch.zeros_like(true)
        for i in range(n):
            v_all = g[i] - self.state[i] if self.fb == "ef21" else \
                g[i] + self.state[i] if self.fb == "res" else g[i]
            for r in range(n):
                v = v_all[r]
                if r == i:  # the own row never leaves the rank: exact
                    sent = v if self.fb == "ef21" else g[i][r]
                else:
                    sent = self.C(v)
                    if measure_alpha:
                        for c in ALPHA_CODES:
                            cv = sent if c == self.qname else quantizer(c)(v)
                            self.alphas[c].append(block_alpha(v, cv))
                    if self.fb == "res":
                        self.state[i][r] = self.store(v - sent)
                        if self.beta != 1.0:
                            self.state[i][r] *= self.beta
                if self.fb == "ef21":
                    self.state[i][r] += sent
                out[r] += sent
        if self.fb == "ef21":
            self.est += out
            out = self.est.clone()
        if self.down is not None:
            out = self._down(out)
        self.log["out_err"].append(out_error(out, true))
        return out / n

    def _reduce_momentum(self, g: torch.Tensor) -> torch.Tensor:
        """``mom``'s call: code the ranks' momenta with residual feedback; hand the
        optimizer the gradient whose momentum is the owners' sum of what arrived."""
        n, b = self.unit.n, self.momentum
        true = g.sum(0)
        self.mom.mul_(b).add_(g, alpha=1.0 - b)
        if self.exact:
            # the warm-up: exact gradients, the momenta kept so the switch is seamless
            self.prev = self.mom.sum(0)
            self.log["est_err"].append(0.0)
            self.log["out_err"].append(0.0)
            return true / n
        den = float(self.mom.pow(2).sum())
        self.log["est_err"].append(float(self.state.pow(2).sum()) / den if den > 0 else 0.0)
        total = torch.zeros_like(true)
        for i in range(n):
            v_all = self.mom[i] + self.state[i]
            for r in range(n):
                if r == i:  # the own row never leaves the rank: exact, no residual
                    sent = self.mom[i][r]
                else:
                    sent = self.C(v_all[r])
                    self.state[i][r] = v_all[r] - sent
                total[r] += sent
        # AdamW's momentum is linear in what it is handed: (M_t - b M_{t-1}) / (1 - b)
        # makes it M_t (both start from zero)
        out = (total - b * self.prev) / (1.0 - b)
        self.prev = total
        self.log["out_err"].append(out_error(out, true))
        return out / n

    def _down(self, out: torch.Tensor) -> torch.Tensor:
        """Two-phase's to-everyone phase: every owner's row ``out[r]`` of the sum,
        coded with the downlink feedback, as every replica decodes it."""
        if self.down_fb in ("ef21", "ef21d"):
            for r in range(self.unit.n):
                held = self.est_out[r]
                if self.down_fb == "ef21d":
                    # the owner's own lam for its row, sent beside its codes
                    held.mul_(best_lam(out[r], held))
                held += self.down(out[r] - held)
            return self.est_out.clone()
        dec = torch.zeros_like(out)
        for r in range(self.unit.n):
            v = out[r] + self.res_out[r] if self.down_fb == "res" else out[r]
            dec[r] = self.down(v)
            if self.down_fb == "res":
                self.res_out[r] = v - dec[r]
        return dec


# --------------------------------------------------------------------------- tasks

class TeacherStudent:
    """``tagc_bench.teacher_student``'s task and student (its defaults), AdamW constant lr."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tagc_bench import teacher_student as ts

        ns = ts.parse_args(["plain", "--steps", str(args.steps), "--batch", str(args.batch or 16),
                            "--lr", str(args.lr or 3e-3), "--seed", str(args.seed),
                            *args.task_args])
        self.ts, self.ns = ts, ns
        self.task = ts.Task(ns)

    def model(self) -> Tuple[nn.Module, List[Tuple[str, List[nn.Parameter]]]]:
        torch.manual_seed(self.ns.seed)
        m = self.ts.mlp(self.ns.d_in, self.ns.width, self.ns.depth, self.ns.d_out)
        units = [(n, list(mod.parameters())) for n, mod in m.named_modules()
                 if isinstance(mod, nn.Linear) and mod.weight.numel() >= self.ns.min_numel]
        return m, units

    def optimizer(self, m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=self.ns.lr, weight_decay=self.ns.weight_decay)

    def loss(self, m: nn.Module, step: int, rank: int) -> torch.Tensor:
        x, y = self.task.batch(step, rank)
        return nn.functional.mse_loss(m(x), y)

    def before_step(self, m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        pass

    @torch.no_grad()
    def evaluate(self, m: nn.Module) -> float:
        return float(nn.functional.mse_loss(m(self.task.val_x), self.task.val_y))


class TinyGPT2:
    """sim_ablation.py's tiny GPT-2 (train-tiny's schedule, clip 1.0: ``tagc_bench.probes``);
    units: the modules the default selection compresses (MLP, attention output, embedding)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tagc_bench import probes
        from tagc.train import data as token_data

        self.probes, self.args = probes, argparse.Namespace(
            steps=args.steps, seed=args.seed if args.seed else 1337, batch_size=args.batch or 8,
            block_size=128, lr=args.lr or 1e-3, data="stdlib")
        self.layers = args.layers
        meta = token_data.prepare(token_data.get_source("stdlib", 5.0),
                                  token_data.get_tokenizer("auto"), Path("data_cache"))
        self.data, self.vocab = token_data.TokenData(meta), meta["vocab_size"]

    def model(self) -> Tuple[nn.Module, List[Tuple[str, List[nn.Parameter]]]]:
        import tagc_hook as tagc
        from tagc.train.model import GPT, GPTConfig

        torch.manual_seed(self.args.seed)
        m = GPT(GPTConfig(block_size=128, vocab_size=(self.vocab + 63) // 64 * 64,
                          n_layer=2, n_head=4, n_embd=256))
        cfg = tagc.TAGCConfig(mode="dense", layers=self.layers)
        units, seen = [], set()
        for mn, mod in m.named_modules():
            ps = [(pn, p) for pn, p in mod.named_parameters(recurse=False)]
            if any(tagc.select_parameter(cfg, mn, mod, pn, p) for pn, p in ps) \
                    and id(ps[0][1]) not in seen:
                seen.update(id(p) for _, p in ps)
                units.append((mn, [p for _, p in ps]))
        return m, units

    def optimizer(self, m: nn.Module) -> torch.optim.Optimizer:
        from tagc.train.optim import configure_optimizer, decayed_parameter_names

        return configure_optimizer(m, decayed_parameter_names(m), 0.1, self.args.lr, (0.9, 0.95))

    def loss(self, m: nn.Module, step: int, rank: int) -> torch.Tensor:
        x, y = self.data.get_batch("train", self.args.batch_size, 128,
                                   (self.args.seed, 0, step, 0, rank))
        return m(x, y)[1]

    def before_step(self, m: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for gr in opt.param_groups:
            gr["lr"] = self.probes.lr_at(step, self.args)

    def evaluate(self, m: nn.Module) -> float:
        return self.probes.evaluate(m, self.data, self.args)


# --------------------------------------------------------------------------- training

def parse_method(spec: str) -> Tuple[str, Dict[str, str]]:
    """``FEEDBACK:q=Q[,guard=R]`` -> (feedback, options)."""
    fb, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    if fb not in ("plain", "none", "res", "ef21", "mom"):
        raise SystemExit(f"unknown feedback {fb!r}")
    if {"warm", "v", "floor"} & set(opts) and fb != "mom":
        raise SystemExit(f"{spec}: warm=, v= and floor= are the momentum exchange's (mom:...)")
    if fb == "mom":
        if not opts.get("warm", "0").isdigit():
            raise SystemExit(f"{spec}: warm= is a step count")
        if opts.get("v", "adam") not in ("adam", "frozen"):
            raise SystemExit(f"{spec}: v= is adam or frozen")
        if opts.get("v") == "frozen" and int(opts.get("warm", 0)) < 1:
            raise SystemExit(f"{spec}: v=frozen freezes what the warm-up measured: "
                             "give warm=W >= 1")
        if "floor" in opts and opts.get("v") != "frozen":
            raise SystemExit(f"{spec}: floor= bounds the frozen second moment (v=frozen)")
        if set(opts) - {"q", "warm", "v", "floor"}:
            raise SystemExit(f"{spec}: mom takes q=, warm=, v= and floor= only")
    codes = tuple(QUANTIZERS)
    if fb != "plain" and opts.get("q") not in codes:
        raise SystemExit(f"{spec}: give q= one of {codes}")
    if "cut" in opts and (fb != "ef21" or opts.get("damp") != "1"):
        raise SystemExit(f"{spec}: cut= thresholds the damped EF21 (ef21:...,damp=1)")
    if "beta" in opts and (fb != "res" or not 0.0 <= float(opts["beta"]) <= 1.0):
        raise SystemExit(f"{spec}: beta= in [0, 1] scales the residual (res:...)")
    if "store" in opts:
        if fb != "res":
            raise SystemExit(f"{spec}: store= is how the residual is kept (res:...)")
        stored(opts["store"])
    if "down" in opts and opts["down"] not in codes:
        raise SystemExit(f"{spec}: down= must be one of {codes}")
    if "downfb" in opts and (opts["downfb"] not in ("none", "res", "ef21", "ef21d")
                             or "down" not in opts):
        raise SystemExit(f"{spec}: downfb= must be none, res, ef21 or ef21d, with down=")
    return fb, opts


@torch.no_grad()
def frozen_adamw_step(opt: torch.optim.Optimizer, frozen: Dict[int, torch.Tensor]) -> None:
    """torch's AdamW step with each parameter's bias-corrected second moment fixed at
    ``frozen`` (1-bit Adam's rule after its warm-up); momentum, weight decay and the
    first moment's bias correction as torch's.

    Args:
        opt: a torch AdamW (no amsgrad, not maximizing) that has taken a step.
        frozen: ``id(param)`` -> its frozen ``sqrt(v / (1 - beta2^t)) + eps``.
    """
    for gr in opt.param_groups:
        b1 = gr["betas"][0]
        for p in gr["params"]:
            if p.grad is None:
                continue
            st = opt.state[p]
            st["step"] += 1
            t = float(st["step"])
            p.mul_(1.0 - gr["lr"] * gr["weight_decay"])
            st["exp_avg"].lerp_(p.grad, 1.0 - b1)
            p.addcdiv_(st["exp_avg"], frozen[id(p)], value=-gr["lr"] / (1.0 - b1 ** t))


def freeze_second_moment(opt: torch.optim.Optimizer, floor: float = 0.0) -> Dict[int, torch.Tensor]:
    """Every parameter's ``sqrt(v / (1 - beta2^t)) + eps`` now, for :func:`frozen_adamw_step`,
    at least ``floor`` times its tensor's mean."""
    out = {}
    for gr in opt.param_groups:
        b2 = gr["betas"][1]
        for p in gr["params"]:
            st = opt.state[p]
            d = (st["exp_avg_sq"] / (1.0 - b2 ** float(st["step"]))).sqrt() + gr["eps"]
            out[id(p)] = d.clamp_min(floor * float(d.mean())) if floor > 0 else d
    return out


def run(spec: str, task: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """Train once; returns the loss and the mechanism measurements."""
    fb, opts = parse_method(spec)
    if fb == "mom" and not isinstance(task, TeacherStudent):
        raise SystemExit(f"{spec}: the momentum exchange runs on the teacher-student task only")
    m, units = task.model()
    opt = task.optimizer(m)
    n = args.ranks
    warm, frozen_v = int(opts.get("warm", 0)), opts.get("v") == "frozen"
    frozen: Optional[Dict[int, torch.Tensor]] = None
    ex = {name: Exchange(UnitRows(name, ps, n), fb, opts["q"], float(opts.get("guard", 0)),
                         opts.get("resp", "exact"), opts.get("damp") == "1",
                         opts.get("down", ""), opts.get("downfb", ""),
                         float(opts.get("cut", 0)), opts.get("store", "fp32"),
                         float(opts.get("beta", 1.0)), opt.param_groups[0]["betas"][0])
          for name, ps in units} if fb != "plain" else {}
    params = list(m.parameters())
    curve = []
    for step in range(args.steps):
        grads = []
        for r in range(n):
            m.zero_grad(set_to_none=True)
            task.loss(m, step, r).backward()
            grads.append([p.grad.detach().clone() for p in params])
        if not all(bool(torch.isfinite(g).all()) for gr in grads for g in gr):
            # diverged: the run's loss is inf from here (the codes refuse NaN anyway)
            curve.append((step + 1, float("inf")))
            break
        index = {id(p): j for j, p in enumerate(params)}
        for j, p in enumerate(params):
            p.grad = sum(g[j] for g in grads) / n
        measure = args.alpha_every > 0 and step % args.alpha_every == 0
        for name, e in ex.items():
            e.exact = step < warm
            g = torch.stack([e.unit.rows([grads[r][index[id(p)]] for p in e.unit.params])
                             for r in range(n)])
            for p, gp in zip(e.unit.params, e.unit.unrows(e.reduce(g, measure))):
                p.grad = gp.clone()
        task.before_step(m, opt, step)
        if frozen_v and step >= warm:
            frozen = frozen if frozen is not None else \
                freeze_second_moment(opt, float(opts.get("floor", 0)))
            frozen_adamw_step(opt, frozen)
        else:
            opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append((step + 1, task.evaluate(m)))
    res: Dict[str, Any] = {"method": spec, "task": args.task, "steps": args.steps,
                           "seed": args.seed, "val_loss": curve[-1][1], "curve": curve}
    if ex:
        res["resets"] = {k: e.resets for k, e in ex.items()}
        res["units"] = {}
        for k, e in ex.items():
            u: Dict[str, Any] = {}
            for key, vals in e.log.items():
                if not vals:
                    continue
                t = torch.tensor(vals)
                thirds = t.tensor_split(3)
                u[key] = {"median": float(t.median()), "max": float(t.max()),
                          "p95": float(t.quantile(0.95)), "argmax": int(t.argmax()),
                          "thirds_median": [float(x.median()) for x in thirds],
                          # calls above each candidate threshold (the guard's choice)
                          "exceed": {str(th): int((t > th).sum()) for th in GUARD_GRID}}
            for c, a in e.alphas.items():
                if a:
                    t = torch.cat(a)
                    u[f"alpha_{c}"] = {"median": float(t.median()), "p5": float(t.quantile(0.05)),
                                       "min": float(t.min()), "blocks": t.numel()}
            res["units"][k] = u
    return res


def table(results: List[Dict[str, Any]]) -> str:
    """Markdown: loss vs plain; per unit the estimate error, lam / rho2 and the alphas."""
    base = results[0]["val_loss"]
    lines = ["| method | val loss | vs plain | resets |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['val_loss']:.5f} | "
                     f"{100 * (r['val_loss'] / base - 1):+.1f}% | "
                     f"{sum(r.get('resets', {}).values()) if 'resets' in r else '-'} |")
    lines += ["", "| method | unit | est_err median (thirds) / p95 / max | "
              "out_err median (thirds) / max | "
              "lam / rho2 median | alpha ternary med / p5 / min | alpha tl2 med / p5 / min | "
              "alpha int4 med / p5 / min |", "|---|---|---|---|---|---|---|---|"]
    for r in results[1:]:
        for k, u in r["units"].items():
            e, o = u["est_err"], u["out_err"]
            al = [" / ".join(f"{u[f'alpha_{c}'][s]:.3f}" for s in ("median", "p5", "min"))
                  if f"alpha_{c}" in u else "-" for c in ALPHA_CODES]
            damp = f"{u['lam']['median']:.3f} / {u['rho2']['median']:.3f}" if "lam" in u else "-"
            lines.append(f"| {r['method']} | {k} | {e['median']:.3f} "
                         f"({', '.join(f'{x:.2f}' for x in e['thirds_median'])}) / "
                         f"{e['p95']:.2f} / {e['max']:.2f} | {o['median']:.3f} "
                         f"({', '.join(f'{x:.2f}' for x in o['thirds_median'])}) / "
                         f"{o['max']:.2f} | "
                         f"{damp} | " + " | ".join(al) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Run plain and every method; print the tables; append JSON lines to --out."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("methods", nargs="+")
    p.add_argument("--task", choices=("ts", "gpt2"), default="ts")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=0, help="per rank (0: the task's default)")
    p.add_argument("--lr", type=float, default=0.0, help="0: the task's default")
    p.add_argument("--seed", type=int, default=0, help="0: the task's default")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--alpha_every", type=int, default=10, help="steps between alpha samples; 0: off")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", choices=("non_attention", "all"), default="non_attention",
                   help="gpt2 task: the selection that picks the units")
    p.add_argument("--task_args", nargs=argparse.REMAINDER, default=[],
                   help="teacher_student.py options (ts task), e.g. --width 512")
    p.add_argument("--plain_loss", type=float, default=None,
                   help="plain's loss from an earlier run of the same task: plain is not run again")
    p.add_argument("--out", default="out/sim_feedback.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = TeacherStudent(args) if args.task == "ts" else TinyGPT2(args)
    specs = ["plain"] + [s for s in args.methods if s != "plain"]
    for s in specs:
        parse_method(s)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results: List[Dict[str, Any]] = []
    if args.plain_loss is not None:
        results.append({"method": "plain (given)", "val_loss": args.plain_loss})
        specs = specs[1:]
    for s in specs:
        t0 = time.time()
        r = run(s, task, args)
        r["seconds"] = round(time.time() - t0)
        results.append(r)
        print(f"{s}: val loss {r['val_loss']:.5f} ({r['seconds']} s)", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
