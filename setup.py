"""Build of the `_tagc` extension (C codec + CPython module) and `tagc_hook`.

Install: ``pip install -e .`` (no torch needed at build time).
"""
import glob
import os

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def codec_sources() -> list:
    """C sources of the codec and its module, relative to this file."""
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.c")))


def tagc_extension() -> Extension:
    """The `_tagc` extension.  A CUDA build adds its objects, TAGC_WITH_CUDA
    and the cudart link here."""
    return Extension(
        "_tagc",
        sources=codec_sources(),
        include_dirs=["csrc"],
        extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra"],
    )


# tagc_hook.py is written separately; the package installs it once it exists.
py_modules = ["tagc_hook"] if os.path.exists(os.path.join(HERE, "tagc_hook.py")) else []

setup(
    name="tagc",
    version="0.1.0",
    description="Transformer-Aware Gradient Compression for PyTorch FSDP",
    python_requires=">=3.9",
    ext_modules=[tagc_extension()],
    py_modules=py_modules,
    extras_require={"test": ["pytest", "hypothesis", "numpy", "PyYAML"]},
)
