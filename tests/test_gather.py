"""Quantized parameter all-gathers (``TAGCConfig.gather``) on FSDP2, against references.

The reference here is the test's own: it rebuilds each rank's padded flat shard of
every unit from the full parameters (dim-0 chunks of ``ceil(rows / N)`` rows, zero
padded), quantizes each parameter's segment in blocks with its own pure-torch int8/int4
(scale ``max|w| / qmax`` rounded to fp32, codes rounded half to even), and
dequantizes.  FSDP's gradients must then equal those of a model whose weights *are*
those dequantized values; the sharded masters stay bit for bit; the forward gather
equals the backward re-gather; every rank holds the same weights; the bytes counted
equal the formula.  Gather blocks of 16 (several per segment) and of 256, tagc-full's,
on a wider toy whose segments are not multiples of 256.  The backward computes with
the weights the forward did, read from autograd's saved tensors of units that really
gather twice; ``exact_gathers()`` reshards on entry and exit, seen on units that FSDP
keeps unsharded between calls.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import tagc_hook as tagc
from dist_helpers import SharedSpawn, ToyGPT, run_cases, toy_batch
from tagc.codec import _tagc

pytestmark = [pytest.mark.codec, pytest.mark.dist]

QMAX = {"int8": 127, "int4": 7}
BLOCK = 16  # small blocks: several per segment, and a short last one
PRESET_BLOCK = 256  # configs/tagc-full.yaml's gather_block
WIDE = {"d": 24}  # a toy whose segments (N = 2, 3, 4) hold 1 to 4 blocks of 256 and
                  # mostly a short last one: 456, 864, 1152 at N = 2; 312, 576 at N = 3


# --------------------------------------------------------------------------- reference

def ref_dequant(x: torch.Tensor, fmt: str, block: int, seed: int = 0,
                rotate: bool = False) -> torch.Tensor:
    """One segment quantized in blocks and dequantized, by the test's own rules (fp4:
    tests/test_codes4.py's numpy reference, the unit's rotation seed)."""
    if fmt == "fp4":
        from test_codes4 import ROTATE, ref_encode

        dec = ref_encode(x.float().numpy(), block, ROTATE if rotate else 0, seed)[1]
        return torch.from_numpy(dec).to(x.dtype)
    qmax = QMAX[fmt]
    xf = x.float()
    out = torch.empty_like(xf)
    for b0 in range(0, xf.numel(), block):
        v = xf[b0:b0 + block]
        s = torch.tensor(v.abs().max().item() / qmax, dtype=torch.float32)  # fp64 -> fp32
        if s.item() < 1.17549435e-38:
            out[b0:b0 + block] = 0.0
            continue
        q = torch.round((v * (torch.tensor(1.0) / s)).clamp(-qmax - 1, qmax + 1))
        out[b0:b0 + block] = q.clamp(-qmax, qmax) * s
    return out.to(x.dtype)


def ref_segment_bytes(length: int, fmt: str, block: int) -> int:
    """Bytes of one segment: per block a fp32 scale and its packed codes (fp4: the
    segment's packed codes, then a scale byte per block)."""
    if fmt == "fp4":
        return (length + 1) // 2 + math.ceil(length / block)
    per = 1 if fmt == "int8" else 2
    full, last = divmod(length, block)
    return full * (4 + math.ceil(block / per)) + (4 + math.ceil(last / per) if last else 0)


def unit_params(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, List[str]]]:
    """Each FSDP2 module with its own parameters (FQNs), in registration order, by the
    test's own walk: a parameter belongs to the nearest sharded ancestor."""
    from torch.distributed.fsdp import FSDPModule

    owner: Dict[str, str] = {}
    mods = {n: m for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    for pname, _ in model.named_parameters():
        parts = pname.split(".")[:-1]
        while ".".join(parts) not in mods:
            parts.pop()
        owner[pname] = ".".join(parts)
    units = [(m, [p for p, o in owner.items() if o == n]) for n, m in mods.items()]
    return [(m, names) for m, names in units if names]


def ref_weights(full: Dict[str, torch.Tensor], world: int, fmt: str, block: int,
                seeds: Optional[Dict[str, int]] = None,
                rotate: bool = False) -> Dict[str, torch.Tensor]:
    """The weights every rank computes with: each rank's padded chunk of each
    parameter quantized as its own segment, then the rows put back together (fp4:
    ``seeds`` maps a parameter to its unit's rotation seed)."""
    out = {}
    for name, w in full.items():
        rows = w.shape[0]
        c = math.ceil(rows / world)
        chunks = []
        for r in range(world):
            part = w[r * c:(r + 1) * c].reshape(-1)
            pad = torch.zeros(c * w[0].numel(), dtype=w.dtype)
            pad[:part.numel()] = part
            chunks.append(ref_dequant(pad, fmt, block, (seeds or {}).get(name, 0),
                                      rotate)[:part.numel()])
        out[name] = torch.cat(chunks).reshape(w.shape)
    return out


def ref_message_bytes(full: Dict[str, torch.Tensor], names: List[str], world: int,
                      fmt: str, block: int) -> int:
    """Bytes of one rank's message for a unit holding ``names``."""
    tot = 0
    for n in names:
        w = full[n]
        tot += ref_segment_bytes(math.ceil(w.shape[0] / world) * w[0].numel(), fmt, block)
    return tot


# --------------------------------------------------------------------------- harness

def _cfg(**kw: Any) -> tagc.TAGCConfig:
    # every knob the cases rely on, explicit (TAGCConfig()'s defaults are a preset's)
    base = dict(mode="dense", layers="all", min_numel=0, gather="int8", gather_block=BLOCK,
                error_feedback=True, ef21=False)
    base.update(kw)
    return tagc.TAGCConfig(**base)


def _build(cfg: Optional[tagc.TAGCConfig], init: Optional[Dict[str, torch.Tensor]] = None,
           model_kw: Optional[Dict[str, Any]] = None, **shard_kw: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ToyGPT(**(model_kw or {}))
    if init is not None:
        model.load_state_dict(init)
    return tagc.shard_model(model, cfg or _cfg(gather="none"), **shard_kw)


def _full(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter gathered exactly (DTensor.full_tensor)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _local(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def _grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()
            if p.grad is not None}


class Recorder:
    """Puts a recording comm in front of every unit's GatherComm: a copy of each
    gathered output, per unit name."""

    def __init__(self, model: torch.nn.Module, state: tagc.TAGCState) -> None:
        self.calls: Dict[str, List[Tuple[torch.Tensor, int]]] = {}
        for mod, _ in unit_params(model):
            inner = mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
            assert inner in state.gathers
            mod.set_custom_all_gather(_Recording(inner, self.calls))


class _Recording:
    def __init__(self, inner: Any, calls: Dict[str, List[Tuple[torch.Tensor, int]]]) -> None:
        self.inner, self.calls, self.name = inner, calls, inner.name

    def allocate(self, *a: Any, **k: Any) -> torch.Tensor:
        return self.inner.allocate(*a, **k)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        res = self.inner(output_tensor, input_tensor, group, async_op)
        if res is not None:  # fsdp_overlap: the worker fills the output
            res.wait()
        self.calls.setdefault(self.name, []).append(
            (output_tensor.detach().clone(), dist.get_world_size(group)))
        return res


def _plain_ref_grads(ref: Dict[str, torch.Tensor], world: int, steps: int = 1,
                     model_kw: Optional[Dict[str, Any]] = None) -> Dict[str, torch.Tensor]:
    """Full gradients of an unsharded model holding ``ref``: each rank's batch in turn,
    summed in rank order, divided by N (what TAGC's dense mode does with the ranks'
    gradients)."""
    torch.manual_seed(0)
    m = ToyGPT(**(model_kw or {}))
    m.load_state_dict(ref)
    acc: Dict[str, torch.Tensor] = {}
    for r in range(world):
        m.zero_grad()
        for step in range(steps):
            m(toy_batch(r, step)).backward()
        for n, p in m.named_parameters():
            acc[n] = p.grad.clone() if n not in acc else acc[n] + p.grad
    return {n: g / world for n, g in acc.items()}


def _padded_params(call: Tuple[torch.Tensor, int], full: Dict[str, torch.Tensor],
                   names: List[str], world: int) -> List[torch.Tensor]:
    """Each parameter's padded whole from one recorded gather (buffer, group size),
    whatever group gathered it: rank-major rows, each row the parameters' segments."""
    out, w = call
    padded = [math.ceil(full[nm].shape[0] / world) * world * full[nm][0].numel()
              for nm in names]
    rows = out.view(w, -1)
    res, o = [], 0
    for p in padded:
        res.append(rows[:, o:o + p // w].reshape(-1))
        o += p // w
    return res


def _my_rows(full_grad: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    c = math.ceil(full_grad.shape[0] / world)
    part = full_grad[rank * c:(rank + 1) * c]
    return part


# --------------------------------------------------------------------------- cases

def _case_grads(rank: int, n: int, reshard: Any = True, prefetch: bool = False,
                fmt: str = "int8", block: int = BLOCK,
                model_kw: Optional[Dict[str, Any]] = None,
                rotate: bool = False) -> Dict[str, Any]:
    """Gradients == a plain model on the reference weights; masters untouched; forward
    gather == backward re-gather; the same weights on every rank; bytes == formula
    (gather blocks of ``block`` values, a ToyGPT of ``model_kw``; fp4 optionally
    rotated, each unit by its seed from (config seed, unit))."""
    cfg = _cfg(gather=fmt, gather_block=block, gather_rotate=rotate)
    model = _build(cfg, model_kw=model_kw, reshard_after_forward=reshard)
    full = _full(model)
    masters = _local(model)
    state = tagc.register(model, cfg)
    if prefetch:
        units = [m for m, _ in unit_params(model)]
        for a, b in zip(units[1:], units[2:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    rec = Recorder(model, state)
    model(toy_batch(rank, 0)).backward()
    # masters bit for bit (no optimizer step)
    assert all(torch.equal(a, b) for a, b in zip(masters, _local(model)))
    seeds = {nm: _tagc.seed_derive(cfg.seed, i, 0)
             for i, (_, names) in enumerate(unit_params(model)) for nm in names}
    ref = ref_weights(full, n, fmt, block, seeds, rotate)
    want = _plain_ref_grads(ref, n, model_kw=model_kw)
    got = _grads(model)
    assert set(got) == set(want)
    for name, g in got.items():
        exp = _my_rows(want[name], rank, n)
        assert torch.equal(g[:exp.shape[0]], exp), (name, (g[:exp.shape[0]] - exp).abs().max())
    # every call of a unit gathered the same weights: forward == backward (with
    # reshard_after_forward=int the backward gather runs over a smaller group, so
    # compare each parameter's padded whole, not the raw buffers)
    calls = 0
    for mod, names in unit_params(model):
        outs = rec.calls[mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name]
        calls += len(outs)
        first = _padded_params(outs[0], full, names, n)
        for o in outs[1:]:
            again = _padded_params(o, full, names, n)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), names
    # every rank gathered the same weights
    mine = torch.cat([outs[0][0] for outs in rec.calls.values()])
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    assert all(torch.equal(every[0], e) for e in every)
    # the forward's weights are the reference's, and the bytes are the formula's: a
    # quantized call sends (N-1) messages, an exact one (the post-forward group of
    # reshard_after_forward=int) (w-1)/w of the fp32 padded unit
    for mod, names in unit_params(model):
        comm = mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
        outs = rec.calls[comm.name]
        for got, nm in zip(_padded_params(outs[0], full, names, n), names):
            assert torch.equal(got[:ref[nm].numel()], ref[nm].reshape(-1)), nm
        msg = ref_message_bytes(full, names, n, fmt, block)
        padded = sum(math.ceil(full[nm].shape[0] / n) * n * full[nm][0].numel() for nm in names)
        want_bytes = sum((n - 1) * msg if w == n else (w - 1) * padded * 4 // w for _, w in outs)
        st = state.stats()["units"][comm.name]
        assert st["gather_wire_bytes"] == want_bytes
        assert st["gather_quantized_calls"] == sum(w == n for _, w in outs) >= 1
        assert st["gather_calls"] == len(outs)
    tot = state.stats()["total"]
    assert tot["gather_calls"] == calls
    return {"calls": calls, "gather_wire_ratio": tot["gather_wire_ratio"]}


def _case_preset_block(rank: int, n: int, fmt: str) -> Dict[str, Any]:
    """:func:`_case_grads` with tagc-full's gather block (256) on the wide toy, whose
    segments are not multiples of 256: blocks that cross rows of a parameter, a short
    last block per segment, segments shorter than one block; int8 and int4."""
    segs = [math.ceil(w.shape[0] / n) * w[0].numel()
            for w in ToyGPT(**WIDE).state_dict().values()]
    # the premise: a segment of several blocks with a short last one, and one below a block
    assert any(s > PRESET_BLOCK and s % PRESET_BLOCK for s in segs), segs
    assert any(s < PRESET_BLOCK for s in segs), segs
    out = _case_grads(rank, n, fmt=fmt, block=PRESET_BLOCK, model_kw=WIDE)
    return dict(out, segments=segs)


def _case_modes(rank: int, n: int) -> List[str]:
    """With gradient compression (quant, auto, dense) and gradient accumulation: the
    gradients of gathers-int8 equal those of the same mode on a model whose masters
    are the reference's dequantized weights (the mode sees the same gradients)."""
    done = []
    for mode, kw in (("quant", dict(quant_format="int4", ef21=True)),
                     ("auto", dict(theta=0.9)), ("dense", {})):
        cfg = _cfg(mode=mode, **kw)
        model = _build(cfg)
        full = _full(model)
        state = tagc.register(model, cfg)
        ref = ref_weights(full, n, "int8", BLOCK)
        cfg_b = _cfg(mode=mode, gather="none", **kw)
        model_b = _build(cfg_b, init=ref)
        tagc.register(model_b, cfg_b)
        for m in (model, model_b):
            m.set_requires_gradient_sync(False)
            m(toy_batch(rank, 0)).backward()
            m.set_requires_gradient_sync(True)
            m(toy_batch(rank, 1)).backward()
        a, b = _grads(model), _grads(model_b)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (mode, name)
        assert state.stats()["total"]["gather_quantized_calls"] > 0
        done.append(mode)
    return done


def _case_bf16(rank: int, n: int, fmt: str = "int8", block: int = BLOCK) -> Dict[str, Any]:
    """MixedPrecisionPolicy(param_dtype=bf16): codes of the bf16 shard; the gathered
    weights are the reference's (quantized from the bf16 cast), the messages are the
    same bytes as fp32's (half of the bf16 plain gather's ratio's denominator)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cfg = _cfg(gather=fmt, gather_block=block)
    model = _build(cfg, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    full = _full(model)
    state = tagc.register(model, cfg)
    rec = Recorder(model, state)
    loss = model(toy_batch(rank, 0))
    loss.backward()
    assert torch.isfinite(loss)
    ref = ref_weights({k: v.to(torch.bfloat16) for k, v in full.items()}, n, fmt, block)
    for mod, names in unit_params(model):
        comm = mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
        out = rec.calls[comm.name][0][0]
        assert out.dtype == torch.bfloat16
        rows = out.view(n, -1)
        o = 0
        for name in names:
            w = ref[name]
            c = math.ceil(w.shape[0] / n)
            seg = c * w[0].numel()
            got = rows[:, o:o + seg].reshape(n * c, *w.shape[1:])[:w.shape[0]]
            assert torch.equal(got, w), name
            o += seg
    return {"ratio": state.stats()["total"]["gather_wire_ratio"]}


def _case_nonfinite(rank: int, n: int, fmt: str = "int8") -> Dict[str, Any]:
    """A NaN in one rank's master shard: that unit is gathered exactly on every rank
    (the NaN where it is, every other weight exact), counted; other units quantized."""
    cfg = _cfg(gather=fmt, gather_block=32 if fmt == "fp4" else BLOCK)
    model = _build(cfg)
    target = model.h[0].mlp[0]
    with torch.no_grad():
        if rank == 0:
            target.weight.to_local()[0, 3] = float("nan")
    full = _full(model)
    state = tagc.register(model, cfg)
    rec = Recorder(model, state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(toy_batch(rank, 0))
    name = target._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name
    st = state.stats()["units"][name]
    assert st["gather_nonfinite"] == 1 and st["gather_exact_calls"] == 1
    out = rec.calls[name][0][0]
    w = full["h.0.mlp.0.weight"]
    c = math.ceil(w.shape[0] / n)
    seg = c * w[0].numel()
    got = out.view(n, -1)[:, :seg].reshape(n * c, -1)[:w.shape[0]]
    assert torch.equal(torch.nan_to_num(got, 7.0), torch.nan_to_num(w, 7.0))
    assert torch.isnan(got[0, 3]) and torch.isnan(got).sum() == 1
    others = [u for u, s in state.stats()["units"].items() if u != name and s["gather_calls"]]
    assert others and all(state.stats()["units"][u]["gather_quantized_calls"] >= 1
                          for u in others)
    return {"unit": name}


def _case_exact_switch(rank: int, n: int) -> Dict[str, Any]:
    """Inside state.exact_gathers() the weights are the masters and the loss is plain
    FSDP's, bit for bit; outside again quantized (and different)."""
    cfg = _cfg()
    model = _build(cfg)
    plain = _build(None)
    state = tagc.register(model, cfg)
    x = toy_batch(rank, 5)
    with torch.no_grad():
        want = plain(x)
        with state.exact_gathers():
            exact = model(x)
        quant = model(x)
    assert torch.equal(exact, want)
    assert not torch.equal(quant, want)
    st = state.stats()["total"]
    # the validation's gathers are not training traffic: not counted
    assert st["gather_exact_calls"] == 0 and st["gather_quantized_calls"] > 0
    assert st["gather_calls"] == st["gather_quantized_calls"]
    # a training step after the block gathers quantized weights again (resharded on exit)
    before = state.stats()["total"]["gather_quantized_calls"]
    model(x).backward()
    assert state.stats()["total"]["gather_quantized_calls"] > before
    return {"exact": float(exact), "quant": float(quant)}


def _sharded(model: torch.nn.Module) -> List[bool]:
    """Per parameter: whether the module holds its sharded DTensor (FSDP2 registers the
    unsharded plain tensor while a unit is gathered)."""
    from torch.distributed.tensor import DTensor

    return [isinstance(p, DTensor) for p in model.parameters()]


def _case_exact_switch_kept(rank: int, n: int) -> Dict[str, Any]:
    """exact_gathers() reshards every unit on entry and on exit, seen where it matters:
    with ``reshard_after_forward=False`` every unit stays unsharded after a forward,
    holding the weights it gathered.  So: a quantized forward, then inside the block
    the loss is plain FSDP's (not the quantized weights left by that forward); after
    the block every parameter is sharded again, and the next forward gathers every
    unit once more, quantized, giving the first forward's loss bit for bit (not the
    exact weights left by the block)."""
    cfg = _cfg()
    model = _build(cfg, reshard_after_forward=False)
    plain = _build(None, reshard_after_forward=False)
    state = tagc.register(model, cfg)
    units = [m for m, _ in unit_params(model)]
    x = toy_batch(rank, 5)

    def quantized() -> int:
        return state.stats()["total"]["gather_quantized_calls"]

    with torch.no_grad():
        want = plain(x)
        quant = model(x)
        # the premise: every unit kept its gathered weights after the forward
        assert not any(_sharded(model)), _sharded(model)
        assert quantized() == len(units)
        with state.exact_gathers():
            exact = model(x)
            assert not any(_sharded(model))  # the block's own forward kept them too
        resharded = _sharded(model)
        again = model(x)
    assert torch.equal(exact, want), (float(exact), float(want), float(quant))
    assert not torch.equal(quant, want)
    assert torch.equal(again, quant), (float(again), float(quant), float(exact))
    assert quantized() == 2 * len(units), (quantized(), len(units))
    assert all(resharded), resharded
    return {"exact": float(exact), "quant": float(quant), "units": len(units)}


class _SavedWeights:
    """What autograd computed with: each watched Linear's weight as saved by its
    forward (at pack time) and as read by its backward (at unpack time, after FSDP
    re-gathered it), through ``torch.autograd.graph.saved_tensors_hooks``."""

    def __init__(self, mods: Dict[str, torch.nn.Module]) -> None:
        self.mods = mods
        self.forward: Dict[str, torch.Tensor] = {}
        self.backward: Dict[str, torch.Tensor] = {}

    def _owner(self, t: torch.Tensor) -> Optional[Tuple[str, Tuple[Any, ...]]]:
        """The watched module whose gathered weight ``t`` views (the same storage), with
        that weight's layout (size, stride, offset), or None."""
        from torch.distributed.tensor import DTensor

        ptr = t.untyped_storage().data_ptr()
        for name, m in self.mods.items():
            w = m.weight
            if isinstance(w, DTensor):  # sharded now: not the one being computed with
                continue
            if ptr and w.untyped_storage().data_ptr() == ptr and t.numel() == w.numel():
                return name, (w.shape, w.stride(), w.storage_offset())
        return None

    @staticmethod
    def _copy(t: torch.Tensor, layout: Tuple[Any, ...]) -> torch.Tensor:
        """The weight ``t`` views, flat in its own element order (a Linear saves
        ``weight.t()``, and a square one's shape does not tell)."""
        return t.detach().as_strided(*layout).reshape(-1).clone()

    def pack(self, t: torch.Tensor) -> Tuple[Any, torch.Tensor]:
        owner = self._owner(t)
        if owner is not None:
            name, layout = owner
            assert name not in self.forward, name  # one saved weight per module
            self.forward[name] = self._copy(t, layout)
        return owner, t

    def unpack(self, packed: Tuple[Any, torch.Tensor]) -> torch.Tensor:
        owner, t = packed
        if owner is not None:
            name, layout = owner
            self.backward[name] = self._copy(t, layout)
        return t


def _case_regather(rank: int, n: int) -> Dict[str, Any]:
    """Units that really gather twice (``reshard_after_forward=True``; no unit here is
    the root, which holds no parameter): each unit's comm is called exactly twice per
    step, both quantized, the second after the forward freed the unsharded weights;
    and every Linear's backward computed with the very weights its forward did
    (autograd's saved tensors: the weight saved at the forward equals the one read at
    the backward, bit for bit), which are the reference's dequantized weights, not
    the masters."""
    cfg = _cfg()
    model = _build(cfg, reshard_after_forward=True)
    full = _full(model)
    state = tagc.register(model, cfg)
    rec = Recorder(model, state)
    root_params = list(model.parameters(recurse=False))
    assert not root_params  # every parameter lives in a non-root unit
    linears = {n_: m for n_, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    saved = _SavedWeights(linears)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        loss = model(toy_batch(rank, 0))
    after_forward = {n_: len(c) for n_, c in rec.calls.items()}
    assert all(_sharded(model)), "reshard_after_forward=True: every unit freed after forward"
    loss.backward()
    units = unit_params(model)
    for mod, _ in units:
        name = mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name
        assert after_forward[name] == 1, (name, after_forward[name])
        assert len(rec.calls[name]) == 2, (name, len(rec.calls[name]))
        st = state.stats()["units"][name]
        assert st["gather_quantized_calls"] == 2 and st["gather_exact_calls"] == 0, (name, st)
    assert set(saved.forward) == set(saved.backward) == set(linears), \
        (sorted(saved.forward), sorted(saved.backward), sorted(linears))
    ref = ref_weights(full, n, "int8", BLOCK)
    for name in linears:
        fwd, bwd = saved.forward[name], saved.backward[name]
        assert torch.equal(fwd, bwd), (name, float((fwd - bwd).abs().max()))
        want = ref[f"{name}.weight"].reshape(-1)
        assert torch.equal(bwd, want), name
        assert not torch.equal(bwd, full[f"{name}.weight"].reshape(-1)), name
    return {"linears": sorted(linears), "units": len(units)}


def _case_checkpoint(rank: int, n: int) -> str:
    """After optimizer steps, the model's state dict (what DCP saves) holds the exact
    masters, not their quantized view: equal to the weights gathered exactly, and not
    to the reference's dequantization of them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    cfg = _cfg()
    model = _build(cfg)
    tagc.register(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(toy_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    sd = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    masters = _full(model)
    ref = ref_weights(masters, n, "int8", BLOCK)
    assert sd.keys() == masters.keys()
    assert all(torch.equal(sd[k], masters[k]) for k in sd)
    assert any(not torch.equal(sd[k], ref[k]) for k in sd)
    return "ok"


def _padded_rows(full: Dict[str, torch.Tensor], names: List[str], world: int) -> torch.Tensor:
    """The unit's gather output by the test's own layout: (world, shard) rows, row r
    every parameter's dim-0 chunk r, zero padded to ``ceil(rows / world)`` rows."""
    rows = []
    for r in range(world):
        segs = []
        for nm in names:
            w = full[nm]
            c = math.ceil(w.shape[0] / world)
            part = w[r * c:(r + 1) * c].reshape(-1)
            pad = torch.zeros(c * w[0].numel(), dtype=w.dtype)
            pad[:part.numel()] = part
            segs.append(pad)
        rows.append(torch.cat(segs))
    return torch.stack(rows)


def _segment_lengths(full: Dict[str, torch.Tensor], names: List[str], world: int) -> List[int]:
    return [math.ceil(full[nm].shape[0] / world) * full[nm][0].numel() for nm in names]


def _delta_want(held: torch.Tensor, rows: torch.Tensor, lengths: List[int],
                fmt: str) -> torch.Tensor:
    """The test's protocol of one ``gather_delta`` call: per rank row and segment,
    ``held + dequant(rows - held)`` in fp32, rounded to the gather dtype."""
    want = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        o = 0
        for ln in lengths:
            h = held[r, o:o + ln].float()
            change = ref_dequant(rows[r, o:o + ln].float() - h, fmt, BLOCK)
            want[r, o:o + ln] = (h + change).to(rows.dtype)
            o += ln
    return want


def _case_delta(rank: int, n: int, fmt: str = "int4", bf16: bool = False) -> Dict[str, Any]:
    """``gather_delta`` against the test's own protocol: a unit's first call is the
    exact gather; each later forward hands FSDP ``prev + dequant(masters' rows - prev)``
    per rank and segment (the test's quantizer, in the gather dtype); the backward
    re-gather of a step equals its forward bit for bit and sends the flag bytes only;
    every rank holds the same weights; they trail the masters by less than a quarter of
    plain codes' error; the bytes are the formula's (one flag byte per message, N - 1
    per re-gather); ``held`` memory is the formula's; a TAGC state load restarts from
    an exact gather."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cfg = _cfg(gather=fmt, gather_delta=True)
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
    model = _build(cfg, reshard_after_forward=True, **mp)
    state = tagc.register(model, cfg)
    rec = Recorder(model, state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    units = [(mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name, names)
             for mod, names in unit_params(model)]
    dt = torch.bfloat16 if bf16 else torch.float32
    prev: Dict[str, torch.Tensor] = {}
    worst = {"delta": 0.0, "plain": 0.0}
    steps = 4
    for step in range(steps):
        full = {k: v.to(dt) for k, v in _full(model).items()}
        for name, _ in units:
            rec.calls.pop(name, None)
        model(toy_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
        for name, names in units:
            (fwd, w), (bwd, _) = rec.calls[name]
            assert w == n and fwd.dtype == dt
            assert torch.equal(fwd, bwd), (name, step)  # the re-gather flags no change
            rows = _padded_rows(full, names, n)
            got = fwd.view(n, -1)
            if step == 0:
                want = rows  # the first call is exact
            else:
                want = _delta_want(prev[name], rows, _segment_lengths(full, names, n), fmt)
                plain = torch.cat([ref_dequant(rows[r], fmt, BLOCK) for r in range(n)])
                worst["delta"] = max(worst["delta"], float((want.float() - rows.float()).abs().max()))
                worst["plain"] = max(worst["plain"],
                                     float((plain.float() - rows.reshape(-1).float()).abs().max()))
            assert torch.equal(got, want), (name, step, float((got.float() - want.float()).abs().max()))
            prev[name] = got.clone()
    if not bf16:  # bf16's own rounding of the weights bounds both alike
        assert worst["delta"] < worst["plain"] / 4, worst
    mine = torch.cat([prev[name].reshape(-1) for name, _ in units]).float()
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine)
    assert all(torch.equal(every[0], e) for e in every)
    full = _full(model)
    held = 0
    for name, names in units:
        st = state.stats()["units"][name]
        msg = ref_message_bytes(full, names, n, fmt, BLOCK) + 1
        shard = sum(_segment_lengths(full, names, n))
        exact_bytes = (n - 1) * shard * (2 if bf16 else 4)
        assert st["gather_exact_calls"] == 1 and st["gather_quantized_calls"] == 2 * steps - 1
        assert st["gather_unchanged_calls"] == steps  # every backward re-gather
        assert st["gather_wire_bytes"] == \
            exact_bytes + (steps - 1) * (n - 1) * msg + steps * (n - 1)
        held += (n + 1) * shard * (2 if bf16 else 4)
    assert state.stats()["memory"]["gather_held_bytes"] == held
    # a TAGC state load forgets the reconstruction: the next call of every unit is exact
    state.load_state_dict(state.state_dict())
    assert state.stats()["memory"]["gather_held_bytes"] == 0
    model(toy_batch(rank, steps)).backward()
    for name, _ in units:
        st = state.stats()["units"][name]
        assert st["gather_exact_calls"] == 2 and st["gather_quantized_calls"] == 2 * steps
    return {"worst": worst}


def _case_delta_moved(rank: int, n: int) -> Dict[str, Any]:
    """``gather_delta`` when one rank's master moves between a forward and its backward
    (rank 0 writes into its shard): the flag round sees it, so that unit's backward
    re-gather sends every message and hands FSDP the protocol's weights on every rank
    (the forward's, plus rank 0's coded change); the other units send flags only."""
    cfg = _cfg(gather="int8", gather_delta=True)
    model = _build(cfg, reshard_after_forward=True)
    target = model.h[0].mlp[0]
    state = tagc.register(model, cfg)
    rec = Recorder(model, state)
    units = {mod._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name: names
             for mod, names in unit_params(model)}
    name = target._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name
    model(toy_batch(rank, 0)).backward()  # the first calls: exact, then flags
    before = {u: dict(s) for u, s in state.stats()["units"].items()}
    rec.calls.clear()
    loss = model(toy_batch(rank, 1))
    with torch.no_grad():
        if rank == 0:
            target.weight.to_local()[0, :5] += 0.25
    loss.backward()
    full = _full(model)
    for u, names in units.items():
        (fwd, _), (bwd, _) = rec.calls[u]
        st, was = state.stats()["units"][u], before[u]
        flags_only = st["gather_unchanged_calls"] - was["gather_unchanged_calls"]
        if u != name:
            assert torch.equal(fwd, bwd) and flags_only == 1, u
            continue
        assert flags_only == 0
        rows = _padded_rows(full, names, n)
        want = _delta_want(fwd.view(n, -1), rows, _segment_lengths(full, names, n), "int8")
        assert torch.equal(bwd.view(n, -1), want)
        assert not torch.equal(bwd, fwd) and torch.equal(bwd.view(n, -1)[1:], fwd.view(n, -1)[1:])
        msg = ref_message_bytes(full, names, n, "int8", BLOCK) + 1
        assert st["gather_wire_bytes"] - was["gather_wire_bytes"] == (n - 1) * (2 * msg + 1)
    every = [torch.empty_like(rec.calls[name][1][0]) for _ in range(n)]
    dist.all_gather(every, rec.calls[name][1][0])
    assert all(torch.equal(every[0], e) for e in every)
    return {"unit": name}


def _case_delta_nonfinite(rank: int, n: int) -> Dict[str, Any]:
    """``gather_delta`` and a NaN in rank 0's masters after the first step: that call
    falls back to the exact gather (the NaN where it is), and so does the next one once
    the weight is finite again (the change from a NaN is NaN); then the unit is
    quantized again and its weights are finite.  A fallback counts its quantized
    attempt too."""
    cfg = _cfg(gather="int8", gather_delta=True)
    model = _build(cfg)
    target = model.h[0].mlp[0]
    state = tagc.register(model, cfg)
    name = target._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm.name
    rec = Recorder(model, state)
    x = toy_batch(rank, 0)

    def counts() -> Tuple[int, int, int]:
        st = state.stats()["units"][name]
        return st["gather_exact_calls"], st["gather_quantized_calls"], st["gather_nonfinite"]

    with torch.no_grad():
        model(x)
        assert counts() == (1, 0, 0)
        keep = target.weight.to_local()[0, 3].item()
        if rank == 0:
            target.weight.to_local()[0, 3] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x)
            assert counts() == (2, 1, 1)
            assert int(torch.isnan(rec.calls[name][-1][0]).sum()) == 1
            if rank == 0:
                target.weight.to_local()[0, 3] = keep
            model(x)
        assert counts() == (3, 2, 2)
        model(x)
        assert counts() == (3, 3, 2)
        assert bool(torch.isfinite(rec.calls[name][-1][0]).all())
    return {"unit": name}


def _case_hsdp(rank: int, n: int) -> Dict[str, Any]:
    """TAGC's custom HSDP, 2 replicas x 2 shards: the gathers (inside a node, over the
    shard group) are quantized as on FULL_SHARD with N=2, and the gradients equal those
    of the same HSDP model whose masters are the reference's weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("replicate", "shard"))
    cfg = _cfg()
    model = _build(cfg, mesh=mesh)
    full = _full(model)
    state = tagc.register(model, cfg, mesh=mesh)
    ref = ref_weights(full, 2, "int8", BLOCK)
    cfg_b = _cfg(gather="none")
    model_b = _build(cfg_b, init=ref, mesh=mesh)
    tagc.register(model_b, cfg_b, mesh=mesh)
    for m in (model, model_b):
        m(toy_batch(rank, 0)).backward()
    a, b = _grads(model), _grads(model_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    st = state.stats()["total"]
    assert st["gather_quantized_calls"] > 0 and st["gather_exact_calls"] == 0
    return {"ratio": st["gather_wire_ratio"]}


def _case_bad_input(rank: int, n: int) -> List[str]:
    """FSDP1 with gather: a clear error naming FSDP2; bad knobs raise."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    msgs = []
    cfg = _cfg()
    torch.manual_seed(0)
    m = ToyGPT()
    fsdp1 = FSDP(m, auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(m, cfg),
                 device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match="FSDP2") as e:
        tagc.register(fsdp1, cfg)
    msgs.append(str(e.value))
    for bad in (dict(gather="int2"), dict(gather="fp8"), dict(gather_block=0),
                dict(gather_block=65537), dict(gather_block=True),
                dict(gather="fp4", gather_block=24), dict(gather="fp4", gather_block=512),
                dict(gather="fp4", gather_block=1), dict(gather_rotate=True),
                dict(gather="fp4", gather_block=32, gather_rotate=1),
                dict(gather="fp4", gather_block=32, gather_delta=True),
                dict(gather="none", gather_delta=True), dict(gather_delta=1)):
        with pytest.raises(ValueError, match="gather"):
            _cfg(**bad)
    return msgs


def _case_pair_exchange(rank: int, n: int) -> Dict[str, Any]:
    """On two gloo ranks the gathers go as one isend/irecv exchange
    (tagc.comm.pair_all_gather), from three ranks on as gloo's all-gather; the
    gradients are the reference's either way (_case_grads)."""
    import tagc.comm

    seen: List[int] = []
    inner = tagc.comm.pair_all_gather

    def counted(*a: Any, **k: Any) -> None:
        seen.append(1)
        inner(*a, **k)

    tagc.comm.pair_all_gather = counted
    try:
        _case_grads(rank, n)
        _case_exact_switch(rank, n)  # the exact gathers take the same route
    finally:
        tagc.comm.pair_all_gather = inner
    assert (len(seen) > 0) == (n == 2), (n, len(seen))
    # the exchange itself against gloo's all-gather: every dtype, sizes 0, 1, odd, large,
    # the input as the output's own row (FSDP2's in-place call) or apart
    assert tagc.comm.exchanges_pairwise(None, n, torch.zeros(1)) == (n == 2)
    assert not tagc.comm.exchanges_pairwise(None, 3, torch.zeros(1))
    if n == 2:
        gen = torch.Generator().manual_seed(rank)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
            for numel in (0, 1, 7, 100_003):
                inp = (torch.rand(numel, generator=gen) * 200).to(dtype)
                want = torch.empty(2 * numel, dtype=dtype)
                dist.all_gather_into_tensor(want, inp)
                apart = torch.full((2 * numel,), 3, dtype=dtype)
                tagc.comm.pair_all_gather(apart, inp, rank, None)
                inplace = torch.zeros(2, numel, dtype=dtype)
                inplace[rank].copy_(inp)
                tagc.comm.pair_all_gather(inplace, inplace[rank], rank, None)
                assert torch.equal(apart, want) and torch.equal(inplace.view(-1), want), \
                    (dtype, numel)
    return {"pair_calls": len(seen)}


def _suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    cases = [
        ("grads", _case_grads),
        ("grads_int4", lambda r, w: _case_grads(r, w, fmt="int4")),
        ("grads_fp4", lambda r, w: _case_grads(r, w, fmt="fp4", block=32)),
        # the wide toy: segments not multiples of the block, one below it
        ("grads_fp4_rotated", lambda r, w: _case_grads(r, w, fmt="fp4", block=16,
                                                       model_kw=WIDE, rotate=True)),
        ("nonfinite_fp4", lambda r, w: _case_nonfinite(r, w, "fp4")),
        ("bf16_fp4", lambda r, w: _case_bf16(r, w, "fp4", 32)),
        ("no_reshard", lambda r, w: _case_grads(r, w, reshard=False)),
        ("prefetch", lambda r, w: _case_grads(r, w, prefetch=True)),
        ("modes", _case_modes),
        ("bf16", _case_bf16),
        ("nonfinite", _case_nonfinite),
        ("exact_switch", _case_exact_switch),
        ("exact_switch_kept", _case_exact_switch_kept),
        ("regather", _case_regather),
        ("preset_block_int8", lambda r, w: _case_preset_block(r, w, "int8")),
        ("preset_block_int4", lambda r, w: _case_preset_block(r, w, "int4")),
        ("checkpoint", _case_checkpoint),
        ("delta_int4", _case_delta),
        ("delta_int8", lambda r, w: _case_delta(r, w, "int8")),
        ("delta_bf16", lambda r, w: _case_delta(r, w, "int4", bf16=True)),
        ("delta_nonfinite", _case_delta_nonfinite),
        ("delta_moved", _case_delta_moved),
        ("bad_input", _case_bad_input),
        ("pair_exchange", _case_pair_exchange),
    ]
    if n == 4:  # reshard to a group of 2 after forward: the backward gather is exact
        cases.append(("reshard_int", lambda r, w: _case_grads(r, w, reshard=2)))
        cases.append(("hsdp", _case_hsdp))
    return run_cases(rank, n, cases)


SPAWN = SharedSpawn(_suite, timeout=400)
CASES = ["grads", "grads_int4", "grads_fp4", "grads_fp4_rotated", "nonfinite_fp4", "bf16_fp4",
         "no_reshard", "prefetch", "modes", "bf16", "nonfinite",
         "exact_switch", "exact_switch_kept", "regather", "preset_block_int8",
         "preset_block_int4", "checkpoint", "delta_int4", "delta_int8", "delta_bf16",
         "delta_nonfinite", "delta_moved", "bad_input", "pair_exchange"]


@pytest.mark.parametrize("case", CASES)
def test_gather_n2(case: str) -> None:
    SPAWN.case(2, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n", [3, 4])
def test_gather_n3_n4(n: int, case: str) -> None:
    SPAWN.case(n, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["reshard_int", "hsdp"])
def test_gather_n4_groups(case: str) -> None:
    """reshard_after_forward=2 and 2 x 2 HSDP: gathers over a group of 2 of 4 ranks."""
    SPAWN.case(4, case)


def test_gather_n1() -> None:
    """One rank: FSDP never calls the comm; training works and counts no gather."""
    from dist_helpers import run_dist
    run_dist(_one_rank, 1)


def _one_rank(rank: int, n: int) -> None:
    cfg = _cfg()
    model = _build(cfg)
    state = tagc.register(model, cfg)
    model(toy_batch(0, 0)).backward()
    assert state.stats()["total"]["gather_calls"] == 0
