"""Build of the `_tagc` extension (C codec + CPython module) and `tagc_hook`.

The C layers, each including only the ones below it: the codec (``csrc/``),
the CUDA kernels (``cuda/``, which include ``csrc/``) and the CPython binding
(``tagc/_ext/``, which includes both).

Install: ``pip install -e .`` (no torch needed at build time).

CUDA kernels (``cuda/*.cu``) are compiled in when nvcc is found, or as asked
by ``TAGC_BUILD_CUDA``:

* ``auto`` (default): CUDA build if nvcc is found (``$NVCC``,
  ``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``), else CPU-only;
* ``1``: CUDA build, fail if nvcc is missing;
* ``0``: CPU-only, nvcc never run (the fast build for CPU-only machines/CI).

``TAGC_CUDA_ARCHS`` lists the GPU architectures (default ``80;90``, i.e.
sm_80 and sm_90; separators ``;``, ``,`` or space).  The CUDA runtime is
linked statically (``cudart_static``), which loads the driver
(``libcuda.so``) with dlopen at the first CUDA call, so the module imports
and runs its CPU ops on machines without a GPU or driver;
``_tagc.cuda_available()`` then says False.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# The top C layer: the CPython module and its CUDA glue (paths relative to HERE,
# as setuptools wants them).
BINDING = os.path.join("tagc", "_ext")


def package_version() -> str:
    """``tagc.__version__``, read as text: importing the package would import torch,
    which a build need not have, and one constant keeps the wheel and the module equal."""
    with open(os.path.join(HERE, "tagc", "__init__.py"), encoding="utf-8") as f:
        found = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if found is None:
        raise SystemExit("setup.py: no `__version__ = \"...\"` line in tagc/__init__.py")
    return found.group(1)


def codec_sources() -> list:
    """C sources of the codec (every csrc/*.c), relative to this file."""
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.c")))


def cuda_mode() -> str:
    """``on``, ``off`` or ``auto`` from TAGC_BUILD_CUDA."""
    v = os.environ.get("TAGC_BUILD_CUDA", "auto").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ("1", "on", "yes", "true"):
        return "on"
    if v in ("0", "off", "no", "false"):
        return "off"
    raise SystemExit(f"setup.py: TAGC_BUILD_CUDA must be 0, 1 or auto, got {v!r}")


def find_nvcc() -> Optional[str]:
    """Path of nvcc, or None."""
    cands = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    cands += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def cuda_root(nvcc: str) -> str:
    """The toolkit directory (nvcc may be a wrapper on PATH: ask it)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            return os.path.realpath(line[len("#$ TOP="):].strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def cuda_archs() -> List[str]:
    """Compute capabilities from TAGC_CUDA_ARCHS, e.g. ["80", "90"]."""
    raw = os.environ.get("TAGC_CUDA_ARCHS", "80;90")
    archs = [a.strip().lower().replace("sm_", "") for a in raw.replace(",", ";").replace(" ", ";")
             .split(";") if a.strip()]
    if not archs or not all(a.isdigit() for a in archs):
        raise SystemExit(f"setup.py: TAGC_CUDA_ARCHS must list architectures like '80;90', "
                         f"got {raw!r}")
    return archs


def jobs() -> int:
    """Compilers run at once: one per CPU."""
    return max(1, os.cpu_count() or 1)


class BuildExt(build_ext):
    """build_ext that first compiles the extension's ``cuda_sources`` with nvcc, then its
    C sources one compiler per CPU (setuptools compiles one extension's sources one after
    another; csrc/fp4.c and csrc/quant.c alone take most of a serial build's minute), the
    codec's (csrc/) without the CUDA build's macro and include folders."""

    def build_extension(self, ext: Extension) -> None:
        cu = getattr(ext, "cuda_sources", [])
        if cu:
            ext.extra_objects = list(ext.extra_objects or []) + self._nvcc_all(ext, cu)
        serial = self.compiler.compile

        def one(src: str, args: tuple, kwargs: dict) -> List[str]:
            if not src.startswith(BINDING):
                # The codec (csrc/) never sees CUDA: the same command in a CPU and a CUDA
                # build, so a compiler cache serves one from the other.
                kwargs = dict(kwargs, macros=[], include_dirs=ext.codec_include_dirs)
            return serial([src], *args, **kwargs)

        def compile_parallel(sources: List[str], *args, **kwargs) -> List[str]:
            with ThreadPoolExecutor(max_workers=jobs()) as pool:
                return [obj for objs in pool.map(lambda src: one(src, args, kwargs), sources)
                        for obj in objs]

        self.compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile  # the instance attribute: the class's method again

    def _nvcc_all(self, ext: Extension, sources: List[str]) -> List[str]:
        nvcc = ext.nvcc
        gencode = []
        for a in cuda_archs():
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        headers = glob.glob(os.path.join(HERE, "cuda", "*.h*")) + \
            glob.glob(os.path.join(HERE, "csrc", "*.h"))
        newest_header = max((os.path.getmtime(h) for h in headers), default=0.0)

        def one(src: str) -> str:
            obj = os.path.join(out_dir, os.path.basename(src)[:-3] + ".o")
            if (os.path.exists(obj) and not self.force and
                    os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)):
                return obj
            cmd = [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Icsrc", "-Icuda",
                   *gencode, "-c", src, "-o", obj]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=HERE)
            return obj

        with ThreadPoolExecutor(max_workers=jobs()) as pool:
            return list(pool.map(one, sources))


def tagc_extension() -> Extension:
    """The `_tagc` extension, with the CUDA kernels when building for CUDA."""
    # a header edit rebuilds the extension (setuptools compares sources + depends)
    depends = sorted(os.path.relpath(p, HERE) for d, pat in
                     (("csrc", "*.h"), ("cuda", "*.h"), ("cuda", "*.cuh"), (BINDING, "*.h"))
                     for p in glob.glob(os.path.join(HERE, d, pat)))
    ext = Extension(
        "_tagc",
        sources=codec_sources() + [os.path.join(BINDING, "_tagcmodule.c"),
                                   os.path.join(BINDING, "tagc_args.c")],
        depends=depends,
        include_dirs=["csrc"],
        extra_compile_args=["-std=c11", "-O3", "-fno-trapping-math", "-Wall", "-Wextra"],
    )
    ext.codec_include_dirs = list(ext.include_dirs)  # what the CUDA build adds is the binding's
    mode = cuda_mode()
    nvcc = None if mode == "off" else find_nvcc()
    if nvcc is None:
        if mode == "on":
            raise SystemExit("setup.py: TAGC_BUILD_CUDA=1 but nvcc was not found "
                             "(set NVCC or CUDA_HOME)")
        print("setup.py: building _tagc for CPU only"
              + (" (TAGC_BUILD_CUDA=0)" if mode == "off" else " (no nvcc found)"),
              file=sys.stderr)
        return ext
    root = cuda_root(nvcc)
    libdirs = [d for d in (os.path.join(root, "lib64"),
                           os.path.join(root, "targets", "x86_64-linux", "lib"),
                           os.path.join(root, "targets", "sbsa-linux", "lib"),
                           os.path.join(root, "lib"))
               if os.path.exists(os.path.join(d, "libcudart_static.a"))]
    if not libdirs:
        raise SystemExit(f"setup.py: no libcudart_static.a under {root}")
    print(f"setup.py: building _tagc with CUDA kernels ({nvcc}, archs "
          f"{';'.join(cuda_archs())}); TAGC_BUILD_CUDA=0 builds CPU-only", file=sys.stderr)
    ext.sources.append(os.path.join(BINDING, "tagc_cuda_module.c"))
    ext.include_dirs += ["cuda", os.path.join(root, "include")]
    ext.define_macros = [("TAGC_WITH_CUDA", "1")]
    ext.library_dirs = libdirs[:1]
    # Static runtime: no libcudart.so dependency; libcuda.so is dlopen-ed at
    # the first CUDA call, so importing never needs a driver.
    ext.libraries = ["cudart_static", "dl", "pthread", "rt", "stdc++"]
    ext.cuda_sources = sorted(os.path.relpath(p, HERE)
                              for p in glob.glob(os.path.join(HERE, "cuda", "*.cu")))
    ext.nvcc = nvcc
    return ext



setup(
    name="tagc",
    version=package_version(),
    description="Transformer-Aware Gradient Compression for PyTorch FSDP",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.9",
    ext_modules=[tagc_extension()],
    cmdclass={"build_ext": BuildExt},
    py_modules=["tagc_hook"],
    # configs/ (the presets, one source of truth at the top level) ships as the package
    # tagc.configs, so an installed wheel finds them by name (tagc/presets.py)
    packages=find_packages(include=["tagc", "tagc.*"]) + ["tagc.configs"],
    package_dir={"tagc.configs": "configs"},
    package_data={"tagc.configs": ["*.yaml"], "tagc.train": ["netem.sh"]},
    # The torch floor (tagc/fsdp2.py TORCH_FLOOR; register() names what each missing
    # FSDP2 method needs).  Install torch first (README: `pip install torch==2.13.0` on
    # a CPU machine): without one installed, pip would fetch a multi-GB CUDA build.
    install_requires=["torch>=2.10", "PyYAML", "tqdm", "numpy"],
    # transformers/accelerate: the Hugging Face tests and scripts/finetune_hf.py;
    # ft: tagc.ft, TAGC's all-reduce inside torchft (docs/TORCHFT.md)
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis", "matplotlib", "tensorboard",
                             "transformers", "accelerate"],
                    "ft": ["torchft>=0.2.0,<0.3"]},
)
