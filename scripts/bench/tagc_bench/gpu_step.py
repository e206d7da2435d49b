"""One bf16 training step of GPT-2 124M on one GPU, without and with TAGC's codec.

On one rank FSDP never reduces, so TAGC's hook never runs there.  This measures what the
hook would add to a step: the model (``tagc.train.model.GPT``, GPT-2 small's shapes) is
split into the units ``tagc.shard_model`` would make (``tagc.selection.modules_to_wrap``),
and when the last gradient of a unit has been accumulated (a post-accumulate-grad hook,
the moment FSDP would call the reduce-scatter) the unit's flat gradient is encoded and
decoded on a side stream, as the hook does on its codec stream, overlapped with the rest
of the backward; the optimizer step waits for it.  The hook on N ranks encodes N-1 of
its N shards and decodes N-1 messages: encoding and decoding the whole unit once is the
large-N bound.  Not included: EF21's estimate update (two element-wise passes), the
non-finite vote, the network.

Variants: ``plain`` (no codec), ``int4+EF`` (int4 codes with error feedback: the code of
tagc-balanced and tagc-full's gradients), ``ternary`` (tagc-lean's, no feedback), and the
hook itself: each unit's ``UnitReducer`` with tagc-balanced's config, rank 0 of two ranks
on the loopback stand-in for the other rank (``tagc_bench.cuda_hook.LoopbackComm``: its
copies in place of NCCL), on the general path (several calls, the residual decoded into
an fp32 copy and coded back) and on the unit path (``_tagc.quant_unit_encode`` /
``quant_unit_decode``): issue 57's before and after.  Also
timed alone: each variant's codec over every unit (no overlap), and tagc-full's gather
codec (int8 weights, every unit's parameters encoded and decoded to bf16, twice a step:
the forward gather and the backward re-gather), and the host microseconds per unit of
each call the codec makes (a step whose launching thread is its bound pays those).

Usage::

    python3 scripts/bench/tagc_bench/gpu_step.py --json step.json  # GPU, GPT-2 124M
    # a check of the code
    python3 scripts/bench/tagc_bench/gpu_step.py --device cpu --shape tiny --steps 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from tagc.codec import _tagc
from tagc.config import TAGCConfig
from tagc.selection import modules_to_wrap
from tagc.train.model import GPT, GPTConfig

if not __package__:  # run as a file: the folder holding tagc_bench onto the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tagc_bench.cuda_hook import loopback, unit_reducers  # noqa: E402
from tagc_bench.cuda_ops import require_device  # noqa: E402

BLOCK = 256
SHAPES = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304),
          "tiny": dict(n_layer=2, n_head=4, n_embd=128, vocab_size=1024)}


def unit_params(model: nn.Module, cfg: TAGCConfig) -> List[Tuple[str, List[nn.Parameter]]]:
    """The parameters of each unit ``tagc.shard_model(model, cfg)`` would make: every
    module of ``modules_to_wrap`` holds the parameters below it that no deeper unit
    holds; the root holds the rest (tied weights, norms, position embeddings).

    Returns:
        (unit name, parameters), the root last; tied parameters once.
    """
    units = {id(m) for m in modules_to_wrap(model, cfg)}
    names = {id(m): name for name, m in model.named_modules()}
    owner: Dict[str, List[nn.Parameter]] = {}
    for pname, p in model.named_parameters():  # a tied parameter once, under its first name
        mod_path = pname.rsplit(".", 1)[0] if "." in pname else ""
        best = "<root>"
        parts = mod_path.split(".") if mod_path else []
        mod: Any = model
        for part in parts:
            mod = getattr(mod, part) if not part.isdigit() else mod[int(part)]
            if id(mod) in units:
                best = names[id(mod)]
        owner.setdefault(best, []).append(p)
    root = owner.pop("<root>", [])
    out = list(owner.items())
    if root:
        out.append(("<root>", root))
    return out


class GradCodec:
    """The codec work TAGC's hook would do on every unit's gradient, on a side stream.

    Args:
        units: :func:`unit_params`.
        fmt: the quant format.
        feedback: keep an fp32 residual per unit (error feedback) or not.
        device: where the model lives.
    """

    def __init__(self, units: List[Tuple[str, List[nn.Parameter]]], fmt: str, feedback: bool,
                 device: torch.device) -> None:
        self.units, self.fmt, self.feedback, self.device = units, fmt, feedback, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.kw = {"stream": self.stream.cuda_stream} if self.cuda else {}
        sizes = [sum(p.numel() for p in ps) for _, ps in units]
        self.bufs = [torch.empty(_tagc.quant_bytes(n, fmt, BLOCK), dtype=torch.uint8,
                                 device=device) for n in sizes]
        self.accs = [torch.zeros(n, device=device) for n in sizes]
        self.res = [torch.zeros(n, device=device) if feedback else None for n in sizes]
        self.numel = sum(sizes)
        self.left: List[int] = []
        self.handles = []
        for i, (_, ps) in enumerate(units):
            for p in ps:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self.reset()

    def reset(self) -> None:
        """Before a backward: every unit waits for all its gradients again."""
        self.left = [len(ps) for _, ps in self.units]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self.left[i] -= 1
            if self.left[i] == 0:
                self.run_unit(i)
        return hook

    def run_unit(self, i: int) -> None:
        """Unit i's flat gradient (FSDP's copy-in), encoded and decoded on the side
        stream after the work that produced it."""
        ps = self.units[i][1]
        if self.stream is None:
            self._codec(i, ps)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._codec(i, ps)

    def _codec(self, i: int, ps: List[nn.Parameter]) -> None:
        self.encode(i, self.flat(i))
        self.decode(i)

    def host_calls(self, flats: List[torch.Tensor]) -> Dict[str, Callable[[int], Any]]:
        """What :func:`host_breakdown` times, by name (``whole unit`` last)."""
        return {"flatten": self.flat, "encode": lambda i: self.encode(i, flats[i]),
                "decode": self.decode, "whole unit": self.run_unit}

    def flat(self, i: int) -> torch.Tensor:
        """Unit i's gradients as one fp32 vector (FSDP's copy-in)."""
        return torch.cat([p.grad.reshape(-1).float() for p in self.units[i][1]])

    def encode(self, i: int, flat: torch.Tensor) -> None:
        """Unit i's code (and residual) from its flat gradient."""
        _tagc.quant_encode(self.bufs[i], self.res[i], flat, self.fmt, BLOCK, **self.kw)

    def decode(self, i: int) -> None:
        """Unit i's code decoded into its zeroed accumulator."""
        self.accs[i].zero_()
        _tagc.quant_decode_add(self.accs[i], self.bufs[i], self.fmt, BLOCK, **self.kw)

    def join(self) -> None:
        """The caller's stream waits for every unit's codec work (before the optimizer)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class HookCodec(GradCodec):
    """The hook's own reduction per unit: a :class:`UnitReducer` with a preset's config,
    rank 0 of two ranks on the loopback stand-in for rank 1, on the unit path or the
    general one (``UNIT_PATH``).  The reducer runs on its own codec stream, as in FSDP.

    Args:
        units: :func:`unit_params`.
        preset: the shipped preset.
        unit_path: whether the reducers may take the unit path.
        device: where the model lives.
    """

    WORLD = 2

    def __init__(self, units: List[Tuple[str, List[nn.Parameter]]], preset: str,
                 unit_path: bool, device: torch.device) -> None:
        cfg = TAGCConfig.preset(preset)
        self.fmt, self.feedback = cfg.quant_format, cfg.feeds_back
        self.units, self.device = units, device
        self.cuda = device.type == "cuda"
        self.stream = None  # the reducers switch to their codec stream themselves
        pad = self.WORLD * cfg.quant_block  # FSDP pads every unit to whole shards
        sizes = [sum(p.numel() for p in ps) for _, ps in units]
        self.sizes = [-(-n // pad) * pad for n in sizes]
        self.reducers = unit_reducers(cfg, self.sizes, device, self.WORLD, unit_path=unit_path,
                                      names=[name for name, _ in units])
        self.outs = [torch.empty(n // self.WORLD, device=device) for n in self.sizes]
        self.numel = sum(sizes)
        self.left, self.handles = [], []
        for i, (_, ps) in enumerate(units):
            for p in ps:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))
        self.reset()

    def flat(self, i: int) -> torch.Tensor:
        """Unit i's gradients as FSDP's padded fp32 reduce-scatter input."""
        g = super().flat(i)
        return torch.nn.functional.pad(g, (0, self.sizes[i] - g.numel()))

    def encode(self, i: int, flat: torch.Tensor) -> None:
        """The whole reduction of unit i (both sides, the loopback between)."""
        with loopback():
            self.reducers[i].reduce(flat, self.outs[i])

    def decode(self, i: int) -> None:
        """Nothing: :meth:`encode` is the whole reduction."""

    def join(self) -> None:
        if self.cuda:
            self.reducers[0].streams.join()

    def host_calls(self, flats: List[torch.Tensor]) -> Dict[str, Callable[[int], Any]]:
        return {"flatten": self.flat, "reduce (hook)": lambda i: self.encode(i, flats[i]),
                "whole unit": self.run_unit}


# (variant, its codec: None for none)
VARIANTS: List[Tuple[str, Optional[Callable[[Any, torch.device], GradCodec]]]] = [
    ("plain", None),
    ("int4+EF (tagc-balanced, tagc-full)", lambda u, d: GradCodec(u, "int4", True, d)),
    ("ternary (tagc-lean)", lambda u, d: GradCodec(u, "ternary", False, d)),
    ("tagc-balanced hook, general path", lambda u, d: HookCodec(u, "balanced", False, d)),
    ("tagc-balanced hook, unit path", lambda u, d: HookCodec(u, "balanced", True, d))]


def host_breakdown(codec: GradCodec, reps: int = 6) -> Dict[str, float]:
    """Host microseconds per unit of each call the codec makes (the gradients in place):
    where a step bound by its launching thread spends the codec's time.

    Args:
        codec: the codec, its units' gradients present.
        reps: passes over every unit; the median after the first is kept.
    Returns:
        microseconds per unit of each of ``codec.host_calls`` (``flatten``: torch.cat;
        ``encode``, ``decode``: zero the accumulator, decode into it; the hook's:
        ``reduce (hook)``; ``whole unit``: ``run_unit``), and ``order`` (the rest of
        ``run_unit``: the wait for the caller's stream and the stream switch).
    """
    n = len(codec.units)
    flats = [codec.flat(i) for i in range(n)]
    calls = codec.host_calls(flats)
    out: Dict[str, float] = {}
    for name, fn in calls.items():
        times = []
        for _ in range(reps):
            if codec.cuda:
                torch.cuda.synchronize(codec.device)
            t0 = time.perf_counter()
            for i in range(n):
                fn(i)
            times.append((time.perf_counter() - t0) * 1e6 / n)
        out[name] = statistics.median(times[1:] if reps > 1 else times)
    codec.join()
    out["order"] = 2 * out["whole unit"] - sum(out.values())
    return out


class Timer:
    """Milliseconds of a region: CUDA events on a GPU, the host clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        # host milliseconds to enqueue the last region: near the device time, the
        # region is bound by the launching thread, not by the GPU
        self.host_ms = 0.0

    def __call__(self, fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        if not self.cuda:
            fn()
            self.host_ms = (time.perf_counter() - t0) * 1e3
            return self.host_ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        self.host_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


def gather_codec_ms(units: List[Tuple[str, List[nn.Parameter]]], device: torch.device,
                    timer: Timer, reps: int) -> float:
    """tagc-full's parameter gathers alone: every unit's fp32 parameters (one segment per
    parameter) to int8 codes and back to bf16, twice (forward gather, backward re-gather);
    milliseconds per step."""
    kw = {"stream": torch.cuda.current_stream(device).cuda_stream} if device.type == "cuda" \
        else {}
    work = []
    for _, ps in units:
        flat = torch.cat([p.detach().reshape(-1).float() for p in ps])
        segs = torch.tensor([p.numel() for p in ps], dtype=torch.int64)
        buf = torch.empty(_tagc.wq_bytes(segs, "int8", BLOCK), dtype=torch.uint8, device=device)
        out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=device)
        work.append((flat, segs.to(device) if device.type == "cuda" else segs, buf, out))

    def once() -> None:
        for _ in range(2):
            for flat, segs, buf, out in work:
                _tagc.wq_encode(buf, flat, segs, "int8", BLOCK, **kw)
                _tagc.wq_decode(out, buf, segs, "int8", BLOCK, **kw)

    once()
    return statistics.median(timer(once) for _ in range(reps))


def run(device: torch.device, gcfg: GPTConfig, batch: int, steps: int, warmup: int,
        log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Time the variants.

    Args:
        device: the GPU (or the CPU: a check of the code, not a measurement).
        gcfg: the model.
        batch: sequences per step (each ``gcfg.block_size`` tokens).
        steps: timed steps per variant (after ``warmup``).
        log: progress lines.
    Returns:
        the results (JSON-ready).
    """
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = GPT(gcfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    units = unit_params(model, TAGCConfig.preset("balanced"))
    timer = Timer(cuda)
    gen = torch.Generator(device=device).manual_seed(1)
    idx = torch.randint(gcfg.vocab_size, (batch, gcfg.block_size), device=device, generator=gen)
    tgt = torch.roll(idx, -1, dims=1)

    def step(codec: Optional[GradCodec]) -> None:
        if codec is not None:
            codec.reset()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        if codec is not None:
            codec.join()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (not a measurement)",
        "model": {k: getattr(gcfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                 "block_size")},
        "params": model.num_params(), "batch": batch, "tokens_per_step": batch * gcfg.block_size,
        "units": len(units), "steps": steps, "warmup": warmup, "variants": []}
    plain_ms = None
    for name, make in VARIANTS:
        if make and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            out["variants"].append({"name": name, "skipped": f"torch {torch.__version__} has "
                                    "no Tensor.register_post_accumulate_grad_hook"})
            continue
        codec = make(units, device) if make else None
        for _ in range(warmup):
            step(codec)
        times, host = [], []
        for _ in range(steps):
            times.append(timer(lambda: step(codec)))
            host.append(timer.host_ms)
        row: Dict[str, Any] = {"name": name, "format": codec and codec.fmt,
                               "error_feedback": bool(codec and codec.feedback),
                               "step_ms_mean": statistics.fmean(times),
                               "step_ms_median": statistics.median(times),
                               "host_ms_median": statistics.median(host)}
        if plain_ms is None:
            plain_ms = row["step_ms_median"]
        row["overhead_ms"] = row["step_ms_median"] - plain_ms
        row["overhead_pct"] = 100.0 * row["overhead_ms"] / plain_ms
        if codec is not None:
            # the codec alone on the last step's gradients: every unit, back to back
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(idx, tgt)
            codec.reset()
            for h in codec.handles:
                h.remove()
            loss.backward()

            def every_unit() -> None:
                for i in range(len(units)):
                    codec.run_unit(i)
                codec.join()

            row["codec_alone_ms"] = statistics.median(timer(every_unit) for _ in range(3))
            row["host_us_per_unit"] = host_breakdown(codec)
            row["grad_elements"] = codec.numel
            opt.zero_grad(set_to_none=True)
        out["variants"].append(row)
        log(f"{name}: step {row['step_ms_median']:.2f} ms (median of {steps}; host "
            f"{row['host_ms_median']:.2f} ms to enqueue it), +{row['overhead_ms']:.2f} ms"
            + (f", codec alone {row['codec_alone_ms']:.2f} ms" if codec else ""))
    out["gather_codec_ms"] = gather_codec_ms(units, device, timer, 3)
    log(f"tagc-full gather codec (int8, 2 gathers per step, alone): "
        f"{out['gather_codec_ms']:.2f} ms")
    if cuda:
        out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """Command line (see the module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default="gpt2-124m", choices=sorted(SHAPES))
    ap.add_argument("--context", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8,
                    help="sequences per step (halved while the GPU runs out of memory)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    require_device("gpu_step", args.device)
    device = torch.device(args.device)
    gcfg = GPTConfig(block_size=args.context, **SHAPES[args.shape])
    batch, res = args.batch, None
    while res is None:
        try:
            res = run(device, gcfg, batch, args.steps, args.warmup)
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            print(f"gpu_step: out of memory; batch {batch}", flush=True)
        if res is None:  # the failed run's tensors are gone once the exception is
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
