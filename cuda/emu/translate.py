#!/usr/bin/env python3
"""Rewrite CUDA kernel launches for the CPU emulation (cuda_runtime.h here).

``name<<<grid, block, smem, stream>>>(args)`` becomes
``tagc_emu_launch(grid, block, smem, stream, [=] { name(args); })``; nothing
else changes, so the emulated build runs the kernels' own code.

Usage: translate.py SRC_DIR OUT_DIR  (every *.cu and *.cuh of SRC_DIR)
"""
from __future__ import annotations

import os
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_]\w*)\s*<<<")


def _close(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_ch} at offset {start}")


def translate(text: str) -> str:
    """The source with every launch rewritten.

    Args:
        text: CUDA C++ source.
    Returns:
        the rewritten source.
    """
    out, pos = [], 0
    while True:
        m = LAUNCH.search(text, pos)
        if m is None:
            out.append(text[pos:])
            return "".join(out)
        cfg_end = text.index(">>>", m.end())
        cfg = text[m.end():cfg_end]
        paren = text.index("(", cfg_end)
        args_end = _close(text, paren, "(", ")")
        args = text[paren:args_end]
        out.append(text[pos:m.start()])
        out.append(f"tagc_emu_launch({cfg}, [=] {{ {m.group(1)}{args}; }})")
        pos = args_end


def main(argv: list) -> int:
    """Translate a directory.

    Args:
        argv: [SRC_DIR, OUT_DIR].
    Returns:
        exit status.
    """
    src, dst = argv
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name.endswith((".cu", ".cuh")):
            with open(os.path.join(src, name)) as f:
                text = translate(f.read())
            with open(os.path.join(dst, name), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
