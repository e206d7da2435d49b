"""The configurations a step can run, and the library's size rules they send by.

A configuration (:class:`Config`) is a layout (FULL_SHARD or HSDP), a dtype and, for
TAGC, a :class:`Compression` (the ``TAGCConfig`` fields that decide bytes).  Every byte
count comes from the library, not from a copy of its rules: the codec's wire sizes
(``_tagc.quant_bytes``, ``_tagc.wq_bytes`` through the package's codec handle
``tagc.codec``), the transports' pairs message (``tagc.transports.pairs_wire``), the
kept entries (``tagc.config.keep_count``) and HSDP's all-reduce form
(``tagc.hsdp.allreduce_form``), each applied to :meth:`Compression.library`, the
hook's config of that compression.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Sequence

import torch

from tagc import codec
from tagc.cost.rows import ROWS
from tagc.config import GATHER_FORMATS, QUANT_FORMATS, RESIDUAL_CODES, TAGCConfig, keep_count
from tagc.hsdp import allreduce_form
from tagc.transports import pairs_wire

# Bytes of one element of the parameter / gradient dtypes FSDP moves.
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# A kept value's dtype by its bytes (``value_dtype``; the gradient's dtype for ``eb``).
VALUE_DTYPES = {4: torch.float32, 2: torch.bfloat16}

# The per-call vote (tagc/reducer.py `_agree`): a 4-byte non-finite flag all-reduced;
# with EF21 (damping on by default with ef21) or the guard it widens to four float64
# in the same all-reduce (32 bytes).  `dense` mode sends no vote.
VOTE_BYTES_PLAIN = 4
VOTE_BYTES_EF21 = 4 * 8

# The codec's counts are int32 (``_tagc``: n in [0, 2^31 - 1]); larger shards (a model
# of billions of parameters on few ranks) are sized in block-aligned pieces, whose
# sizes add up (one record per block).
_CODEC_MAX_N = 2 ** 31 - 1


def _tagc():
    """The codec module (``tagc.codec``'s handle; a clear error without a build)."""
    codec.require_codec()
    return codec._tagc


def quant_bytes(n: int, fmt: str, block: int) -> int:
    """Bytes of ``n`` values on quant codes: the codec's ``quant_bytes``.

    Args:
        n: values (>= 0).
        fmt: ``sign``, ``ternary``, ``int4``, ``int8`` or ``tls``.
        block: values per fp32 scale (not read by ``tls``).
    Returns:
        the exact message size.
    Raises:
        ValueError: a bad format, count or block (the codec's message).
    """
    if fmt in codec.OWN_PERIOD:
        if n > _CODEC_MAX_N:  # tagc.h's rule for tls, past the codec's int32 counts
            nb = -(-n // 32)
            return 4 + -(-nb // 16) + (nb + 1) // 2 + -(-n // 5)
        _tagc()
        return codec.quant_bytes(n, fmt, block)
    if n > _CODEC_MAX_N and block >= 1:
        head = _CODEC_MAX_N // block * block
        return _tagc().quant_bytes(head, fmt, block) + quant_bytes(n - head, fmt, block)
    return _tagc().quant_bytes(n, fmt, block)


def gather_bytes(segments: Sequence[int], fmt: str, block: int, delta: bool = False) -> int:
    """Bytes of one rank's parameter shard on the weight-gather codes: the codec's
    ``wq_bytes`` or ``fp4_bytes`` (blocks never cross a segment).

    Args:
        segments: the shard's segment lengths (``Unit.segments``).
        fmt: ``int8``, ``int4`` or ``fp4``.
        block: values per scale.
        delta: ``gather_delta``'s message (``wq_delta_bytes``: one flag byte more).
    Returns:
        the message size.
    """
    if fmt == "fp4":
        from tagc.gather import message_bytes  # the runtime's own rule

        return message_bytes(segments, fmt, block)
    if any(x > _CODEC_MAX_N for x in segments):
        return sum(quant_bytes(x, fmt, block) for x in segments) + int(delta)
    size = _tagc().wq_delta_bytes if delta else _tagc().wq_bytes
    return size([int(x) for x in segments], fmt, block)


def pairs_message(t: "Compression", s: int, eb: int) -> int:
    """Bytes of one message of a pairs mode's k kept entries of a shard of ``s``: the
    transports' own rule (``tagc.transports.pairs_wire``: ``sparse``'s int32 offsets
    and values, ``auto``'s cheapest coding with values in the gradient's dtype when
    narrower), k = ``keep_count(theta, s)``.

    Args:
        t: a ``sparse`` or ``auto`` compression.
        s: shard length.
        eb: bytes of a gradient element (4 or 2).
    Returns:
        the message size.
    """
    k = keep_count(t.theta, s)
    return pairs_wire(t.library(), s, k, VALUE_DTYPES[eb], {}).nbytes


GRAD_MODES = ("dense", "sparse", "auto", "quant")


@dataclass(frozen=True)
class Compression:
    """TAGC's gradient exchange for the compressed units (``TAGCConfig`` fields).

    Args:
        mode: ``dense``, ``sparse``, ``auto`` or ``quant`` (``exact`` and ``paper``
            are not modelled: their bytes depend on the data).
        quant_format: ``int4``, ``ternary``, ``int8``, ``sign`` or ``tls``.
        quant_block: values per fp32 scale.
        theta: sparsity of the top-k modes.
        value_bytes: bytes of a kept value (``value_dtype``; 4 = float32).
        ef21: EF21 feedback (its vote is 32 bytes, not 4).
        gather: parameter all-gather codes, ``none``, ``int8`` or ``int4`` (FSDP2 only).
        gather_block: values per fp32 scale of the gather codes.
        out_format: two-phase HSDP's to-everyone code (``hsdp_out_format``); ``auto``:
            the library's choice (``TAGCConfig.out_format``).
        residual_code: how the residual is kept between calls (``residual_code``):
            ``none`` (fp32 values) or a block code, decoded and coded again every call.
        outer_every: local steps (``outer_every``, HSDP only): the exchange between
            the replicas once every H steps, of the pseudo-gradient; 0: every step.
        gather_delta: the gathers code the weights' change (``gather_delta``).
    """

    mode: str
    quant_format: str = "int4"
    quant_block: int = 256
    theta: float = 0.9875
    value_bytes: int = 4
    ef21: bool = False
    gather: str = "none"
    gather_block: int = 256
    out_format: str = "auto"
    residual_code: str = "none"
    outer_every: int = 0
    gather_delta: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.outer_every, bool) or not isinstance(self.outer_every, int) \
                or self.outer_every < 0:
            raise ValueError(f"outer_every must be an int >= 0, got {self.outer_every!r}")
        if self.mode not in GRAD_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modelled: {list(GRAD_MODES)} "
                             "(exact and paper send data-dependent bytes)")
        if self.quant_format not in QUANT_FORMATS:
            raise ValueError(f"unknown quant format {self.quant_format!r}; known: "
                             f"{sorted(QUANT_FORMATS)}")
        if self.out_format != "auto" and self.out_format not in QUANT_FORMATS:
            raise ValueError(f"unknown out format {self.out_format!r}; known: auto, "
                             f"{', '.join(sorted(QUANT_FORMATS))}")
        if not 1 <= self.quant_block <= 65536 or not 1 <= self.gather_block <= 65536:
            raise ValueError("quant_block and gather_block must be in 1..65536 "
                             "(TAGC_QBLOCK_MAX)")
        if not 0.0 <= self.theta < 1.0:
            raise ValueError(f"theta must be in [0, 1), got {self.theta!r}")
        if self.value_bytes not in VALUE_DTYPES:
            raise ValueError(f"value_bytes must be 2 or 4, got {self.value_bytes!r}")
        if self.gather not in GATHER_FORMATS:
            raise ValueError(f"unknown gather format {self.gather!r}; known: "
                             f"{', '.join(GATHER_FORMATS)}")
        if self.residual_code not in RESIDUAL_CODES or (self.ef21 and self.residual_code != "none"):
            raise ValueError(f"residual_code must be one of {RESIDUAL_CODES} ('none' with "
                             f"EF21), got {self.residual_code!r}")

    def residual_codec_s(self, n: int, rates: Dict[str, float]) -> float:
        """Seconds to decode and code again a residual of ``n`` entries (0 when it is
        kept as values: the encoder updates it in place)."""
        c = self.residual_code
        if c == "none" or self.mode == "dense":
            return 0.0
        return n * (1 / rates[f"quant_decode_{c}"] + 1 / rates[f"quant_encode_{c}"])

    def library(self, cross: str = "auto") -> TAGCConfig:
        """The hook's config of this compression (every knob the rules read explicit),
        whose rules the model applies.

        Args:
            cross: the HSDP form (:data:`HSDP_FORMS`; ``hsdp_allreduce``).
        Returns:
            the config.
        """
        return _library_config(self, cross)

    @property
    def owner_format(self) -> str:
        """The code of an owner's sum (``TAGCConfig.out_format``)."""
        return self.library().out_format()

    @property
    def vote_bytes(self) -> int:
        """Bytes of the per-call vote all-reduce."""
        if self.mode == "dense":
            return 0
        return VOTE_BYTES_EF21 if self.ef21 else VOTE_BYTES_PLAIN


@functools.lru_cache(maxsize=None)
def _library_config(t: Compression, cross: str) -> TAGCConfig:
    """:meth:`Compression.library`, once per (compression, form)."""
    kw: Dict[str, Any] = {"theta": t.theta} if t.mode in ("sparse", "auto") else {}
    if t.mode == "quant":
        kw["hsdp_out_format"] = t.out_format
    return TAGCConfig(mode=t.mode, quant_format=t.quant_format, quant_block=t.quant_block,
                      value_dtype=VALUE_DTYPES[t.value_bytes], error_feedback=True,
                      ef21=t.ef21, gather=t.gather, gather_block=t.gather_block,
                      residual_code=t.residual_code, outer_every=t.outer_every,
                      gather_delta=t.gather_delta, hsdp_allreduce=HSDP_ALLREDUCE[cross], **kw)


# The presets in configs/ (same names as scripts/bench/bench_step.py's CONFIGS); a test
# checks the current ones against the shipped files.
PRESETS: Dict[str, Compression] = {
    "dense": Compression("dense"),                                     # tagc-dense.yaml
    "sparse": Compression("sparse", theta=0.9875, residual_code="int8"),  # tagc-sparse.yaml
    "auto": Compression("auto", theta=0.9875, residual_code="int8"),      # tagc-auto.yaml
    "balanced": Compression("quant", "int4", quant_block=64,
                            residual_code="int4"),                     # tagc-balanced.yaml
    "lean": Compression("quant", "tls"),                               # tagc-lean.yaml
    "full": Compression("quant", "int4", quant_block=64, residual_code="int4",
                        gather="int8"),                                # tagc-full.yaml
    # tagc-full4.yaml: the gathers on int4 codes of the weights' change
    "full4": Compression("quant", "int4", quant_block=64, residual_code="int4", gather="int4",
                         gather_delta=True),
    # tagc-local.yaml: tagc-balanced's exchange at a scale per 256 of the pseudo-gradient,
    # once every 32 steps
    "local": Compression("quant", "int4", residual_code="int4", outer_every=32),
    # the presets as the runs file's older rows ran them: tagc-lean (ternary) with feedback,
    # tagc-balanced / tagc-full with EF21 (a 32-byte vote)
    "lean-ef21": Compression("quant", "ternary", ef21=True),
    # tagc-lean until its codes became tls (one ternary scale per 256)
    "lean-ternary": Compression("quant", "ternary"),
    "balanced-ef21": Compression("quant", "int4", ef21=True),
    "full-ef21": Compression("quant", "int4", ef21=True, gather="int8"),
    # and tagc-sparse / tagc-auto with an fp32 residual (now on int8 codes)
    "sparse-res32": Compression("sparse", theta=0.9875),
    "auto-res32": Compression("auto", theta=0.9875),
}


# HSDP's all-reduce forms between replicas (tagc/hsdp.py ``hsdp_allreduce``), and the
# name suffix that forces one: ``hsdp+P`` = auto, ``hsdp+P/2phase``, ``hsdp+P/gather``.
HSDP_FORMS = ("auto", "all-gather", "two-phase")
FORM_SUFFIX = {"": "auto", "2phase": "two-phase", "gather": "all-gather"}
# the same forms as TAGCConfig.hsdp_allreduce names them, both ways
HSDP_ALLREDUCE = {"auto": "auto", "all-gather": "gather", "two-phase": "two_phase"}
FORM_NAMES = {"gather": "all-gather", "two_phase": "two-phase"}


@dataclass(frozen=True)
class Config:
    """One way to run a step.

    Args:
        name: for reports.
        layout: ``full_shard`` (FSDP over every rank) or ``hsdp`` (FSDP inside a node,
            replicas across nodes).
        tagc: TAGC's compression, or None for plain FSDP/HSDP.
        cross: HSDP's exchange between replicas with TAGC (``hsdp_allreduce``):
            ``auto`` (the hook's default, :func:`hsdp_form`), ``all-gather`` or
            ``two-phase``.
        dtype: parameter and gradient dtype on the wire, ``fp32`` or ``bf16``
            (FSDP2 MixedPrecisionPolicy param_dtype = reduce_dtype).
        fsdp: 1 or 2 (FSDP1 gathers the root once per step; no gathers hook, no HSDP).
        reshard: parameters resharded after forward (FSDP2's ``reshard_after_forward``;
            False: every unit gathered once per step, in forward, and kept for backward).
    """

    name: str
    layout: str
    tagc: Optional[Compression] = None
    cross: str = "auto"
    dtype: str = "fp32"
    fsdp: int = 2
    reshard: bool = True

    def __post_init__(self) -> None:
        if self.layout not in ("full_shard", "hsdp"):
            raise ValueError(f"layout must be 'full_shard' or 'hsdp', got {self.layout!r}")
        if self.cross not in HSDP_FORMS:
            raise ValueError(f"cross must be one of {list(HSDP_FORMS)}, got {self.cross!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.fsdp not in (1, 2):
            raise ValueError(f"fsdp must be 1 or 2, got {self.fsdp!r}")
        if self.fsdp == 1 and self.layout == "hsdp":
            raise ValueError("FSDP1 refuses comm hooks on HYBRID_SHARD: HSDP needs fsdp=2")
        if self.fsdp == 1 and self.tagc is not None and self.tagc.gather != "none":
            raise ValueError("quantized gathers need FSDP2 (FSDP1 has no all-gather hook)")
        if self.tagc is not None and self.tagc.outer_every and self.layout != "hsdp":
            raise ValueError("local steps (outer_every) are TAGC's HSDP route: hsdp+local")
        if self.cross != "auto" and (self.layout != "hsdp" or self.tagc is None):
            raise ValueError(f"the {self.cross} form (hsdp_allreduce) is TAGC's HSDP exchange "
                             "between replicas: hsdp+P/2phase or hsdp+P/gather only")


def hsdp_form(cross: str, t: Compression, replicas: int, s: int) -> str:
    """The form one compressed unit's exchange takes: the hook's own choice
    (``tagc/hsdp.py`` ``allreduce_form``) for ``cross`` (``auto``: the all-gather form
    for ``dense`` and at 2 replicas; ``quant`` two-phase where its bytes are fewer;
    ``sparse``/``auto`` two-phase from 3 replicas on).

    Args:
        cross: :attr:`Config.cross`.
        t: the compression.
        replicas: R.
        s: the unit's shard (elements).
    Returns:
        ``all-gather`` or ``two-phase``.
    """
    return FORM_NAMES[allreduce_form(t.library(cross), replicas, True, s)]


def make_config(name: str, dtype: str = "fp32", fsdp: int = 2) -> Config:
    """A configuration from its name: ``fsdp``, ``hsdp``, ``fsdp+PRESET``,
    ``hsdp+PRESET`` (the hook's default form, ``auto``), ``hsdp+PRESET/2phase`` or
    ``hsdp+PRESET/gather`` (a form forced) (PRESET one of :data:`PRESETS`); an HSDP
    name may end in ``@FMT``, the owner's code of the two-phase form
    (``hsdp_out_format``; runs measured before its default became ``int4`` after
    ternary are ``hsdp+lean-ef21/2phase@ternary``).

    Args:
        name: the name.
        dtype: ``fp32`` or ``bf16``.
        fsdp: 1 or 2.
    Returns:
        the configuration.
    """
    head, _, out = name.partition("@")
    base, _, topo = head.partition("/")
    layout_s, _, preset = base.partition("+")
    layouts = {"fsdp": "full_shard", "hsdp": "hsdp"}
    if layout_s not in layouts or (preset and preset not in PRESETS) \
            or topo not in FORM_SUFFIX or (topo and not preset) \
            or ("@" in name and (layout_s != "hsdp" or not preset or not out)):
        raise ValueError(f"unknown configuration {name!r}: use fsdp, hsdp, fsdp+P, hsdp+P, "
                         f"hsdp+P/2phase or hsdp+P/gather with P one of {sorted(PRESETS)}, "
                         "an HSDP one optionally ending in @FMT (the owner's code)")
    comp = PRESETS[preset] if preset else None
    if comp is not None and out:
        comp = replace(comp, out_format=out)
    return Config(name, layouts[layout_s], comp, FORM_SUFFIX[topo], dtype, fsdp)


def row_config(name: str, dtype: str = "fp32", fsdp: int = 2) -> Config:
    """A step benchmark row (``tagc.cost.rows.ROWS``) on FULL_SHARD as the model sees
    it: its preset's compression with the row's overrides, its precision, its resharding.

    Args:
        name: a key of ``ROWS``.
        dtype: the precision of a row without the bf16 policy (a runs-file setup's).
        fsdp: 1 or 2.
    Returns:
        the configuration, named as :func:`make_config` names it (``fsdp``,
        ``fsdp-bf16``, ``fsdp+full-int4g``).
    Raises:
        ValueError: a row whose preset or override the model does not cover.
    """
    row = ROWS[name]
    if row.preset is None:
        comp, label = None, name
    else:
        key = row.preset[len("tagc-"):]
        if key not in PRESETS:
            raise ValueError(f"row {name!r}: preset {row.preset} is not modelled (its bytes "
                             f"depend on the data or it is not a preset of {sorted(PRESETS)})")
        unknown = set(row.fields) - set(Compression.__dataclass_fields__)
        if unknown:
            raise ValueError(f"row {name!r}: override of {sorted(unknown)} is not modelled")
        comp, label = replace(PRESETS[key], **row.fields), f"fsdp+{name}"
    return Config(label, "full_shard", comp, dtype="bf16" if row.bf16 else dtype, fsdp=fsdp,
                  reshard=row.reshard)


DEFAULT_CONFIGS = ("fsdp", "hsdp", "fsdp+balanced", "fsdp+lean", "fsdp+full",
                   "hsdp+balanced", "hsdp+lean", "hsdp+balanced/gather", "hsdp+lean/gather")
