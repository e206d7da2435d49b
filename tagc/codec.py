"""The handle on the C codec: the one module that imports the extension ``_tagc``.

Everything else in ``tagc/`` takes the handle from here (``from .codec import _tagc``).
Importing never fails: without a build ``_tagc`` is None, ``dense`` mode and config
handling still work, and :func:`require_codec` (``register``, a compressing reduction)
says how to build it.
"""

from __future__ import annotations

from typing import Optional

try:
    import _tagc
except ImportError as _exc:  # pragma: no cover - exercised only without a build
    _tagc = None
    IMPORT_ERROR: Optional[BaseException] = _exc
else:
    IMPORT_ERROR = None


def require_codec() -> None:
    """Raise a clear ImportError when the ``_tagc`` extension is not built."""
    if _tagc is None:
        raise ImportError(
            "the TAGC codec module `_tagc` is not built; run `pip install -e .` in the "
            f"repository (import failed with: {IMPORT_ERROR})")
