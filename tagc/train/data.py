"""Token data for scripts/train_gpt2.py: sources, tokenizer, on-disk cache, batches.

``python -m tagc.train.data --data ...`` prepares the token cache ahead of training.

Sources (``--data``):
  * ``stdlib`` (default, offline): the ``.py`` files of the running interpreter's standard
    library, in sorted order; a file goes to validation when ``crc32(relative path) % 100``
    is below ``val_percent``, so the split does not depend on which other files exist.
  * a folder path: every regular file below it (sorted), read as UTF-8 text.
  * ``openwebtext``: the HF ``datasets`` copy of OpenWebText, only if it is already in the
    local HF cache (nothing is downloaded here).

Tokenizer: GPT-2 BPE through ``tiktoken`` when its BPE files are already in tiktoken's
cache, otherwise byte-level (256 byte values + an end-of-text token). Tokens are written
once to ``<cache_dir>/<key>-{train,val}.bin`` (uint16 when the vocabulary fits, else
uint32), atomically, by rank 0 while the other ranks wait on a barrier; training reads them
through ``numpy.memmap``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Bumped whenever the on-disk format or the split rule changes, so stale caches are ignored.
CACHE_VERSION = 1

OPENWEBTEXT_HELP = (
    "--data openwebtext needs the HF `datasets` package and the 'openwebtext' dataset "
    "already in the local HF cache (this script never downloads). On a machine with "
    "internet access run:\n"
    "    pip install datasets\n"
    "    python -c \"import datasets; datasets.load_dataset('openwebtext', "
    "trust_remote_code=True)\"\n"
    "then copy ~/.cache/huggingface to this machine (or set HF_HOME), and run with "
    "HF_DATASETS_OFFLINE=1. Alternatively export the text to a folder of .txt files and "
    "pass --data /that/folder."
)


# --------------------------------------------------------------------------- tokenizers

@dataclass(frozen=True)
class Tokenizer:
    """A text-to-token-ids function and its vocabulary facts.

    Attributes:
        name: "gpt2" (tiktoken BPE) or "byte".
        vocab_size: number of distinct token ids the tokenizer can emit.
        eot: id of the end-of-text token placed between documents.
        encode: maps a string to a list of token ids (no special tokens added).
    """

    name: str
    vocab_size: int
    eot: int
    encode: Callable[[str], List[int]]

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned dtype that holds every id."""
        return np.dtype(np.uint16) if self.vocab_size <= 2**16 else np.dtype(np.uint32)


def _byte_encode(text: str) -> List[int]:
    return list(text.encode("utf-8", errors="replace"))


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: UTF-8 bytes 0..255, end-of-text = 256.

    Returns:
        The tokenizer (vocab_size 257; the model pads its embedding to a multiple of 64).
    """
    return Tokenizer(name="byte", vocab_size=257, eot=256, encode=_byte_encode)


def _tiktoken_gpt2_offline() -> Optional[Tokenizer]:
    """GPT-2 BPE from tiktoken if its files are cached locally, else None, without network.

    tiktoken fetches its BPE files at first use. We make its fetch function refuse any
    remote path for the duration of the call, so a missing cache fails at once instead of
    waiting on a network that is not there.
    """
    try:
        import tiktoken
        import tiktoken.load as tl
    except ImportError:
        logger.info("tiktoken is not installed")
        return None
    real_read_file = tl.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise FileNotFoundError(f"tiktoken BPE file not in cache: {blobpath}")
        return real_read_file(blobpath)

    tl.read_file = local_only
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as exc:  # any failure means "not available offline"
        logger.info("tiktoken GPT-2 BPE not available offline (%s)", exc)
        return None
    finally:
        tl.read_file = real_read_file

    def encode(text: str) -> List[int]:
        return enc.encode_ordinary(text)

    return Tokenizer(name="gpt2", vocab_size=enc.n_vocab, eot=enc.eot_token, encode=encode)


def get_tokenizer(kind: str = "auto") -> Tokenizer:
    """Pick the tokenizer.

    Args:
        kind: "auto" (GPT-2 BPE if available offline, else byte), "gpt2" (required), "byte".

    Returns:
        The tokenizer.

    Raises:
        RuntimeError: kind == "gpt2" and tiktoken's GPT-2 files are not available.
        ValueError: unknown kind.
    """
    if kind == "byte":
        return byte_tokenizer()
    if kind not in ("auto", "gpt2"):
        raise ValueError(f"tokenizer must be auto, gpt2 or byte, got {kind!r}")
    tok = _tiktoken_gpt2_offline()
    if tok is not None:
        return tok
    if kind == "gpt2":
        raise RuntimeError(
            "tokenizer=gpt2 requested but tiktoken's GPT-2 BPE files are not cached. Run "
            "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` once with internet "
            "access and copy the cache directory (TIKTOKEN_CACHE_DIR, default "
            f"{os.path.join(tempfile.gettempdir(), 'data-gym-cache')}) here.")
    return byte_tokenizer()


# --------------------------------------------------------------------------- sources

def _in_val(rel_path: str, val_percent: float) -> bool:
    return zlib.crc32(rel_path.encode("utf-8")) % 10000 < val_percent * 100


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, suffix: Optional[str]) -> List[str]:
    """Sorted relative paths of regular files under root.

    Args:
        root: folder to walk.
        suffix: keep only names ending with it (None keeps every file).

    Returns:
        POSIX-style relative paths, sorted, skipping site-packages, __pycache__ and dot-dirs.
    """
    out: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if d not in ("site-packages", "dist-packages", "__pycache__")
                       and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            full = Path(dirpath) / name
            if full.is_file():
                out.append(full.relative_to(root).as_posix())
    out.sort()
    return out


@dataclass
class Source:
    """Where the documents come from.

    Attributes:
        name: short name used in the cache key ("stdlib", "dir-<hash>", "openwebtext").
        fingerprint: string that changes whenever the documents may have changed.
        documents: callable yielding (split, text) pairs in a deterministic order.
    """

    name: str
    fingerprint: str
    documents: Callable[[], Iterator[Tuple[str, str]]]


def _folder_source(root: Path, suffix: Optional[str], name: str, val_percent: float) -> Source:
    files = list_files(root, suffix)
    if not files:
        raise FileNotFoundError(f"no {'*' + suffix if suffix else ''} files under {root}")
    h = hashlib.sha256()
    h.update(str(root.resolve()).encode())
    for rel in files:
        st = (root / rel).stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"val={val_percent}".encode())

    def documents() -> Iterator[Tuple[str, str]]:
        for rel in files:
            split = "val" if _in_val(rel, val_percent) else "train"
            text = (root / rel).read_bytes().decode("utf-8", errors="replace")
            yield split, text

    return Source(name=name, fingerprint=h.hexdigest(), documents=documents)


def _openwebtext_source(val_percent: float) -> Source:
    try:
        import datasets  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(OPENWEBTEXT_HELP) from exc
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        ds = datasets.load_dataset("openwebtext", split="train", trust_remote_code=True)
    except Exception as exc:
        raise RuntimeError(f"could not load openwebtext offline ({exc}).\n{OPENWEBTEXT_HELP}") \
            from exc

    def documents() -> Iterator[Tuple[str, str]]:
        for i, row in enumerate(ds):
            yield ("val" if _in_val(str(i), val_percent) else "train"), row["text"]

    return Source(name="openwebtext", fingerprint=f"owt-{len(ds)}-val={val_percent}",
                  documents=documents)


def get_source(data: str, val_percent: float = 5.0) -> Source:
    """Resolve the --data argument.

    Args:
        data: "stdlib", "openwebtext" or a folder path.
        val_percent: share of documents (by hash of their name) held out for validation.

    Returns:
        The source.

    Raises:
        FileNotFoundError: the folder does not exist or holds no files.
        RuntimeError: openwebtext is not available offline (message says how to prepare it).
    """
    if data == "stdlib":
        root = stdlib_root()
        src = _folder_source(root, ".py", "stdlib", val_percent)
        # The stdlib path already identifies the interpreter; add its version for safety.
        src.fingerprint = hashlib.sha256(
            (src.fingerprint + sys.version).encode()).hexdigest()
        return src
    if data == "openwebtext":
        return _openwebtext_source(val_percent)
    root = Path(data)
    if not root.is_dir():
        raise FileNotFoundError(f"--data {data!r}: not 'stdlib', 'openwebtext' or a folder")
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:10]
    return _folder_source(root, None, f"dir-{key}", val_percent)


# --------------------------------------------------------------------------- cache

def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cache_paths(cache_dir: Path, source: Source, tok: Tokenizer) -> dict:
    """Paths of the cached token files for (source, tokenizer)."""
    key = hashlib.sha256(
        f"v{CACHE_VERSION}|{source.fingerprint}|{tok.name}|{tok.vocab_size}".encode()
    ).hexdigest()[:16]
    stem = f"{source.name}-{tok.name}-{key}"
    return {"train": cache_dir / f"{stem}-train.bin", "val": cache_dir / f"{stem}-val.bin",
            "meta": cache_dir / f"{stem}-meta.json"}


def prepare(source: Source, tok: Tokenizer, cache_dir: Path) -> dict:
    """Tokenize the source into the cache unless it is already there.

    The meta file is written last, so its presence means both .bin files are complete;
    concurrent writers (say, two test runs) each write whole files and atomically rename.

    Args:
        source: documents to tokenize.
        tok: tokenizer.
        cache_dir: folder for the .bin/.json files (created if missing).

    Returns:
        The meta dict: paths, dtype, token counts, tokenizer name.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = cache_paths(cache_dir, source, tok)
    if paths["meta"].exists():
        meta = json.loads(paths["meta"].read_text())
        # the token files sit beside the meta file, wherever the run starts from
        meta.update(train=str(paths["train"]), val=str(paths["val"]))
        return meta
    logger.info("tokenizing %s with the %s tokenizer into %s", source.name, tok.name, cache_dir)
    chunks = {"train": [], "val": []}
    eot = np.array([tok.eot], dtype=tok.dtype)
    for split, text in source.documents():
        ids = (np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
               .astype(tok.dtype) if tok.name == "byte"
               else np.asarray(tok.encode(text), dtype=tok.dtype))
        chunks[split].append(ids)
        chunks[split].append(eot)
    counts = {}
    for split in ("train", "val"):
        if not chunks[split]:
            raise ValueError(f"data source {source.name} produced no {split} documents; "
                             "add files or change val_percent")
        arr = np.concatenate(chunks[split])
        counts[split] = int(arr.size)
        _atomic_write(paths[split], arr.tobytes())
    meta = {"version": CACHE_VERSION, "source": source.name, "tokenizer": tok.name,
            "vocab_size": tok.vocab_size, "eot": tok.eot, "dtype": tok.dtype.name,
            "tokens": counts, "train": str(paths["train"]), "val": str(paths["val"])}
    _atomic_write(paths["meta"], json.dumps(meta, indent=1).encode())
    return meta


def prepare_distributed(data: str, tokenizer: "str | Tokenizer", cache_dir: Path,
                        val_percent: float) -> Tuple[dict, Tokenizer]:
    """Local rank 0 of each node prepares the cache while the other ranks wait.

    Every node prepares for itself, so the cache can live on node-local disk; on a shared
    filesystem the atomic renames make concurrent preparation safe. A failure on any rank
    is raised on every rank (no rank is left waiting in a barrier).

    Args:
        data: --data value.
        tokenizer: "auto", "gpt2" or "byte", or a Tokenizer (e.g. a checkpoint's own).
        cache_dir: token cache folder.
        val_percent: validation share.

    Returns:
        (meta, tokenizer).
    """
    import torch.distributed as dist
    dist_on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if dist_on else 0
    preparer = int(os.environ.get("LOCAL_RANK", rank)) == 0
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(tokenizer)
    meta: Optional[dict] = None
    err: Optional[BaseException] = None
    if preparer:
        try:
            meta = prepare(get_source(data, val_percent), tok, cache_dir)
        except Exception as exc:
            err = exc
    if dist_on:
        failed = torch.tensor([1 if err is not None else 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            failed = failed.cuda()
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if err is not None:
            raise err
        if failed.item():
            raise RuntimeError("data preparation failed on another rank (see its log)")
        if meta is None:
            meta = prepare(get_source(data, val_percent), tok, cache_dir)  # reads the meta
    elif err is not None:
        raise err
    assert meta is not None
    return meta, tok


class TokenData:
    """Memory-mapped train/val token arrays and deterministic batch sampling.

    Batches are a pure function of (seed, split, step, micro step, rank), so a resumed run
    draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, meta: dict) -> None:
        self.meta = meta
        dtype = np.dtype(meta["dtype"])
        self.arrays = {s: np.memmap(meta[s], dtype=dtype, mode="r") for s in ("train", "val")}

    def get_batch(self, split: str, batch_size: int, block_size: int,
                  key: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sample a batch of (input, target) windows.

        Args:
            split: "train" or "val".
            batch_size: rows.
            block_size: tokens per row.
            key: integers seeding the draw (e.g. seed, step, micro step, rank).

        Returns:
            x, y: int64 tensors of shape (batch_size, block_size); y is x shifted by one.
        """
        data = self.arrays[split]
        if data.size <= block_size + 1:
            raise ValueError(f"{split} split has {data.size} tokens, fewer than "
                             f"block_size+1 = {block_size + 1}")
        rng = np.random.default_rng([int(k) for k in key])
        ix = rng.integers(0, data.size - block_size - 1, size=batch_size)
        x = np.stack([data[i:i + block_size].astype(np.int64) for i in ix])
        y = np.stack([data[i + 1:i + 1 + block_size].astype(np.int64) for i in ix])
        return torch.from_numpy(x), torch.from_numpy(y)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prepare the token cache ahead of training (e.g. once per node)."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="stdlib")
    p.add_argument("--tokenizer", default="auto", choices=["auto", "gpt2", "byte"])
    p.add_argument("--cache_dir", default="data_cache")
    p.add_argument("--val_percent", type=float, default=5.0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    meta, tok = prepare_distributed(a.data, a.tokenizer, Path(a.cache_dir), a.val_percent)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
