"""Which parameters TAGC compresses, and the FSDP unit layout that makes that exact.

A unit (FSDP1 FlatParameter, FSDP2 ``fully_shard`` module) is compressed as a whole or
not at all: FSDP hands the hook one flat buffer per unit.  So the selection is made per
parameter (:func:`select_parameter`) and :func:`modules_to_wrap` names the modules that
get a unit of their own: every selected module, and every big unselected
``nn.Linear``/``nn.Embedding`` (the attention QKV projection) (docs/DESIGN.md section 6),
except a module whose parameters an ancestor's forward reads directly (the output
projection of ``nn.MultiheadAttention``): it stays in that ancestor's unit
(:func:`direct_reads`).  The wrapping helpers that apply that layout with FSDP1 or FSDP2
are in ``wrapping.py``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

import torch
import torch.nn as nn

from .config import TAGCConfig

logger = logging.getLogger(__name__)

# Module names that always denote a fused or split attention QKV projection.
_QKV_ALWAYS = {"c_attn", "qkv", "qkv_proj", "query_key_value", "wqkv", "in_proj", "to_qkv"}
# Names that denote Q/K/V only below an attention module ("q" alone is too generic).
_QKV_IN_ATTN = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                "q", "k", "v", "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin"}
# Wrapper components FSDP1 / checkpointing / torch.compile insert into module names.
_WRAPPER_NAMES = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
# torch modules whose forward reads these children's parameters instead of calling them.
# FSDP gathers a unit's parameters only when the unit's own module is called, so these
# children must share the reader's unit.  The source scan of direct_reads finds both
# too; the list is what holds where a class's source cannot be read (a frozen install).
_KNOWN_READS: Dict[type, Tuple[str, ...]] = {
    # F.multi_head_attention_forward(..., self.out_proj.weight, self.out_proj.bias)
    nn.MultiheadAttention: ("out_proj",),
    # the eval-mode fast path (torch._transformer_encoder_layer_fwd) takes every weight
    nn.TransformerEncoderLayer: ("self_attn", "self_attn.out_proj", "linear1", "linear2",
                                 "norm1", "norm2"),
}
# Tensor attributes that a sharded parameter answers as the full one would.
_METADATA = {"dtype", "device", "requires_grad", "is_cuda", "is_floating_point"}


def clean_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPER_NAMES)


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear``, ``nn.Embedding``, or a linear layer of another name: Hugging
    Face GPT-2's ``Conv1D`` (``nf`` outputs and a ``weight``), recognised by duck
    typing so that transformers is never imported here (by class name along the
    MRO: FSDP2 subclasses it as ``FSDPConv1D``; not by the weight's shape, which
    FSDP1 flattens)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__) and \
        hasattr(module, "nf") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _is_qkv_name(module_name: str) -> bool:
    parts = [p.lower() for p in clean_name(module_name).split(".") if p]
    if not parts:
        return False
    last = parts[-1]
    if last in _QKV_ALWAYS:
        return True
    in_attn = any("attn" in p or "attention" in p for p in parts[:-1])
    return in_attn and last in _QKV_IN_ATTN


def select_parameter(cfg: TAGCConfig, module_name: str, module: nn.Module,
                     param_name: str, param: torch.Tensor) -> bool:
    """Whether ``cfg.layers`` selects one parameter for compression.

    ``"non_attention"``: the ``weight`` of an ``nn.Linear``, ``nn.Embedding``
    or Hugging Face ``Conv1D`` (GPT-2) with at least ``min_numel`` elements,
    unless the module is an attention input projection: its last name
    component is one of ``c_attn, qkv, qkv_proj, query_key_value, wqkv,
    in_proj, to_qkv`` (GPT-2's fused QKV, GPT-NeoX/Falcon, MPT/Phi), or one of
    ``q_proj, k_proj, v_proj, query, key, value, wq, wk, wv, q, k, v,
    to_q/k/v, q/k/v_lin`` below a module whose name contains
    ``attn``/``attention`` (Llama/Mistral/Qwen, BERT).  The attention output
    projection (``c_proj``, ``o_proj``, ``out_proj``, ``dense``) and the MLP
    (``c_fc``, ``gate_proj``/``up_proj``/``down_proj``, ...) are compressed,
    as in the paper, and so is a token embedding tied to the LM head.
    ``"all"``: every parameter with at least ``min_numel`` elements.  A
    callable decides alone.

    Args:
        cfg: the config.
        module_name: FQN of the module owning the parameter (wrapper names ignored).
        module: that module.
        param_name: the parameter's name inside the module.
        param: the parameter.
    Returns:
        True if the parameter is compressed.
    """
    if callable(cfg.layers):
        return bool(cfg.layers(clean_name(module_name), module, param_name, param))
    if param.numel() < cfg.min_numel or not param.is_floating_point():
        return False
    if cfg.layers == "all":
        return True
    if param_name != "weight" or not is_linear_like(module):
        return False
    return not _is_qkv_name(module_name)


def _tied_param_ids(model: nn.Module) -> set:
    seen: Dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for _, p in mod.named_parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, c in seen.items() if c > 1}


def _attr_chain(node: ast.Attribute, me: str) -> Optional[Tuple[str, ...]]:
    """``("a", "b")`` for the expression ``me.a.b``, None if it is not rooted at ``me``."""
    names: List[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        names.append(cur.attr)
        cur = cur.value
    if not (isinstance(cur, ast.Name) and cur.id == me):
        return None
    return tuple(reversed(names))


@functools.lru_cache(maxsize=None)
def _source_chains(cls: type) -> FrozenSet[Tuple[str, ...]]:
    """Every ``self.a.b...`` that ``cls.forward``, or a method it calls as
    ``self.m(...)``, uses as a value, except those read only for metadata (``.dtype``).

    Args:
        cls: a module class.
    Returns:
        the attribute chains, without ``self``; empty where the source cannot be read.
    """
    chains = set()
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fn = inspect.getattr_static(cls, name, None)
        fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
        # nn.Module's own methods never read a child's parameters for a computation
        if not inspect.isfunction(fn) or fn.__module__ == nn.Module.__module__:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError) as exc:
            logger.debug("no source for %s.%s (%s): only the known readers apply",
                         cls.__qualname__, name, exc)
            continue
        func = tree.body[0]
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or not func.args.args:
            continue
        me = func.args.args[0].arg
        meta = {id(n.value) for n in ast.walk(func)
                if isinstance(n, ast.Attribute) and n.attr in _METADATA}
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == me:
                todo.append(node.func.attr)
            if isinstance(node, ast.Attribute) and id(node) not in meta:
                chain = _attr_chain(node, me)
                if chain is not None and len(chain) >= 2:
                    chains.add(chain)
    return frozenset(chains)


def _walk(reader: nn.Module, chain: Tuple[str, ...], to_param: bool) -> List[nn.Module]:
    """The submodules that ``reader.<chain>`` passes through (checkpoint, FSDP1 and
    compile wrappers looked through), ending at the owner of the parameter the chain
    ends with (``to_param``) or at the module it names; [] if it names neither."""
    mods: List[nn.Module] = []
    mod = reader
    for i, name in enumerate(chain):
        while name not in mod._modules and name not in mod._parameters:
            inner = [c for w, c in mod._modules.items() if w in _WRAPPER_NAMES and c is not None]
            if not inner:
                return []
            mod = inner[0]
            mods.append(mod)
        last = i == len(chain) - 1
        if name in mod._parameters:
            return mods if to_param and last and mods else []
        mod = mod._modules[name]
        if mod is None:
            return []
        mods.append(mod)
    return [] if to_param else mods


def direct_reads(reader: nn.Module) -> List[List[nn.Module]]:
    """The descendants whose own parameters ``reader``'s forward reads instead of calling
    them, each with the modules on the way: those must all share ``reader``'s FSDP unit.

    Two sources: the known torch readers (``nn.MultiheadAttention`` reads
    ``out_proj.weight``/``out_proj.bias``; ``nn.TransformerEncoderLayer``'s eval fast
    path reads every weight of its attention, norms and MLP), and a scan of the class's
    source: ``self.a.b.weight`` used as a value in ``forward`` or in a method it calls
    as ``self.m(...)``, where ``a.b`` is a submodule and ``weight`` one of its own
    parameters (a read of ``.dtype``/``.device``/``.requires_grad`` only does not
    count).  Not found: reads through a local name or an index (``m = self.a;
    m.weight``, ``self.layers[0].weight``), ``getattr``, or another object's method.

    Args:
        reader: a module.
    Returns:
        one list per read: the modules from ``reader``'s child down to the owner.
    """
    out = []
    for cls, paths in _KNOWN_READS.items():
        if isinstance(reader, cls):
            out += [_walk(reader, tuple(p.split(".")), to_param=False) for p in paths]
    out += [_walk(reader, chain, to_param=True) for chain in _source_chains(type(reader))]
    return [mods for mods in out if mods]


def _held_by_readers(model: nn.Module) -> Dict[int, Tuple[str, nn.Module, str]]:
    """id(module) -> (its FQN, the reader, the reader's FQN) for each module that must
    share a reader's unit; the outermost reader wins (``named_modules`` lists parents
    first)."""
    names = {id(m): clean_name(n) or "<root>" for n, m in model.named_modules()}
    held: Dict[int, Tuple[str, nn.Module, str]] = {}
    for _, reader in model.named_modules():
        for mods in direct_reads(reader):
            for mod in mods:
                held.setdefault(id(mod), (names.get(id(mod), "?"), reader,
                                          names.get(id(reader), "?")))
    return held


def modules_to_wrap(model: nn.Module, cfg: TAGCConfig) -> List[nn.Module]:
    """Modules that get their own FSDP unit: owners of selected parameters, big
    unselected linear layers (so they do not dilute another unit), and every
    attention input projection whatever its size (never inside a compressed unit).

    Tied weights (the GPT-2 token embedding and LM head) stay in a common
    ancestor's unit, the root: FSDP needs a shared parameter in one unit.  Since
    everything else big leaves the root, the root is then the tied weight's own
    unit, compressed when the weight is selected.

    A module whose parameters an ancestor's forward reads directly
    (:func:`direct_reads`: ``nn.MultiheadAttention``'s ``out_proj``, every child of
    ``nn.TransformerEncoderLayer``, or a read the source scan finds) never gets a unit:
    FSDP would gather it only when it is called, and the reader would compute with
    the sharded parameter.  It stays in the reader's unit, and the reader (unless it is
    the root or holds a tied weight) becomes a unit in its place, so that a
    ``TransformerEncoderLayer`` is one unit.  Such a unit is compressed by the usual
    rule; where that leaves a kept module's selected parameters uncompressed, a
    warning names it (``layers`` a string) or a ValueError refuses (``layers`` a
    callable, which asked for exactly those parameters).

    Args:
        model: the unwrapped model.
        cfg: the config whose ``layers``/``min_numel`` decide the selection.
    Returns:
        the modules, in ``named_modules`` order (parents first).
    Raises:
        ValueError: ``cfg.layers`` is a callable that selects parameters of a module
            kept in a reader's unit, and that unit would not be compressed.
    """
    tied = _tied_param_ids(model)
    chosen = []
    for name, mod in model.named_modules():
        if mod is model:
            continue
        direct = list(mod.named_parameters(recurse=False))
        if not direct or any(id(p) in tied for _, p in direct):
            continue
        selected = any(select_parameter(cfg, name, mod, pn, p) for pn, p in direct)
        linear = is_linear_like(mod)
        big_layer = linear and sum(p.numel() for _, p in direct) >= max(cfg.min_numel, 1)
        if selected or big_layer or (linear and _is_qkv_name(name)):
            chosen.append(mod)
    held = _held_by_readers(model)
    ids = {id(m) for m in chosen if id(m) not in held}
    for mod in chosen:
        reader = held[id(mod)][1] if id(mod) in held else None
        if reader is not None and reader is not model and id(reader) not in held and \
                not any(id(p) in tied for p in reader.parameters()):
            ids.add(id(reader))
    kept = [held[id(m)][0] for m in chosen if id(m) in held]
    if kept:
        logger.info("TAGC wrapping: %d module(s) stay in the unit of the module that "
                    "reads their parameters directly: %s", len(kept), ", ".join(kept[:6])
                    + (", ..." if len(kept) > 6 else ""))
    out = [m for _, m in model.named_modules() if id(m) in ids]
    _check_kept_selection(model, cfg, ids, held)
    return out


def _check_kept_selection(model: nn.Module, cfg: TAGCConfig, unit_ids: set,
                          held: Dict[int, Tuple[str, nn.Module, str]]) -> None:
    """Warn (``layers`` a string) or raise (a callable) where a module kept in a
    reader's unit has selected parameters and that unit is not compressed.

    Args:
        model: the unwrapped model.
        cfg: the config.
        unit_ids: ids of the modules that get a unit (the root is one too).
        held: :func:`_held_by_readers` of the model.
    Raises:
        ValueError: the callable case.
    """
    infos: Dict[int, List[Tuple[str, bool, int]]] = {}  # unit -> (param FQN, selected, numel)
    unit_names: Dict[int, str] = {id(model): "<root>"}
    units_of_kept: Dict[int, List[str]] = {}
    seen: set = set()

    def visit(mod: nn.Module, name: str, unit: nn.Module) -> None:
        if id(mod) in unit_ids:
            unit = mod
            unit_names[id(mod)] = clean_name(name)
        for pn, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            sel = select_parameter(cfg, name, mod, pn, p)
            infos.setdefault(id(unit), []).append((f"{clean_name(name)}.{pn}".lstrip("."),
                                                   sel, p.numel()))
            if sel and id(mod) in held:
                kept_name, reader, reader_name = held[id(mod)]
                units_of_kept.setdefault(id(unit), []).append(
                    f"{kept_name} (read by {reader_name}, {type(reader).__name__})")
        for cn, child in mod.named_children():
            visit(child, f"{name}.{cn}" if name else cn, unit)

    visit(model, "", model)
    bad, others = [], []
    for uid, kept in units_of_kept.items():
        total = sum(n for _, _, n in infos[uid])
        sel = sum(n for _, s, n in infos[uid] if s)
        if 2 * sel < total:
            bad.append(f"{', '.join(sorted(set(kept)))} in unit {unit_names[uid]!r} "
                       f"({sel} of its {total} elements selected)")
            others += [pn for pn, s, _ in infos[uid] if not s]
    if not bad:
        return
    msg = (f"{'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}: a module whose "
           f"parameters its reader's forward takes directly shares the reader's FSDP "
           f"unit, which is compressed only when selected parameters hold half of it")
    if callable(cfg.layers):
        raise ValueError(f"tagc: cfg.layers selects {msg}; these units would not be "
                         f"compressed. Select the units' other parameters too "
                         f"({', '.join(others[:4])}), or leave these unselected.")
    logger.warning("tagc: layers=%r selects %s; %d unit(s) not compressed "
                   "(layers='all' selects their other big parameters too)",
                   cfg.layers, msg, len(bad))


def module_names(model: nn.Module) -> Dict[int, str]:
    """id(module) -> its FQN without wrapper components."""
    return {id(m): clean_name(n) for n, m in model.named_modules()}


def unit_selection(cfg: TAGCConfig, names: Dict[int, str],
                   infos: List[Tuple[nn.Module, str, torch.Tensor, int]]) -> Tuple[int, int]:
    """Elements of a unit's parameters, and how many of them ``cfg`` selects.

    Args:
        cfg: the config.
        names: :func:`module_names` of the model.
        infos: (owning module, parameter name, parameter, numel) per parameter.
    Returns:
        (total, selected).  The unit is compressed when selected >= total / 2.
    """
    total = sel = 0
    for mod, pname, p, numel in infos:
        total += numel
        if select_parameter(cfg, names.get(id(mod), ""), mod, pname, p):
            sel += numel
    return total, sel


@dataclass(frozen=True)
class UnitSpec:
    """One FSDP unit as the hook sees it, the same on every rank (same model code).

    Attributes:
        name: the unit's FQN without wrapper components (``<root>`` for the root).
        index: position in the model's unit order (FQN order, not call order: FSDP
            may reduce units in another order); it goes into the hash seeds.
        numel: elements of the unit's parameters.
        flat_numel: elements of the reduce-scatter input (parameters padded to N
            shards; FSDP2 leaves out frozen parameters): the feedback state's length,
            known before the first backward so that a checkpoint template can be built.
        selected_numel: elements of the parameters ``cfg.layers`` selects.
        device: where the gradient is reduced (the feedback state's home).
    """
    name: str
    index: int
    numel: int
    flat_numel: int
    selected_numel: int
    device: torch.device

    def __post_init__(self) -> None:
        if self.index < 0 or self.numel < 0 or self.flat_numel < 0:
            raise ValueError(f"UnitSpec {self.name!r}: negative index or size "
                             f"({self.index}, {self.numel}, {self.flat_numel})")
        if not 0 <= self.selected_numel <= self.numel:
            raise ValueError(f"UnitSpec {self.name!r}: selected_numel {self.selected_numel} "
                             f"not in [0, numel={self.numel}]")

    @property
    def compressed(self) -> bool:
        """Whether the unit is compressed: FSDP hands the hook one flat buffer per unit,
        so it goes as a whole, and it does when selected parameters hold at least half
        of it (the wrapping helpers make selected modules their own units)."""
        return self.selected_numel > 0 and 2 * self.selected_numel >= self.numel


def unit_spec(cfg: TAGCConfig, names: Dict[int, str], name: str, index: int,
              infos: List[Tuple[nn.Module, str, torch.Tensor, int]], flat_numel: int,
              device: torch.device) -> UnitSpec:
    """The :class:`UnitSpec` of one unit: the one place FSDP1, FSDP2 and HSDP build it.

    Args:
        cfg: the config.
        names: :func:`module_names` of the model.
        name: the unit module's FQN as ``named_modules`` gives it.
        index: the unit's position in the model's unit order.
        infos: (owning module, parameter name, parameter, numel) per parameter.
        flat_numel: elements of the unit's reduce-scatter input.
        device: where the gradient is reduced.
    Returns:
        the spec.
    """
    total, sel = unit_selection(cfg, names, infos)
    return UnitSpec(clean_name(name) or "<root>", index, int(total), int(flat_numel),
                    int(sel), device)
