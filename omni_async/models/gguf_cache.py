"""Converted GGUF weights cached on disk, so that only the first start pays for the conversion.

Reading a GGUF file's metadata with the ``gguf`` library and dequantising its tensors takes
~10 s for SmolLM2-135M on a small CPU; reading the result back takes a fraction of a second.
An entry holds the built decoder's own parameters (its merged projections, in the engine's
dtype) and rotary frequencies, the model config and the tokenizer (as ``tokenizers`` JSON),
in one file in the safetensors layout: an 8-byte header length, a JSON header, then the
tensor bytes. A start after the first maps the file (copy-on-write) and hands the views to
the model as its parameters; float32 tensors are stored in the smallest form that gives
back their exact values (:mod:`.gguf_compact`: a Q4_1 file's matrices as q4 blocks, a
fifth of float32's bytes) and turned back into float32 when read.

- **Where**: ``$OMNI_ASYNC_CACHE_DIR`` (``off`` or ``none`` turns caching off), else
  ``$XDG_CACHE_HOME/omni-async``, else ``~/.cache/omni-async``; entries under ``gguf/``
  (the C++ kernels are built into ``kernels/`` of the same folder).
- **Key**: the file's content (a SHA-256 of its bytes), the dtype, this module's
  :data:`CONVERSION_VERSION` and the ``gguf`` library's version; not its path, so every
  copy of one file (each clone's, each environment's) shares one entry. The digest is
  remembered per path with the file's size and modification time (``gguf/paths/``), so
  the bytes are hashed once per version of a path. When a path's content changes, the
  entries of its old content are removed when the new one is written, and so are the
  entries this module wrote before it keyed by content (by path, size and time).
- **Two processes at once**: the conversion runs under an exclusive lock file (``fcntl``;
  where there is none, both convert); the second process waits, then reads the first one's
  entry. An entry is written to a temporary file, flushed to disk and renamed into place,
  so a reader never sees a partial one.
- **Torn or damaged files**: the header records the data's length and a CRC-32 of the whole
  entry (the header's tensor table and metadata, then the data), checked on every read. Any
  failure to load an entry (damage, or an entry that no longer fits the decoder's parameters)
  is reported; under the lock the entry is removed (if it is still the one that failed) and
  converted again, so two processes never remove each other's good entry.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..kernels.cpu_build import user_cache_folder
from ..logs import log
from .config import ModelConfig
from .gguf_compact import compact, expand

# Bump when the conversion's output changes (names, unpermuting, tokenizer shape, layout).
CONVERSION_VERSION = 3  # 3: float32 tensors in their smallest exact form (gguf_compact)
CACHE_ENV = "OMNI_ASYNC_CACHE_DIR"
_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_STORED_CODES = {**_DTYPE_CODES, torch.uint8: "U8"}  # what an entry's tensors are stored as
_CODE_DTYPES = {code: dtype for dtype, code in _STORED_CODES.items()}
_MAX_HEADER = 256 << 20
_converting = threading.Event()


class CorruptCacheEntry(Exception):
    """An entry whose header, length or checksum does not hold up."""


@dataclasses.dataclass
class ConvertedGGUF:
    config: ModelConfig
    tokenizer: Any  # HFTokenizer | None
    tensors: list[tuple[str, torch.Tensor]]


def cache_root() -> Path | None:
    """The user's cache folder for omni-async (the kernels' too), or None when caching
    is turned off."""
    override = os.environ.get(CACHE_ENV)
    if override is not None and override.strip().lower() in ("off", "none", "0", ""):
        return None
    return Path(override).expanduser() if override else user_cache_folder()


def converting() -> bool:
    """Whether a conversion is running in this process (the CLI's ticker keeps quiet then)."""
    return _converting.is_set()


def entry_path(gguf_path: Path, dtype: torch.dtype, root: Path) -> Path:
    """The entry of this file's content in this dtype (see the module docstring for the key)."""
    resolved = gguf_path.resolve()
    digest = content_digest(resolved, root)
    try:
        import importlib.metadata

        gguf_version = importlib.metadata.version("gguf")
    except Exception:
        gguf_version = "?"
    key = json.dumps([digest, CONVERSION_VERSION, gguf_version, str(dtype)])
    return root / "gguf" / f"{_family_prefix(resolved.stem, digest, dtype)}.{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"


def _family_prefix(stem: str, digest: str, dtype: torch.dtype) -> str:
    """Entries that share this prefix hold one content in one dtype (conversion versions
    apart). ``c`` marks a content key: a path-keyed entry of before has 8 hex digits there."""
    return f"{stem}-c{digest[:16]}.{_DTYPE_CODES[dtype].lower()}"


def content_digest(resolved: Path, root: Path) -> str:
    """The SHA-256 of the file's bytes, remembered for this path at this size and
    modification time (``gguf/paths/``). A path whose content changed has the entries
    of its old content removed, and the path-keyed entries of before too."""
    st = resolved.stat()
    record = root / "gguf" / "paths" / hashlib.sha256(str(resolved).encode()).hexdigest()[:20]
    seen = _read_json(record)
    if seen.get("size") == st.st_size and seen.get("mtime_ns") == st.st_mtime_ns and len(str(seen.get("sha256", ""))) == 64:
        return str(seen["sha256"])
    sha = hashlib.sha256()
    with open(resolved, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    digest = sha.hexdigest()
    if seen.get("sha256") not in (None, digest):
        _unlink_all(root / "gguf", f"{glob.escape(resolved.stem)}-c{str(seen['sha256'])[:16]}.*")
    _unlink_all(root / "gguf", f"{glob.escape(resolved.stem)}-{hashlib.sha256(str(resolved).encode()).hexdigest()[:8]}.*")  # path-keyed, before
    _write_json(record, {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest})
    return digest


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Written to a temporary file and renamed into place; a folder that cannot be
    written only costs hashing the file again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("gguf_cache_write_failed", path=str(path), error=repr(exc))


def _unlink_all(folder: Path, pattern: str) -> None:
    for other in folder.glob(pattern):
        try:
            other.unlink()
        except OSError:
            pass


def load_converted(gguf_path: Path, dtype: torch.dtype, build: Callable[[Any], tuple[Any, ConvertedGGUF]], assemble: Callable[[ConvertedGGUF], Any]) -> Any:
    """``assemble(entry)`` of the cached entry of ``gguf_path`` in ``dtype``; on a miss
    ``build(progress)``'s model (its entry is then written). ``assemble`` raising
    :class:`CorruptCacheEntry` marks the entry as unusable. Caching that cannot happen
    (turned off, a folder that cannot be written) only costs the conversion."""
    root = cache_root()
    if root is None or dtype not in _DTYPE_CODES:
        return build(None)[0]
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = entry_path(gguf_path, dtype, root)
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("gguf_cache_unavailable", path=str(root), error=repr(exc))
        return build(None)[0]
    hit = _try_read(path, assemble)
    if hit is not None:
        return hit
    with _exclusive(path.with_suffix(".lock")):
        hit = _try_read(path, assemble, discard=True)  # another process may have written it meanwhile
        if hit is not None:
            return hit
        progress = _Progress(gguf_path, path)
        _converting.set()
        try:
            model, entry = build(progress)
        except BaseException:
            progress.close("failed")
            raise
        finally:
            _converting.clear()
        progress.close("converted")
        try:
            write_entry(path, entry, source=str(gguf_path.resolve()))
            _remove_stale(path)
        except OSError as exc:
            log.warning("gguf_cache_write_failed", path=str(path), error=repr(exc))
        return model


def _try_read(path: Path, assemble: Callable[[ConvertedGGUF], Any], *, discard: bool = False) -> Any:
    """The assembled entry, or None. Any exception while reading or assembling it counts
    as a damaged entry (a wrong shape surfaces as torch's RuntimeError, a wrong config as
    a TypeError ...). Only with ``discard`` (the caller holds the lock, so no other
    process is writing it) is the damaged entry removed: it is then converted again."""
    if not path.exists():
        return None
    try:
        return assemble(read_entry(path))
    except Exception as exc:
        if not discard:
            return None
        log.warning("gguf_cache_corrupt", path=str(path), error=str(exc))
        print(f"omni-async: cached weights {path} are damaged ({exc}); converting again", file=sys.stderr)
        try:
            path.unlink()
        except OSError:
            pass
        return None


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no POSIX locks: both convert, the rename keeps it safe
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale(path: Path) -> None:
    """Entries of the same content in the same dtype from other conversion versions."""
    prefix = path.name.rsplit(".", 2)[0]
    for other in path.parent.glob(f"{glob.escape(prefix)}.*.safetensors"):
        if other != path:
            _unlink_all(other.parent, glob.escape(other.name))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_entry(path: Path, converted: ConvertedGGUF, *, source: str) -> None:
    """Write to a temporary file next to ``path``, flush it to disk, rename it into place."""
    # Wider elements first, so that every tensor starts aligned to its element size.
    stored = compact((name, t.detach()) for name, t in converted.tensors)
    tensors = sorted(((name, t.contiguous()) for name, t in stored), key=lambda nt: -nt[1].element_size())
    header: dict[str, Any] = {}
    offset, crc = 0, 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _STORED_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        crc = zlib.crc32(_tensor_bytes(t), crc)
        offset += size
    meta = {
        "version": CONVERSION_VERSION,
        "source": source,
        "data_bytes": offset,
        "config": _config_to_json(converted.config),
        "tokenizer": _tokenizer_to_json(converted.tokenizer),
    }
    meta["crc32"] = _entry_crc(header, meta, crc)
    header["__metadata__"] = {"omni_async": json.dumps(meta)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            for _name, t in tensors:
                out.write(_tensor_bytes(t))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _entry_crc(tensors: dict[str, Any], meta: dict[str, Any], data_crc: int) -> int:
    """The entry's checksum: the tensor table and the metadata (without the checksum
    itself), canonically serialised, combined with the data's CRC-32."""
    fields = {k: v for k, v in meta.items() if k != "crc32"}
    head = json.dumps([tensors, fields], sort_keys=True, separators=(",", ":")).encode()
    return zlib.crc32(struct.pack("<I", data_crc), zlib.crc32(head))


def read_entry(path: Path) -> ConvertedGGUF:
    """An entry's tensors (views of a private memory map of the file), config and
    tokenizer; any mismatch of version, length or checksum raises :class:`CorruptCacheEntry`."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise CorruptCacheEntry("shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CorruptCacheEntry(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
            meta = json.loads(header.pop("__metadata__")["omni_async"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCacheEntry(f"unreadable header ({exc})") from None
        if meta.get("version") != CONVERSION_VERSION:
            raise CorruptCacheEntry(f"conversion version {meta.get('version')}, expected {CONVERSION_VERSION}")
        data_bytes = int(meta["data_bytes"])
        if size - 8 - n != data_bytes:
            raise CorruptCacheEntry(f"{size - 8 - n} data bytes, the header says {data_bytes}")
        # Copy-on-write: the tensors are writable without touching the file, and nothing
        # is copied until the loader copies them into the model.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    data = memoryview(mapped)[8 + n :]
    if _entry_crc(header, meta, zlib.crc32(data)) != meta.get("crc32"):
        raise CorruptCacheEntry("checksum mismatch")
    tensors = []
    for name, spec in header.items():
        dtype = _CODE_DTYPES[spec["dtype"]]
        start, end = spec["data_offsets"]
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=8 + n + start) if count else torch.empty(0, dtype=dtype)
        tensors.append((name, flat.reshape(spec["shape"])))
    data.release()
    try:
        tensors = expand(tensors)
    except (ValueError, RuntimeError) as exc:
        raise CorruptCacheEntry(f"unreadable compact tensors ({exc})") from None
    return ConvertedGGUF(_config_from_json(meta["config"]), _tokenizer_from_json(meta["tokenizer"]), tensors)


def _config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["rope_scaling"] = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    return out


def _config_from_json(raw: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})


def _tokenizer_to_json(tok: Any) -> dict[str, Any] | None:
    if tok is None:
        return None
    return {
        "json": tok.backend.to_str(),
        "eos_token_ids": list(tok.eos_token_ids),
        "vocab_size": tok.vocab_size,
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
    }


def _tokenizer_from_json(raw: dict[str, Any] | None) -> Any:
    if raw is None:
        return None
    from tokenizers import Tokenizer

    from ..text.tokenizer import HFTokenizer

    return HFTokenizer.from_object(
        Tokenizer.from_str(raw["json"]),
        eos_token_ids=tuple(raw["eos_token_ids"]),
        vocab_size=raw["vocab_size"],
        chat_template=raw["chat_template"],
        bos_token=raw["bos_token"],
        eos_token=raw["eos_token"],
    )


class _Progress:
    """Reports a conversion on stderr: a line when it starts and when it ends, and on a
    terminal the share of tensors converted, updated in place."""

    def __init__(self, source: Path, entry: Path) -> None:
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.shown = -1
        print(f"omni-async: converting {source.name} (first start only; cached in {entry.parent})", file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(1, total)
        if self.tty and pct != self.shown:
            self.shown = pct
            print(f"\romni-async: converting {pct:3d}% ({done}/{total} tensors)", end="", file=sys.stderr, flush=True)

    def close(self, outcome: str) -> None:
        lead = "\r" if self.tty else ""
        print(f"{lead}omni-async: {outcome} in {time.perf_counter() - self.start:.1f} s" + " " * 16, file=sys.stderr, flush=True)
