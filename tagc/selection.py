"""Which parameters TAGC compresses, and the FSDP unit layout that makes that exact.

A unit (FSDP1 FlatParameter, FSDP2 ``fully_shard`` module) is compressed as a whole or
not at all: FSDP hands the hook one flat buffer per unit.  So the selection is made per
parameter (:func:`select_parameter`) and :func:`modules_to_wrap` names the modules that
get a unit of their own: every selected module, and every big unselected
``nn.Linear``/``nn.Embedding`` (the attention QKV projection) (docs/DESIGN.md section 6).
The wrapping helpers that apply that layout with FSDP1 or FSDP2 are in ``wrapping.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from .config import TAGCConfig

# Module names that always denote a fused or split attention QKV projection.
_QKV_ALWAYS = {"c_attn", "qkv", "qkv_proj", "query_key_value", "wqkv", "in_proj", "to_qkv"}
# Names that denote Q/K/V only below an attention module ("q" alone is too generic).
_QKV_IN_ATTN = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv",
                "q", "k", "v", "to_q", "to_k", "to_v", "q_lin", "k_lin", "v_lin"}
# Wrapper components FSDP1 / checkpointing / torch.compile insert into module names.
_WRAPPER_NAMES = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


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


def modules_to_wrap(model: nn.Module, cfg: TAGCConfig) -> List[nn.Module]:
    """Modules that get their own FSDP unit: owners of selected parameters, big
    unselected linear layers (so they do not dilute another unit), and every
    attention input projection whatever its size (never inside a compressed unit).

    Tied weights (the GPT-2 token embedding and LM head) stay in a common
    ancestor's unit, the root: FSDP needs a shared parameter in one unit.  Since
    everything else big leaves the root, the root is then the tied weight's own
    unit, compressed when the weight is selected.
    """
    tied = _tied_param_ids(model)
    out = []
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
            out.append(mod)
    return out


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
