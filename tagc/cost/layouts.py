"""Models as FSDP units: which units TAGC compresses and how a rank's shard is cut.

A model is a list of :class:`Unit` (its parameters' shapes in FSDP's order, whether
TAGC compresses it).  The GPT-2 layouts follow TAGC's wrapping and selection
(``tagc/selection.py``) on the shapes the training code builds
(``tagc.cost.shapes``); a model known only by its size is one compressed and one
plain aggregate unit (:func:`generic_model`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from tagc.cost.shapes import GPT_SHAPES
from tagc.config import TAGCConfig
from tagc.train.model import GPTConfig

# TAGC's default selection (TAGCConfig.min_numel, what the presets state): parameters
# with at least this many elements are candidates.
DEFAULT_MIN_NUMEL = TAGCConfig(mode="quant", layers="all").min_numel

# The selection policies (tagc/selection.py select_parameter) the layouts below follow:
# `non_attention` leaves the attention QKV input projections uncompressed, `all` takes
# every parameter of at least min_numel elements.
LAYER_POLICIES = ("non_attention", "all")

# The policy the recommended presets use (configs/tagc-balanced.yaml, tagc-lean.yaml,
# tagc-full.yaml: `layers: all` since the presets-all change).  The measured runs in
# docs/cost_model_runs.json predate it and name their own layout (RUN_MODELS).
DEFAULT_LAYERS = "all"

# FSDP units for a model given only by its size: GPT-2 124M under TAGC's wrapping
# (tagc/selection.py `modules_to_wrap`: per block c_attn, attn.c_proj, mlp.c_fc,
# mlp.c_proj; wpe is a big Embedding and gets its own unit; the root holds the tied
# wte): 12 x 4 + 2.  Only the latency terms and the votes depend on it.
DEFAULT_UNITS = 12 * 4 + 2


@dataclass(frozen=True)
class Unit:
    """One FSDP unit.

    Args:
        name: for reports.
        params: ``(rows, cols)`` of each parameter in FSDP's order (1-D: ``(n, 1)``).
        compressed: whether TAGC compresses its gradient (the selected parameters
            hold at least half of it, ``tagc/selection.py``).
        root: the root unit (FSDP1 gathers it once per step: it is not freed after
            forward under FULL_SHARD).
    """

    name: str
    params: Tuple[Tuple[int, int], ...]
    compressed: bool
    root: bool = False

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError(f"unit {self.name!r}: no parameters")
        for rows, cols in self.params:
            if rows < 1 or cols < 1:
                raise ValueError(f"unit {self.name!r}: parameter shape must be positive, "
                                 f"got ({rows}, {cols})")

    @property
    def numel(self) -> int:
        """Elements of one unit."""
        return sum(r * c for r, c in self.params)

    def segments(self, n: int, fsdp: int = 2) -> List[int]:
        """One rank's shard as segments (the wq message's), for ``n`` ranks.

        FSDP2 pads each parameter's dim 0 to ``ceil(rows / n)`` rows
        (``padded_sharded_param_size``, DESIGN section 12); FSDP1 pads the flat
        parameter to a multiple of ``n`` (one segment).

        Args:
            n: ranks the unit is sharded over.
            fsdp: 1 or 2.
        Returns:
            the segment lengths, in elements.
        """
        if fsdp == 1:
            return [-(-self.numel // n)]
        return [-(-r // n) * c for r, c in self.params]

    def shard(self, n: int, fsdp: int = 2) -> int:
        """Elements of one rank's shard over ``n`` ranks (padding included).

        Args:
            n: ranks the unit is sharded over.
            fsdp: 1 or 2.
        Returns:
            the shard length.
        """
        return sum(self.segments(n, fsdp))


@dataclass(frozen=True)
class ModelSpec:
    """A model as FSDP units.

    Args:
        name: for reports.
        units: the units (at least one).
    """

    name: str
    units: Tuple[Unit, ...]

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError(f"model {self.name!r}: no units")

    @property
    def params(self) -> int:
        """Parameters of the model."""
        return sum(u.numel for u in self.units)

    def compressed_fraction(self) -> float:
        """Fraction of the parameters in compressed units."""
        return sum(u.numel for u in self.units if u.compressed) / self.params

    @property
    def unit_count(self) -> int:
        """FSDP units."""
        return len(self.units)


def generic_model(params: float, selected_fraction: Optional[float] = None,
                  units: int = DEFAULT_UNITS, name: Optional[str] = None) -> ModelSpec:
    """A model known by its size: one compressed and one plain aggregate unit.

    Byte counts are then exact up to the per-unit rounding of a real layout (block
    tails, shard padding): below one codec record per unit and rank.

    Args:
        params: parameters (> 0).
        selected_fraction: fraction of them in compressed units, in [0, 1] (default
            :data:`DEFAULT_SELECTED_FRACTION`, the presets' selection).
        units: FSDP units (>= 1): the compressed ones get ``round(fraction * units)``
            of them (at least one when the fraction is above 0).
        name: for reports.
    Returns:
        the model.
    """
    if not params > 0 or not math.isfinite(params):
        raise ValueError(f"params must be a positive number, got {params!r}")
    if selected_fraction is None:
        selected_fraction = DEFAULT_SELECTED_FRACTION
    if not 0.0 <= selected_fraction <= 1.0:
        raise ValueError(f"selected fraction must be in [0, 1], got {selected_fraction!r}")
    total = int(round(params))
    comp = int(round(total * selected_fraction))
    both = 0 < comp < total
    if units < (2 if both else 1):
        raise ValueError(f"units must be >= {2 if both else 1} (compressed and plain "
                         f"parameters need a unit each), got {units}")
    # each side gets its share of the units, at least one
    n_comp = min(units - 1 if both else units, max(1, round(selected_fraction * units))) \
        if comp else 0
    n_plain = units - n_comp
    out = []
    if comp:
        out.append(Unit("compressed", ((comp, 1),), True))
    if total - comp:
        out.append(Unit("plain", ((total - comp, 1),), False))
    # The aggregates stand for n_comp / n_plain FSDP units: those counts scale the
    # latency terms and the per-unit votes, not the bytes.
    counts = tuple(n_comp if u.compressed else n_plain for u in out)
    return CountedModel(name or f"{params:.3g} params", tuple(out), counts)


@dataclass(frozen=True)
class CountedModel(ModelSpec):
    """A :class:`ModelSpec` whose aggregate units stand for more FSDP units.

    Args:
        unit_counts: FSDP units each entry of ``units`` stands for (latency, votes).
    """

    unit_counts: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.unit_counts) != len(self.units) or any(c < 1 for c in self.unit_counts):
            raise ValueError("unit_counts: one count >= 1 per unit")

    @property
    def unit_count(self) -> int:
        """FSDP units the aggregates stand for."""
        return sum(self.unit_counts)


def gpt2_model(n_layer: int, n_embd: int, vocab_size: int, block_size: int,
               layers: str = DEFAULT_LAYERS, min_numel: int = DEFAULT_MIN_NUMEL,
               name: Optional[str] = None) -> ModelSpec:
    """A GPT-2 (``tagc/train/model.py``: biases, tied head) as TAGC wraps it.

    Follows ``tagc/selection.py``: a module gets its own unit if it owns a selected
    parameter or is a linear/embedding layer of at least ``min_numel`` parameters
    (or an attention QKV projection); the tied wte stays in the root with everything
    else (position embedding if small, LayerNorms).  A unit is compressed when its
    selected parameters are at least half of it.

    Args:
        n_layer, n_embd, vocab_size, block_size: the shape.
        layers: ``all`` (default, the presets') or ``non_attention``.
        min_numel: smallest parameter compressed.
        name: for reports.
    Returns:
        the model.
    """
    for k, v in (("n_layer", n_layer), ("n_embd", n_embd), ("vocab_size", vocab_size),
                 ("block_size", block_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")
    _check_layers(layers)
    e = n_embd

    def sel(numel: int, weight: bool, qkv: bool) -> bool:
        """Whether the policy selects a parameter."""
        # tagc/selection.py select_parameter: size first, then (non_attention) a
        # linear/embedding weight that is not a QKV projection
        if numel < min_numel:
            return False
        return True if layers == "all" else (weight and not qkv)

    def linear(nm: str, out_f: int, in_f: int, qkv: bool = False) -> Optional[Unit]:
        """A Linear (weight + bias) as its own unit, or None when it stays in the root."""
        w = out_f * in_f
        own = sel(w, True, qkv) or w + out_f >= max(min_numel, 1) or qkv
        if not own:
            return None
        selected = w if sel(w, True, qkv) else 0
        return Unit(nm, ((out_f, in_f), (out_f, 1)), selected * 2 >= w + out_f)

    units: List[Unit] = []
    root: List[Tuple[int, int]] = [(vocab_size, e)]  # wte, tied with lm_head
    root_sel = vocab_size * e if sel(vocab_size * e, True, False) else 0
    wpe = block_size * e
    if sel(wpe, True, False) or wpe >= max(min_numel, 1):
        units.append(Unit("wpe", ((block_size, e),), sel(wpe, True, False)))
    else:
        root.append((block_size, e))
    for i in range(n_layer):
        root += [(e, 1)] * 4  # ln_1, ln_2: weight and bias (too small to be selected)
        for u in (linear(f"h{i}.attn.c_attn", 3 * e, e, qkv=True),
                  linear(f"h{i}.attn.c_proj", e, e),
                  linear(f"h{i}.mlp.c_fc", 4 * e, e),
                  linear(f"h{i}.mlp.c_proj", e, 4 * e)):
            if u is not None:
                units.append(u)
    root += [(e, 1)] * 2  # ln_f
    root_n = sum(r * c for r, c in root)
    units.insert(0, Unit("root", tuple(root), root_sel * 2 >= root_n, root=True))
    label = name or f"GPT-2 {n_layer}x{n_embd} vocab {vocab_size}"
    return ModelSpec(label, tuple(units))


def _check_layers(layers: str) -> None:
    """Refuse a selection policy the layouts do not model.

    Args:
        layers: ``non_attention`` or ``all``.
    Raises:
        ValueError: any other value (a callable policy has no layout here).
    """
    if layers not in LAYER_POLICIES:
        raise ValueError(f"layers must be one of {LAYER_POLICIES}, got {layers!r}")


def gpt2_label(shape: str, cfg: GPTConfig) -> str:
    """A shape's name in reports (the step benchmark's with its size)."""
    if shape == "bench":
        return f"bench GPT-2 ({cfg.n_layer}x{cfg.n_embd}, vocab {cfg.vocab_size})"
    return {"tiny": "tiny GPT-2", "gpt2-124m": "GPT-2 124M",
            "gpt2-124m-c256": "GPT-2 124M (vocab 50257, context 256)"}.get(shape, shape)


def named_gpt2(shape: str, layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """One of the repository's GPT-2 shapes (``tagc.cost.shapes.GPT_SHAPES``: the step
    benchmark's, the quality runs' tiny one, GPT-2 124M, each as the training code
    builds it) as TAGC wraps it under a selection policy.

    Args:
        shape: a key of ``GPT_SHAPES``.
        layers: the selection policy (default the presets').
    Returns:
        the layout, named with its policy (reports and plots tell them apart).
    """
    cfg = GPT_SHAPES[shape]()
    if not (cfg.bias and cfg.tie_weights):
        raise ValueError(f"{shape}: the layout models GPT-2 with biases and a tied head")
    return gpt2_model(cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size, layers=layers,
                      name=f"{gpt2_label(shape, cfg)}, layers={layers}")


def bench_gpt2(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """The step benchmark's model: ``named_gpt2("bench", layers)``."""
    return named_gpt2("bench", layers)


def tiny_gpt2(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """The quality runs' tiny GPT-2: ``named_gpt2("tiny", layers)``."""
    return named_gpt2("tiny", layers)


def gpt2_124m(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """GPT-2 small: ``named_gpt2("gpt2-124m", layers)``."""
    return named_gpt2("gpt2-124m", layers)


def gpt2_124m_c256(layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """GPT-2 small as ``bench_step.py --model gpt2-124m`` runs it:
    ``named_gpt2("gpt2-124m-c256", layers)``."""
    return named_gpt2("gpt2-124m-c256", layers)


def linear_pair_model(width: int = 512, layers: str = DEFAULT_LAYERS) -> ModelSpec:
    """``scripts/bench/measure_bytes.py``'s model: Linear(w, 4w) and Linear(4w, w), no bias,
    ``layers: all``, ``min_numel`` 4096: two compressed units and an empty root.

    Args:
        width: w.
        layers: accepted for a uniform :data:`MODELS` call; both policies select both
            weights (linear weights, no attention input projection), so the layout is
            the same.
    Returns:
        the layout.
    """
    _check_layers(layers)
    return ModelSpec(f"Linear {width}x{4 * width} pair",
                     (Unit("fc1", ((4 * width, width),), True),
                      Unit("fc2", ((width, 4 * width),), True)))


# The layouts ``--model`` offers, each built for a selection policy (``--layers``).
MODELS: Dict[str, Callable[..., ModelSpec]] = {
    "bench": bench_gpt2, "tiny": tiny_gpt2, "gpt2-124m": gpt2_124m,
    "gpt2-124m-c256": gpt2_124m_c256, "linear-pair": linear_pair_model}

# The layouts the measured runs used, by the name docs/cost_model_runs.json gives them:
# (layout, policy).  Every run there predates the presets' move to `layers: all`, so a
# bare name is the policy they had then (non_attention); "bench-all" is bench_step.py's
# `--override layers=all`; "gpt2-124m-c256" ran the presets' `layers: all`.
# Fixed here, not taken from --layers, so that --check compares each run with the
# layout it ran.
RUN_MODELS: Dict[str, Tuple[str, str]] = {
    "bench": ("bench", "non_attention"), "bench-all": ("bench", "all"),
    "tiny": ("tiny", "non_attention"), "linear-pair": ("linear-pair", "all"),
    "gpt2-124m-c256": ("gpt2-124m-c256", "all")}


def run_model(name: str) -> ModelSpec:
    """The layout a runs-file model name stands for.

    Args:
        name: a key of :data:`RUN_MODELS`.
    Returns:
        the layout, under the policy that run used.
    """
    layout, layers = RUN_MODELS[name]
    return MODELS[layout](layers=layers)


def default_selected_fraction(layers: str = DEFAULT_LAYERS) -> float:
    """Fraction of the parameters in compressed units for a model given only by its size.

    Taken from the tiny GPT-2 of the quality runs under ``layers`` (recomputed from its
    layout, so it follows the selection rules above): under ``non_attention``
    everything but the two attention QKV units (2 x 197,376 of 1,694,720 parameters),
    0.767; under ``all`` every unit (the root holds the tied wte, which is more than
    half of it), 1.0.

    Args:
        layers: the selection policy.
    Returns:
        the fraction, in [0, 1].
    """
    return tiny_gpt2(layers).compressed_fraction()


# --params' default: the presets' selection on the tiny GPT-2.
DEFAULT_SELECTED_FRACTION = default_selected_fraction(DEFAULT_LAYERS)


def unit_counts(model: ModelSpec) -> List[int]:
    """FSDP units each entry of ``model.units`` stands for."""
    if isinstance(model, CountedModel):
        return list(model.unit_counts)
    return [1] * len(model.units)
