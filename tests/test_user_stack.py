"""The models and the stack users train with, on 2 gloo ranks.

Two parts.  TAGC's wrapping helpers (``shard_model``, ``fsdp1_auto_wrap_policy``) on
models whose forward reads a child's parameters instead of calling the child (stock
``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, a root computing its head
with the embedding's weight): such a child must stay in its reader's unit, or the
first forward computes with a sharded parameter.  And the stack a user builds without
those helpers: FSDP2 ``fully_shard`` per GPT block then the root, activation
checkpointing and ``torch.compile`` per block, then ``register`` with the recommended
presets: every unit compressed, and the losses of 8 steps those of the same run
without compile (or without checkpointing).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_helpers import SharedSpawn, run_cases

import tagc_hook as tagc
from tagc.selection import direct_reads, modules_to_wrap

pytestmark = [pytest.mark.codec]
WIDTH = 256  # MultiheadAttention's out_proj (256 x 256) reaches the presets' min_numel
STEPS = 8


# --------------------------------------------------------------------------- models

class MHABlock(nn.Module):
    """A pre-norm block around stock ``nn.MultiheadAttention``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class MHAModel(nn.Module):
    """Token embedding, two MultiheadAttention blocks, an untied head."""

    def __init__(self, d: int = WIDTH, vocab: int = 300) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(MHABlock(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.h:
            x = block(x)
        return self.head(x)


class EncoderModel(nn.Module):
    """Two ``nn.TransformerEncoderLayer``; the head is the embedding's weight, read by
    this forward (found by the source scan, so ``emb`` stays in the root's unit)."""

    def __init__(self, d: int = WIDTH, vocab: int = 300) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
            for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.linear(x, self.emb.weight)


class DecoderModel(nn.Module):
    """One ``nn.TransformerDecoderLayer``: it calls its attentions and MLP as modules."""

    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.dec = nn.TransformerDecoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.dec(x, memory)


class _ReadsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:  # reached through forward
        return x @ self.proj.weight.t()


class _ReadsDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


def _unit_names(model: nn.Module, cfg: tagc.TAGCConfig) -> List[str]:
    ids = {id(m) for m in modules_to_wrap(model, cfg)}
    return [n for n, m in model.named_modules() if id(m) in ids]


def _out_proj_only(name: str, module: nn.Module, pname: str, p: torch.Tensor) -> bool:
    return name.endswith("out_proj") and pname == "weight"


# --------------------------------------------------------------------------- layout, one process

def test_mha_out_proj_stays_in_the_attention_unit() -> None:
    """out_proj is selected (65536 weights) yet never its own unit, for either helper;
    the attention around it is a unit, and holds a compressed majority."""
    torch.manual_seed(0)
    model = MHAModel()
    cfg = tagc.TAGCConfig()
    units = _unit_names(model, cfg)
    assert units == ["emb", "h.0.attn", "h.0.mlp.0", "h.0.mlp.2", "h.1.attn", "h.1.mlp.0",
                     "h.1.mlp.2", "head"], units
    policy = tagc.fsdp1_auto_wrap_policy(model, cfg)
    for block in model.h:
        assert policy(block.attn.out_proj, False, 0) is False
        assert policy(block.attn, False, 0) is True


def test_transformer_layers() -> None:
    """An encoder layer (whose eval fast path reads every weight) is one unit, with
    nothing inside it wrapped; the embedding the root's forward reads stays in the root.
    A decoder layer calls its children: its MLP and attentions keep their units, the
    attentions' out_proj does not get one."""
    torch.manual_seed(0)
    cfg = tagc.TAGCConfig()
    assert _unit_names(EncoderModel(), cfg) == ["layers.0", "layers.1"]
    assert _unit_names(DecoderModel(), cfg) == ["dec.self_attn", "dec.multihead_attn",
                                                "dec.linear1", "dec.linear2"]


def test_source_scan() -> None:
    """A forward (or a method it calls) that takes a child's weight keeps the child;
    one that reads only its dtype does not."""
    reader = _ReadsWeight()
    assert direct_reads(reader) == [[reader.proj]]
    assert direct_reads(_ReadsDtype()) == []
    cfg = tagc.TAGCConfig(layers="all", min_numel=1)
    assert _unit_names(nn.Sequential(_ReadsWeight()), cfg) == ["0"]
    assert _unit_names(nn.Sequential(_ReadsDtype()), cfg) == ["0.proj"]


def test_explicit_selection_of_a_kept_module_refused() -> None:
    """A callable ``layers`` selecting only out_proj asks for what no unit can give (its
    unit is the attention's, mostly in_proj_weight): refused before any sharding, naming
    the module and the parameters to select too."""
    cfg = tagc.TAGCConfig(layers=_out_proj_only)
    with pytest.raises(ValueError) as err:
        tagc.shard_model(MHAModel(), cfg)  # no process group: the check runs nothing
    msg = str(err.value)
    assert "h.0.attn.out_proj" in msg and "h.0.attn.in_proj_weight" in msg, msg
    with pytest.raises(ValueError, match="h.1.attn.out_proj"):
        tagc.fsdp1_auto_wrap_policy(MHAModel(), cfg)


def test_paper_selection_of_a_kept_module_warns(caplog: pytest.LogCaptureFixture) -> None:
    """The paper's selection compresses out_proj, which here shares the attention's
    unit with the unselected in_proj_weight: a warning says that unit is not
    compressed."""
    with caplog.at_level(logging.WARNING, logger="tagc.selection"):
        _unit_names(MHAModel(), tagc.TAGCConfig(layers="non_attention"))
    text = caplog.text
    assert "h.0.attn.out_proj" in text and "not compressed" in text, text


# --------------------------------------------------------------------------- multi-rank

def _wrap(model: nn.Module, kind: str, cfg: tagc.TAGCConfig) -> nn.Module:
    if kind == "fsdp2":
        return tagc.shard_model(model, cfg)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    return FSDP(model, auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(model, cfg),
                device_id=torch.device("cpu"))


def _tokens(rank: int, step: int, vocab: int = 300, seq: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, seq), generator=g)


def _train_reader_model(rank: int, n: int, kind: str, build: Callable[[], nn.Module]
                        ) -> Dict[str, Any]:
    """Forward, backward and AdamW step x 3 with TAGC (``TAGCConfig()``), then an eval
    forward without gradients (the encoder layer's fast path)."""
    torch.manual_seed(0)
    cfg = tagc.TAGCConfig()
    model = _wrap(build(), kind, cfg)
    state = tagc.register(model, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        tokens = _tokens(rank, step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        val = model(_tokens(rank, 99)).float().abs().mean().item()
    units = {name: (s["compressed"], s["calls"], s["compressed_calls"])
             for name, s in state.stats()["units"].items()}
    return {"losses": losses, "val": val, "units": units}


READER_MODELS = {"mha": MHAModel, "encoder": EncoderModel}
# unit -> compressed, per model (both helpers make the same units)
READER_UNITS = {
    "mha": {"<root>": False, "emb": True, "h.0.attn": True, "h.0.mlp.0": True,
            "h.0.mlp.2": True, "h.1.attn": True, "h.1.mlp.0": True, "h.1.mlp.2": True,
            "head": True},
    "encoder": {"<root>": True, "layers.0": True, "layers.1": True},
}


# --------------------------------------------------------------------------- the users' stack

STACK_VOCAB = 512  # 512 x 128: the tied embedding reaches min_numel, so the root compresses
PRESETS = ("tagc-balanced", "tagc-full")
# name -> (activation checkpointing, torch.compile) per block
VARIANTS = {"eager": (False, False), "ckpt": (True, False),
            "compile": (False, True), "ckpt+compile": (True, True)}
# the run each variant's losses are compared with: the same without compile, and the
# checkpointed eager run against the plain one
REFERENCE = {"ckpt": "eager", "compile": "eager", "ckpt+compile": "ckpt"}
STACK_UNITS = ("<root>", "transformer.h.0", "transformer.h.1")


def _user_stack(rank: int, n: int, preset: str, ckpt: bool, compiled: bool) -> Dict[str, Any]:
    """A tiny GPT sharded as users do (``fully_shard`` per block, then the root; blocks
    checkpointed and/or compiled first), TAGC registered with a preset, 8 AdamW steps."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from tagc.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=STACK_VOCAB, n_layer=2, n_head=4,
                          n_embd=128))
    blocks = model.transformer.h
    for i in range(len(blocks)):
        block = blocks[i]
        if ckpt:
            block = checkpoint_wrapper(block)
        if compiled:
            block = torch.compile(block)
        blocks[i] = block
        fully_shard(block)
    fully_shard(model)
    state = tagc.register(model, tagc.TAGCConfig.preset(preset))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        tokens = _tokens(rank, step, STACK_VOCAB, 32)
        _, loss = model(tokens, tokens.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    units = {name: {k: s[k] for k in ("compressed", "calls", "compressed_calls",
                                      "gather_quantized_calls")}
             for name, s in state.stats()["units"].items()}
    kinds = sorted({type(b).__name__ for b in blocks})
    return {"losses": losses, "units": units, "block_types": kinds}


def _compiler_missing() -> str:
    """Why inductor cannot build CPU kernels here ('' when it can)."""
    cxx = os.environ.get("CXX", "g++")
    return "" if shutil.which(cxx) else f"torch.compile on CPU needs a C++ compiler ({cxx})"


def _cases(compiled: bool) -> List[Tuple[str, Callable[..., Any]]]:
    cases: List[Tuple[str, Callable[..., Any]]] = []
    if not compiled:
        for kind in ("fsdp1", "fsdp2"):
            for model, build in READER_MODELS.items():
                cases.append((f"reader/{model}/{kind}",
                              lambda r, w, k=kind, b=build: _train_reader_model(r, w, k, b)))
    for preset in PRESETS:
        for variant, (ckpt, comp) in VARIANTS.items():
            if comp == compiled:
                cases.append((f"stack/{preset}/{variant}",
                              lambda r, w, p=preset, c=ckpt, t=comp: _user_stack(r, w, p, c, t)))
    return cases


def _eager_suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    return run_cases(rank, n, _cases(compiled=False))


def _compiled_suite(rank: int, n: int) -> Dict[str, Any]:
    """The compiled variants, with inductor's cache in a folder of this spawn (every
    run compiles: nothing of another run or user is read or left)."""
    warnings.filterwarnings("ignore")
    cache = tempfile.mkdtemp(prefix=f"tagc-inductor-{rank}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        out = run_cases(rank, n, _cases(compiled=True))
        from torch._dynamo.utils import counters
        out["dynamo"] = ("ok", {"unique_graphs": counters["stats"]["unique_graphs"],
                                "graph_breaks": sum(counters["graph_break"].values())})
        return out
    finally:
        shutil.rmtree(cache, ignore_errors=True)


EAGER = SharedSpawn(_eager_suite, timeout=300)
COMPILED = SharedSpawn(_compiled_suite, timeout=500)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
@pytest.mark.parametrize("model", sorted(READER_MODELS))
def test_reader_models_train(model: str, kind: str) -> None:
    """Stock MultiheadAttention / TransformerEncoderLayer models, sharded by TAGC's
    helpers: 3 steps train (finite losses that move), an eval forward without gradients
    runs, and the units are the expected ones, compressed on every call."""
    res = EAGER.case(2, f"reader/{model}/{kind}")
    for rank, r in enumerate(res):
        assert all(math.isfinite(x) for x in r["losses"]) and math.isfinite(r["val"]), r
        assert r["losses"][0] != r["losses"][-1], r  # the step moved the parameters
        assert {u: c for u, (c, _, _) in r["units"].items()} == READER_UNITS[model], r
        for unit, (compressed, calls, ccalls) in r["units"].items():
            assert calls == 3 and ccalls == (3 if compressed else 0), (rank, unit, r)


def _check_stack(res: List[Dict[str, Any]], preset: str, ref: List[Dict[str, Any]],
                 block_types: List[str]) -> None:
    full = preset == "tagc-full"  # int8 parameter gathers
    for rank, (r, base) in enumerate(zip(res, ref)):
        assert r["block_types"] == block_types, r["block_types"]
        assert sorted(r["units"]) == sorted(STACK_UNITS), r["units"]
        for unit, s in r["units"].items():
            assert s["compressed"] and s["calls"] == STEPS and \
                s["compressed_calls"] == STEPS, (rank, unit, s)
            assert (s["gather_quantized_calls"] > 0) == full, (rank, unit, s)
        assert all(math.isfinite(x) for x in r["losses"]), r["losses"]
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-3, abs=0), \
            (rank, r["losses"], base["losses"])


@pytest.mark.dist
@pytest.mark.parametrize("variant", ["eager", "ckpt"])
@pytest.mark.parametrize("preset", PRESETS)
def test_user_stack_eager(preset: str, variant: str) -> None:
    """fully_shard per block, with or without activation checkpointing: every unit
    compressed on every call (int8 gathers with tagc-full), and checkpointing changes
    no loss by more than 1e-3 relative."""
    res = EAGER.case(2, f"stack/{preset}/{variant}")
    ref = EAGER.case(2, f"stack/{preset}/{REFERENCE.get(variant, variant)}")
    types = ["CheckpointWrapper"] if variant == "ckpt" else ["Block"]
    _check_stack(res, preset, ref, [f"FSDP{t}" for t in types])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(bool(_compiler_missing()), reason=_compiler_missing())
@pytest.mark.parametrize("variant", ["compile", "ckpt+compile"])
@pytest.mark.parametrize("preset", PRESETS)
def test_user_stack_compiled(preset: str, variant: str) -> None:
    """The same with ``torch.compile`` per block (inductor, CPU kernels built with the
    C++ compiler): the losses of 8 steps within 1e-3 relative of the run without
    compile, every unit compressed, the blocks compiled without a graph break."""
    res = COMPILED.case(2, f"stack/{preset}/{variant}")
    ref = EAGER.case(2, f"stack/{preset}/{REFERENCE[variant]}")
    _check_stack(res, preset, ref, ["FSDPOptimizedModule"])
    for dyn in COMPILED.case(2, "dynamo"):
        assert dyn["unique_graphs"] > 0 and dyn["graph_breaks"] == 0, dyn
