"""The CUDA launchers of ``cuda/`` run on the CPU through the emulation of ``cuda/emu/``.

:func:`build` translates every ``cuda/*.cu`` (``cuda/emu/translate.py`` rewrites the
``<<<...>>>`` launches) and compiles it with g++ against ``cuda/emu/cuda_runtime.h`` into
one shared library whose functions are the launchers of ``cuda/tagc_cuda.h`` (signatures
in :data:`SIGS`); ``tests/test_cuda_emulated.py`` calls them one by one.

:class:`EmuOps` puts the ``_tagc`` module's CUDA calling convention on top of them (scalar
results in ``out=``/``count_out=`` tensors, ``stream=``, ``status_out=``), on CPU tensors:
a harness written against ``_tagc`` on CUDA tensors (``tagc_bench.cuda_ops``,
``scripts/bench/bench_kernels_gpu.py``) runs unchanged on a machine without a GPU, with
the kernels' own code, when it is handed an :class:`EmuOps` instead of ``_tagc``.  It says
nothing about GPU speed, occupancy or the GPU memory model.  Every emulated thread is an
OS thread: keep sizes to a few thousand elements.
"""
from __future__ import annotations

import contextlib
import ctypes as C
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from tagc.codec import _tagc

ROOT = Path(__file__).resolve().parents[3]
F32, BF16 = 0, 1
DT = {torch.float32: F32, torch.bfloat16: BF16}
QFORMAT = {"sign": 1, "ternary": 2, "int4": 4, "int8": 8}
CODING = {"ef": 1, "bitmap": 2, "dense": 3}
PEEL_ROUNDS = 96  # TAGC_CUDA_PEEL_ROUNDS, what _tagc passes
I64, SZ, VP, INT, U64, UINT = C.c_int64, C.c_size_t, C.c_void_p, C.c_int, C.c_uint64, C.c_uint

# every launcher of cuda/tagc_cuda.h and its workspace query: (restype, argtypes)
SIGS = {
    "tagc_cuda_select_kth_workspace_size": (SZ, [I64]),
    "tagc_cuda_select_kth": (INT, [VP, VP, INT, I64, I64, VP, SZ, VP]),
    "tagc_cuda_sparsify_workspace_size": (SZ, [I64]),
    "tagc_cuda_sparsify": (INT, [VP, I64, VP, INT, I64, VP, I64, VP, INT, VP, INT, I64, I64,
                                 VP, VP, SZ, VP]),
    "tagc_cuda_lanes_pack": (INT, [VP, I64, VP, I64, INT, VP]),
    "tagc_cuda_lanes_unpack": (INT, [VP, I64, VP, I64, I64, INT, VP]),
    "tagc_cuda_bitmap_or": (INT, [VP, I64, VP, I64, I64, VP]),
    "tagc_cuda_popcount": (INT, [VP, VP, I64, VP]),
    "tagc_cuda_sketch_encode_workspace_size": (SZ, [I64, INT]),
    "tagc_cuda_sketch_encode": (INT, [VP, INT, I64, VP, VP, INT, I64, I64, I64, U64, VP, VP,
                                      SZ, VP]),
    "tagc_cuda_peel_decode_workspace_size": (SZ, [I64, I64, INT]),
    "tagc_cuda_peel_decode": (INT, [VP, I64, VP, I64, VP, VP, INT, VP, I64, I64, U64, INT,
                                    INT, VP, SZ, VP]),
    "tagc_cuda_sparse_pack": (INT, [VP, I64, VP, VP, INT, I64, VP]),
    "tagc_cuda_sparse_unpack_workspace_size": (SZ, []),
    "tagc_cuda_sparse_unpack": (INT, [VP, I64, VP, I64, I64, INT, VP, VP, SZ, VP]),
    "tagc_cuda_quant_encode_workspace_size": (SZ, []),
    "tagc_cuda_quant_encode": (INT, [VP, I64, VP, INT, VP, INT, I64, INT, I64, VP, SZ, VP]),
    "tagc_cuda_quant_decode_add_workspace_size": (SZ, []),
    "tagc_cuda_quant_decode_add": (INT, [VP, I64, VP, I64, INT, I64, VP, VP, SZ, VP]),
    "tagc_cuda_quant_unit_encode": (INT, [VP, I64, VP, I64, VP, INT, I64, I64, I64, INT, INT,
                                          I64, C.c_float, VP, VP, VP, VP]),
    "tagc_cuda_quant_unit_decode": (INT, [VP, INT, I64, VP, I64, VP, INT, I64, I64, INT, I64,
                                          C.c_float, VP]),
    "tagc_cuda_pairs_pack_workspace_size": (SZ, []),
    "tagc_cuda_pairs_pack": (INT, [VP, I64, VP, VP, INT, I64, I64, INT, VP, VP, SZ, VP]),
    "tagc_cuda_pairs_unpack_add_workspace_size": (SZ, [I64, I64]),
    "tagc_cuda_pairs_unpack_add": (INT, [VP, I64, VP, I64, I64, INT, INT, VP, VP, SZ, VP]),
    "tagc_cuda_wq_encode_workspace_size": (SZ, [I64]),
    "tagc_cuda_wq_encode": (INT, [VP, I64, VP, INT, I64, VP, I64, INT, I64, VP, VP, SZ, VP]),
    "tagc_cuda_wq_decode_workspace_size": (SZ, [I64]),
    "tagc_cuda_wq_decode": (INT, [VP, INT, I64, VP, I64, VP, I64, INT, I64, VP, VP, SZ, VP]),
    "tagc_cuda_wq_delta_encode_workspace_size": (SZ, [I64]),
    "tagc_cuda_wq_delta_encode": (INT, [VP, I64, VP, VP, VP, INT, I64, VP, I64, INT, I64, VP,
                                        VP, SZ, VP]),
    "tagc_cuda_wq_delta_decode_workspace_size": (SZ, [I64]),
    "tagc_cuda_wq_delta_decode": (INT, [VP, VP, INT, I64, VP, I64, VP, I64, INT, I64, VP, VP,
                                        SZ, VP]),
    "tagc_cuda_fp4_encode_workspace_size": (SZ, []),
    "tagc_cuda_fp4_encode": (INT, [VP, I64, VP, INT, VP, INT, I64, I64, UINT, U64, VP, SZ, VP]),
    "tagc_cuda_fp4_decode_add": (INT, [VP, I64, VP, I64, I64, UINT, U64, VP]),
    "tagc_cuda_rht": (INT, [VP, I64, VP, I64, I64, U64, INT, VP]),
    "tagc_cuda_tls_encode_workspace_size": (SZ, [I64]),
    "tagc_cuda_tls_encode": (INT, [VP, I64, VP, INT, VP, INT, I64, VP, SZ, VP]),
    "tagc_cuda_tls_decode_add_workspace_size": (SZ, []),
    "tagc_cuda_tls_decode_add": (INT, [VP, I64, VP, I64, VP, VP, SZ, VP]),
    # the emulation's own: launches and memsets so far (cuda/emu/cuda_runtime.h)
    "tagc_emu_counters": (None, [VP]),
}
LIB_NAME = "libtagc_cuda_emu.so"


class BuildError(RuntimeError):
    """The emulated build failed (the compiler's output is the message)."""


def build(out: Union[str, Path], jobs: Optional[int] = None) -> Path:
    """Compile the launchers against the emulation into ``out/libtagc_cuda_emu.so``.

    Args:
        out: an empty or missing folder (the translated sources go there too).
        jobs: parallel g++ processes (default: every CPU).
    Returns:
        the library's path.
    Raises:
        FileNotFoundError: no C++ compiler (``$CXX`` or g++).
        BuildError: a file did not compile or link.
    """
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) to build the emulated kernels")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "csrc").exists():
        os.symlink(ROOT / "csrc", out / "csrc")
    subprocess.run([sys.executable, str(ROOT / "cuda" / "emu" / "translate.py"),
                    str(ROOT / "cuda"), str(out / "cuda")], check=True)
    srcs = sorted(p for p in os.listdir(out / "cuda") if p.endswith(".cu"))

    def compile_one(name: str) -> str:
        obj = str(out / "cuda" / (name[:-3] + ".o"))
        # -U_FORTIFY_SOURCE: the fibers switch stacks by longjmp (cuda/emu/cuda_runtime.h)
        res = subprocess.run([cxx, "-std=c++17", "-O1", "-fPIC", "-Wall", "-Wextra", "-Werror",
                              "-U_FORTIFY_SOURCE",
                              "-I", str(ROOT / "cuda" / "emu"), "-I", str(ROOT / "cuda"),
                              "-x", "c++", "-c", str(out / "cuda" / name), "-o", obj],
                             capture_output=True, text=True)
        if res.returncode:
            raise BuildError(f"emulated build of {name} failed:\n{res.stderr[-4000:]}")
        return obj

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        objs = list(pool.map(compile_one, srcs))
    so = out / LIB_NAME
    res = subprocess.run([cxx, "-shared", "-o", str(so), *objs, "-lpthread"],
                         capture_output=True, text=True)
    if res.returncode:
        raise BuildError(f"emulated link failed:\n{res.stderr[-4000:]}")
    return so


def load(path: Union[str, Path]) -> C.CDLL:
    """The library :func:`build` wrote, its functions typed from :data:`SIGS`."""
    dll = C.CDLL(str(path))
    for name, (res, args) in SIGS.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = res, args
    return dll


def P(t: Optional[torch.Tensor]) -> Optional[int]:
    """A tensor's address for a launcher (None: NULL)."""
    return None if t is None else t.data_ptr()


def ws(nbytes: int) -> torch.Tensor:
    """A workspace of ``nbytes`` (at least one byte, so never NULL)."""
    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8)


class EmuError(ValueError):
    """A launcher refused its arguments (the ``tagc_status`` in :attr:`status`)."""

    def __init__(self, fn: str, status: int) -> None:
        super().__init__(f"{fn}: tagc_status {status}")
        self.status = status


def _dtype(x: Union[str, torch.dtype]) -> int:
    if isinstance(x, str):
        x = {"float32": torch.float32, "bfloat16": torch.bfloat16}[x]
    return DT[x]


@contextlib.contextmanager
def emulated_cuda(ops: Any) -> Iterator[None]:
    """Reducers called inside take their CUDA branch on CPU tensors: ``Exec.cuda`` set
    (device flags instead of host reads, poisoning, the stream keyword), no CPU scratch
    reuse (CUDA buffers come from the caching allocator), and ``_tagc`` replaced by
    ``ops`` (an :class:`EmuOps`: the kernels' own code) where the reducers, the
    transports and the parameter gathers call it.  What runs on the CPU stays on the CPU.

    Args:
        ops: the ``_tagc`` stand-in.
    """
    import tagc.codec
    import tagc.device
    import tagc.gather
    import tagc.transports

    saved = (tagc.codec._tagc, tagc.transports._tagc, tagc.gather._tagc,
             tagc.device.Exec.__init__)

    def exec_init(self: Any, t: torch.Tensor, scratch: Any = None) -> None:
        self.cuda, self.scratch, self.kw, self.ok, self.vote = True, None, {"stream": 0}, None, None

    tagc.codec._tagc = tagc.transports._tagc = tagc.gather._tagc = ops
    tagc.device.Exec.__init__ = exec_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        (tagc.codec._tagc, tagc.transports._tagc, tagc.gather._tagc,
         tagc.device.Exec.__init__) = saved


class EmuOps:
    """``_tagc``'s CUDA ops on CPU tensors, run by the emulated launchers.

    Every method takes the arguments of the ``_tagc`` function of the same name as a
    CUDA caller passes them (``out=``/``count_out=`` for scalars, ``stream=`` ignored,
    ``status_out=``) and returns None; a launcher's synchronous error raises
    :class:`EmuError`.  The size helpers (``quant_bytes``, ``wq_bytes``, ...) and
    ``NonFiniteError`` are the C module's.

    Args:
        lib: the library (:func:`build`, :func:`load`) or its path.
    """

    def __init__(self, lib: Union[C.CDLL, str, Path]) -> None:
        self.lib = lib if isinstance(lib, C.CDLL) else load(lib)

    def __getattr__(self, name: str) -> Any:
        return getattr(_tagc, name)  # size helpers, seeds, NonFiniteError

    def _run(self, fn: str, *args: Any) -> None:
        st = getattr(self.lib, fn)(*args)
        if st != 0:
            raise EmuError(fn, st)

    def select_kth(self, x: torch.Tensor, k: int, *, out: torch.Tensor, stream: int = 0) -> None:
        w = ws(self.lib.tagc_cuda_select_kth_workspace_size(x.numel()))
        self._run("tagc_cuda_select_kth", P(out), P(x), DT[x.dtype], x.numel(), k, P(w),
                  w.numel(), None)

    def sparsify(self, idx: torch.Tensor, val: torch.Tensor, bitmap: torch.Tensor,
                 residual: Optional[torch.Tensor], grad: torch.Tensor, k: int, *,
                 out: torch.Tensor, stream: int = 0) -> None:
        n = grad.numel()
        w = ws(self.lib.tagc_cuda_sparsify_workspace_size(n))
        rd = F32 if residual is None else DT[residual.dtype]
        self._run("tagc_cuda_sparsify", P(idx), idx.numel(), P(val), DT[val.dtype], val.numel(),
                  P(bitmap), bitmap.numel(), P(residual), rd, P(grad), DT[grad.dtype], n, k,
                  P(out), P(w), w.numel(), None)

    def lanes_pack(self, lanes: torch.Tensor, bitmap: torch.Tensor, n: int, bits: int, *,
                   stream: int = 0) -> None:
        self._run("tagc_cuda_lanes_pack", P(lanes), lanes.numel(), P(bitmap), n, bits, None)

    def lanes_unpack(self, bitmap: torch.Tensor, lanes: torch.Tensor, n: int, bits: int, *,
                     stream: int = 0) -> None:
        self._run("tagc_cuda_lanes_unpack", P(bitmap), bitmap.numel(), P(lanes), lanes.numel(),
                  n, bits, None)

    def bitmap_or(self, dst: torch.Tensor, src: torch.Tensor, count: int, *,
                  stream: int = 0) -> None:
        nbytes = src.numel() // count if count else 0
        self._run("tagc_cuda_bitmap_or", P(dst), dst.numel(), P(src), nbytes, count, None)

    def popcount(self, bitmap: torch.Tensor, n: int, *, out: torch.Tensor,
                 stream: int = 0) -> None:
        self._run("tagc_cuda_popcount", P(out), P(bitmap), n, None)

    def sketch_encode(self, sketch: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, n: int,
                      t: int, seed: int, *, stream: int = 0,
                      status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_sketch_encode_workspace_size(t, DT[sketch.dtype]))
        self._run("tagc_cuda_sketch_encode", P(sketch), DT[sketch.dtype], sketch.numel(), P(idx),
                  P(val), DT[val.dtype], idx.numel(), n, t, seed, P(status_out), P(w),
                  w.numel(), None)

    def peel_decode(self, out: torch.Tensor, sketch: torch.Tensor, bitmap: torch.Tensor, n: int,
                    t: int, seed: int, *, unpeeled: Optional[torch.Tensor] = None,
                    estimate: bool = True, count_out: torch.Tensor, stream: int = 0) -> None:
        w = ws(self.lib.tagc_cuda_peel_decode_workspace_size(n, t, PEEL_ROUNDS))
        self._run("tagc_cuda_peel_decode", P(out), out.numel(), P(unpeeled),
                  0 if unpeeled is None else unpeeled.numel(), P(count_out), P(sketch),
                  DT[sketch.dtype], P(bitmap), n, t, seed, int(bool(estimate)), PEEL_ROUNDS,
                  P(w), w.numel(), None)

    def sparse_pack(self, buf: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, *,
                    stream: int = 0) -> None:
        self._run("tagc_cuda_sparse_pack", P(buf), buf.numel(), P(idx), P(val), DT[val.dtype],
                  idx.numel(), None)

    def sparse_unpack(self, out: torch.Tensor, buf: torch.Tensor, k: int,
                      value_dtype: Union[str, torch.dtype], *, stream: int = 0,
                      status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_sparse_unpack_workspace_size())
        self._run("tagc_cuda_sparse_unpack", P(out), out.numel(), P(buf), buf.numel(), k,
                  _dtype(value_dtype), P(status_out), P(w), w.numel(), None)

    def quant_encode(self, buf: torch.Tensor, residual: Optional[torch.Tensor],
                     grad: torch.Tensor, format: str, block: int, *, stream: int = 0) -> None:
        w = ws(self.lib.tagc_cuda_quant_encode_workspace_size())
        rd = F32 if residual is None else DT[residual.dtype]
        self._run("tagc_cuda_quant_encode", P(buf), buf.numel(), P(residual), rd, P(grad),
                  DT[grad.dtype], grad.numel(), QFORMAT[format], block, P(w), w.numel(), None)

    def quant_decode_add(self, out: torch.Tensor, buf: torch.Tensor, format: str, block: int, *,
                         stream: int = 0, status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_quant_decode_add_workspace_size())
        self._run("tagc_cuda_quant_decode_add", P(out), out.numel(), P(buf), buf.numel(),
                  QFORMAT[format], block, P(status_out), P(w), w.numel(), None)

    def quant_unit_encode(self, buf: torch.Tensor, rcodes: torch.Tensor, grad: torch.Tensor,
                          world: int, rank: int, format: str, residual_format: str, block: int,
                          factor: float, *, counts: torch.Tensor, flags: torch.Tensor,
                          vote: Optional[torch.Tensor] = None, stream: int = 0) -> None:
        if counts.numel() != 5 or counts.dtype != torch.int64:
            # the kernel adds to five counters (the module checks this on a GPU)
            raise ValueError(f"quant_unit_encode: counts must be int64[5], got "
                             f"{counts.dtype}[{counts.numel()}]")
        self._run("tagc_cuda_quant_unit_encode", P(buf), buf.numel(), P(rcodes), rcodes.numel(),
                  P(grad), DT[grad.dtype], grad.numel() // world, world, rank, QFORMAT[format],
                  QFORMAT[residual_format], block, factor, P(counts), P(vote), P(flags), None)

    def quant_unit_decode(self, out: torch.Tensor, buf: torch.Tensor, own: torch.Tensor,
                          world: int, rank: int, format: str, block: int, divisor: float, *,
                          stream: int = 0) -> None:
        self._run("tagc_cuda_quant_unit_decode", P(out), DT[out.dtype], out.numel(), P(buf),
                  buf.numel(), P(own), DT[own.dtype], world, rank, QFORMAT[format], block,
                  divisor, None)

    def pairs_pack(self, buf: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, n: int,
                   coding: str, *, stream: int = 0,
                   status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_pairs_pack_workspace_size())
        self._run("tagc_cuda_pairs_pack", P(buf), buf.numel(), P(idx), P(val), DT[val.dtype],
                  idx.numel(), n, CODING[coding], P(status_out), P(w), w.numel(), None)

    def pairs_unpack_add(self, out: torch.Tensor, buf: torch.Tensor, k: int,
                         value_dtype: Union[str, torch.dtype], coding: str, *, stream: int = 0,
                         status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_pairs_unpack_add_workspace_size(out.numel(), k))
        self._run("tagc_cuda_pairs_unpack_add", P(out), out.numel(), P(buf), buf.numel(), k,
                  _dtype(value_dtype), CODING[coding], P(status_out), P(w), w.numel(), None)

    @staticmethod
    def _segs(segs: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        return segs if isinstance(segs, torch.Tensor) else torch.tensor(list(segs),
                                                                        dtype=torch.int64)

    def wq_encode(self, buf: torch.Tensor, src: torch.Tensor,
                  segs: Union[torch.Tensor, Sequence[int]], format: str, block: int, *,
                  stream: int = 0, status_out: Optional[torch.Tensor] = None) -> None:
        seg = self._segs(segs)
        w = ws(self.lib.tagc_cuda_wq_encode_workspace_size(seg.numel()))
        self._run("tagc_cuda_wq_encode", P(buf), buf.numel(), P(src), DT[src.dtype], src.numel(),
                  P(seg), seg.numel(), QFORMAT[format], block, P(status_out), P(w), w.numel(),
                  None)

    def wq_decode(self, out: torch.Tensor, buf: torch.Tensor,
                  segs: Union[torch.Tensor, Sequence[int]], format: str, block: int, *,
                  stream: int = 0, status_out: Optional[torch.Tensor] = None) -> None:
        seg = self._segs(segs)
        w = ws(self.lib.tagc_cuda_wq_decode_workspace_size(seg.numel()))
        self._run("tagc_cuda_wq_decode", P(out), DT[out.dtype], out.numel(), P(buf), buf.numel(),
                  P(seg), seg.numel(), QFORMAT[format], block, P(status_out), P(w), w.numel(),
                  None)

    def wq_delta_encode(self, buf: torch.Tensor, src: torch.Tensor, sent: torch.Tensor,
                        base: torch.Tensor, segs: Union[torch.Tensor, Sequence[int]],
                        format: str, block: int, *, stream: int = 0,
                        status_out: Optional[torch.Tensor] = None) -> None:
        seg = self._segs(segs)
        w = ws(self.lib.tagc_cuda_wq_delta_encode_workspace_size(seg.numel()))
        self._run("tagc_cuda_wq_delta_encode", P(buf), buf.numel(), P(src), P(sent), P(base),
                  DT[src.dtype], src.numel(), P(seg), seg.numel(), QFORMAT[format], block,
                  P(status_out), P(w), w.numel(), None)

    def wq_delta_decode(self, out: Optional[torch.Tensor], ref: torch.Tensor, buf: torch.Tensor,
                        segs: Union[torch.Tensor, Sequence[int]], format: str, block: int, *,
                        stream: int = 0, status_out: Optional[torch.Tensor] = None) -> None:
        seg = self._segs(segs)
        w = ws(self.lib.tagc_cuda_wq_delta_decode_workspace_size(seg.numel()))
        self._run("tagc_cuda_wq_delta_decode", P(ref if out is None else out), P(ref),
                  DT[ref.dtype], ref.numel(), P(buf), buf.numel(), P(seg), seg.numel(),
                  QFORMAT[format], block, P(status_out), P(w), w.numel(), None)

    @staticmethod
    def _fp4_flags(rotate: bool, stochastic: bool) -> int:
        return (1 if rotate else 0) | (2 if stochastic else 0)  # TAGC_FP4_ROTATE, _STOCHASTIC

    def fp4_encode(self, buf: torch.Tensor, residual: Optional[torch.Tensor],
                   grad: torch.Tensor, block: int, *, seed: int = 0, rotate: bool = False,
                   stochastic: bool = False, stream: int = 0) -> None:
        w = ws(self.lib.tagc_cuda_fp4_encode_workspace_size())
        rd = F32 if residual is None else DT[residual.dtype]
        self._run("tagc_cuda_fp4_encode", P(buf), buf.numel(), P(residual), rd, P(grad),
                  DT[grad.dtype], grad.numel(), block, self._fp4_flags(rotate, stochastic),
                  seed, P(w), w.numel(), None)

    def fp4_decode_add(self, out: torch.Tensor, buf: torch.Tensor, block: int, *,
                       seed: int = 0, rotate: bool = False, stream: int = 0) -> None:
        self._run("tagc_cuda_fp4_decode_add", P(out), out.numel(), P(buf), buf.numel(), block,
                  self._fp4_flags(rotate, False), seed, None)

    def rht(self, dst: torch.Tensor, src: torch.Tensor, block: int, seed: int, *,
            inverse: bool = False, stream: int = 0) -> None:
        self._run("tagc_cuda_rht", P(dst), dst.numel(), P(src), src.numel(), block, seed,
                  int(bool(inverse)), None)

    def tls_encode(self, buf: torch.Tensor, residual: Optional[torch.Tensor],
                   grad: torch.Tensor, *, stream: int = 0) -> None:
        n = grad.numel()
        w = ws(self.lib.tagc_cuda_tls_encode_workspace_size(n))
        rd = F32 if residual is None else DT[residual.dtype]
        self._run("tagc_cuda_tls_encode", P(buf), buf.numel(), P(residual), rd, P(grad),
                  DT[grad.dtype], n, P(w), w.numel(), None)

    def tls_decode_add(self, out: torch.Tensor, buf: torch.Tensor, *, stream: int = 0,
                       status_out: Optional[torch.Tensor] = None) -> None:
        w = ws(self.lib.tagc_cuda_tls_decode_add_workspace_size())
        self._run("tagc_cuda_tls_decode_add", P(out), out.numel(), P(buf), buf.numel(),
                  P(status_out), P(w), w.numel(), None)
