"""The handle on the C codec: the one module that imports the extension ``_tagc``.

Everything else in ``tagc/`` takes the handle from here (``from .codec import _tagc``),
and codes gradients on a quant format through :func:`quant_bytes`, :func:`quant_encode`
and :func:`quant_decode_add`, which pick the format's functions (the block records of
``_tagc.quant_*`` or a layout of its own, ``tls``).  Importing never fails: without a
build ``_tagc`` is None, ``dense`` mode and config handling still work, and
:func:`require_codec` (``register``, a compressing reduction) says how to build it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

try:
    import _tagc
except ImportError as _exc:  # pragma: no cover - exercised only without a build
    _tagc = None
    IMPORT_ERROR: Optional[BaseException] = _exc
else:
    IMPORT_ERROR = None
    # Every tensor argument is exported through DLPack.  torch.Tensor.__dlpack__ is a
    # Python method (2.5 us a tensor on the CI machine), torch's C exporter behind it
    # 0.3 us, and a unit's call passes up to six tensors: the codec's host cost per
    # call is what a host-bound GPU step pays (docs/gpu).  Exact torch.Tensor only:
    # subclasses keep their own __dlpack__.
    _tagc.set_dlpack_exporter(torch.Tensor, torch._C._to_dlpack)


def require_codec() -> None:
    """Raise a clear ImportError when the ``_tagc`` extension is not built."""
    if _tagc is None:
        raise ImportError(
            "the TAGC codec module `_tagc` is not built; run `pip install -e .` in the "
            f"repository (import failed with: {IMPORT_ERROR})")


# Quant formats with a layout of their own instead of ``_tagc.quant_*``'s block records:
# the format's size, encode and decode-add functions of the extension.  Their blocks are
# the format's own (tls: scales per 32 under scales per 512), so ``block`` does not
# apply to them; it still sizes the other codes of a config (residual, HSDP owners').
_OWN_LAYOUT = {"tls": ("tls_bytes", "tls_encode", "tls_decode_add")}
# values per period of those formats' scales (tls: a group of 16 blocks of 32), what
# their bits per value are taken over
OWN_PERIOD = {"tls": 512}


def block_records(fmt: str) -> bool:
    """Whether quant format ``fmt`` is coded as ``_tagc.quant_*``'s block records (every
    format but those with a layout of their own, ``tls``)."""
    return fmt not in _OWN_LAYOUT


def quant_bytes(n: int, fmt: str, block: int) -> int:
    """Wire size of ``n`` values on the quant code ``fmt``.

    Args:
        n: values.
        fmt: a quant format (``tagc.config.QUANT_FORMATS``).
        block: values per scale of the block formats (not read by ``tls``).
    Returns:
        the bytes of one shard's message.
    """
    if fmt in _OWN_LAYOUT:
        return int(getattr(_tagc, _OWN_LAYOUT[fmt][0])(n))
    return int(_tagc.quant_bytes(n, fmt, block))


def quant_encode(buf: torch.Tensor, residual: Optional[torch.Tensor],
                 grad: torch.Tensor, fmt: str, block: int, **kw: Any) -> None:
    """``buf`` = the codes of ``grad + residual`` on ``fmt``; the residual keeps what they
    drop (error feedback; None: none).

    Args:
        buf: uint8, at least :func:`quant_bytes` long.
        residual: fp32/bf16 like grad, updated in place, or None.
        grad: fp32/bf16 values.
        fmt, block: as :func:`quant_bytes`.
        **kw: the extension's keywords (``stream``).
    """
    if fmt in _OWN_LAYOUT:
        getattr(_tagc, _OWN_LAYOUT[fmt][1])(buf, residual, grad, **kw)
    else:
        _tagc.quant_encode(buf, residual, grad, fmt, block, **kw)


def quant_decode_add(out: torch.Tensor, buf: torch.Tensor, fmt: str, block: int,
                     **kw: Any) -> None:
    """``out`` += the decoded values of one message on ``fmt``.

    Args:
        out: fp32, the message's length.
        buf: :func:`quant_encode`'s bytes.
        fmt, block: as :func:`quant_bytes`.
        **kw: the extension's keywords (``stream``, ``status_out``).
    """
    if fmt in _OWN_LAYOUT:
        getattr(_tagc, _OWN_LAYOUT[fmt][2])(out, buf, **kw)
    else:
        _tagc.quant_decode_add(out, buf, fmt, block, **kw)
