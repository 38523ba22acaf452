"""Checksums of checkpoint files: computed while the bytes are written, committed in ``commit.json``,
verified before anything is loaded.

What is hashed, and where (one pass over the bytes, never a re-read):

- DCP's files (``__R_I.distcp`` of every rank, the coordinator's ``.metadata``): :class:`HashingWriter` is
  DCP's ``FileSystemWriter`` with a file system whose streams update a hash with every ``write()`` call
  (``torch.save`` writes a tensor's storage in one call, so hashing adds one pass over memory that is
  already in cache). Each rank's digests travel to the coordinator *inside DCP's own gather of write
  results* (an extra entry in the list ``write_data`` returns; :meth:`HashingWriter.finish` takes them out
  again before DCP builds ``.metadata``), so checksums cost no extra collective, sync or async.
- the files paratrain writes itself (``rng/rank_R.pt`` on every rank, ``train_state.json`` on rank 0):
  serialized to memory, hashed, written (:func:`write_file_hashed`); their digests are handed to the
  rank's writer and travel the same way.

The coordinator (rank 0) therefore knows ``{file: (size, digest)}`` for every file of the checkpoint when
DCP's save returns, and writes them into ``commit.json`` before the rename that commits the directory.

Algorithm (:func:`default_algorithm`): XXH3-128 from the ``xxhash`` package when it is installed, else
CRC-32 (``zlib.crc32``, standard library). Both detect corruption; neither authenticates (whoever can
rewrite a shard can rewrite ``commit.json``). On a small CPU host one save of 120 MiB cost 0.155 s
of CPU unhashed, 0.16-0.18 s with XXH3-128, 0.20-0.21 s with CRC-32 and 0.37-0.42 s with BLAKE2b
(``hashlib.blake2b``), whose 0.6 GB/s is slower than the disk. The manifest records the algorithm, rank 0
chooses it for every rank, and all three can be verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import os
import threading
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

DEFAULT_ALGORITHM = "crc32"
"""Always available (standard library); what files written outside a manager are hashed with."""
COMMIT_FILE = "commit.json"
MANIFEST_FORMAT = 2
"""1: sizes only (paratrain before checksums; still loaded, verified by size). 2: sizes and digests."""


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Crc32:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)  # releases the GIL for buffers over 5 KiB

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(algorithm: str) -> _Hasher:
    """A fresh incremental hasher; ``ValueError`` for an algorithm this installation cannot compute."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    if algorithm == "xxh3-128":
        try:
            import xxhash  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError("xxh3-128 needs the xxhash package (pip install xxhash)") from None
        return xxhash.xxh3_128()  # type: ignore[no-any-return]
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: crc32, blake2b-128, xxh3-128)")


def default_algorithm() -> str:
    """``xxh3-128`` when the ``xxhash`` package is importable (several times faster), else ``crc32``."""
    return "xxh3-128" if importlib.util.find_spec("xxhash") is not None else "crc32"


@dataclasses.dataclass(frozen=True)
class FileDigest:
    size: int
    digest: str


# ---- writing ------------------------------------------------------------------------------------------------
def write_file_hashed(path: Path, data: bytes | bytearray | memoryview, algorithm: str) -> FileDigest:
    """Write ``data`` to ``path`` (fsynced) and return its size and digest, computed from the same buffer."""
    h = new_hasher(algorithm)
    h.update(data)
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise _with_filename(e, path) from None
    return FileDigest(len(memoryview(data)), h.hexdigest())


def _with_filename(e: OSError, path: str | os.PathLike[str]) -> OSError:
    """``e`` naming ``path`` (a failed ``write``/``fsync`` on an open file carries no file name)."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))


class _HashingStream(io.RawIOBase):
    """A write-only view of an open file that hashes every buffer handed to ``write``."""

    def __init__(self, raw: Any, hasher: _Hasher, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self._raw = raw
        self._hasher = hasher
        self._path = path
        self.size = 0
        self.sequential = True
        """False once someone seeks: the running hash no longer describes the file."""
        self.error: OSError | None = None
        """The first failed write. torch's zip writer turns it into "RuntimeError: unexpected pos 704 vs
        598"; :meth:`_HashingFileSystem.create_stream` raises this one instead (a full disk must say so)."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            n = self._raw.write(b)
        except OSError as e:
            self.error = self.error or _with_filename(e, self._path)
            raise self.error from None
        view = memoryview(b)
        if n is not None and n != view.nbytes:  # a short write: hash exactly what reached the file
            view = view.cast("B")[:n]
        self._hasher.update(view)
        self.size += view.nbytes
        return n if n is not None else view.nbytes

    def tell(self) -> int:
        return int(self._raw.tell())

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = int(self._raw.seek(offset, whence))
        if pos != self.size:
            self.sequential = False
        return pos

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            self._raw.flush()
        super().close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system; streams opened for writing record ``(size, digest)`` under their name."""

    def __init__(self, root: Path, algorithm: str) -> None:
        super().__init__()
        self.root = root
        self.algorithm = algorithm
        self.digests: dict[str, FileDigest] = {}
        self._lock = threading.Lock()  # DCP may write with several threads (thread_count > 1)

    def _rel(self, path: str | os.PathLike[str]) -> str:
        return Path(path).relative_to(self.root).as_posix()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as reader:
                yield reader
            return
        stream: _HashingStream | None = None
        try:
            with open(path, mode) as raw:
                stream = _HashingStream(raw, new_hasher(self.algorithm), path)
                yield stream  # DCP writes, flushes and fsyncs inside this block
                stream.close()
        except Exception as e:
            if stream is not None and stream.error is not None:
                raise stream.error from None
            if isinstance(e, OSError):
                raise _with_filename(e, path) from None
            raise
        assert stream is not None
        digest = stream._hasher.hexdigest()
        if not stream.sequential:  # not the case for torch 2.13's writer; never store a wrong digest
            digest = hash_file(Path(path), self.algorithm).digest
        with self._lock:
            self.digests[self._rel(path)] = FileDigest(stream.size, digest)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # DCP writes ``.metadata.tmp`` and renames it
        with self._lock:
            moved = self.digests.pop(self._rel(path), None)
            if moved is not None:
                self.digests[self._rel(new_path)] = moved


@dataclasses.dataclass
class _DigestReport:
    """One rank's ``{file: FileDigest}``, appended to the write results DCP gathers on the coordinator."""

    rank: int
    digests: dict[str, FileDigest]


class HashingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that hashes every file while writing it (see module docstring).

    ``extra`` holds this rank's digests of files written outside DCP (RNG state, training state).
    ``pending_error``, when set before the save, is raised by :meth:`write_data`: DCP's gather then makes
    every rank's save fail together (used for an error in writing those files, e.g. a full disk).
    After the save, the coordinator's :attr:`all_digests` has every file of the checkpoint.
    Subclass it to inject faults (override ``write_data``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int = 0,
        extra: dict[str, FileDigest] | None = None,
        algorithm: str = DEFAULT_ALGORITHM,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self.algorithm = algorithm
        self.hashing_fs = _HashingFileSystem(Path(self.path), algorithm)
        self.fs = self.hashing_fs
        self.hash_rank = rank
        self.extra: dict[str, FileDigest] = dict(extra or {})
        self.pending_error: BaseException | None = None
        self.all_digests: dict[str, FileDigest] | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self.hashing_fs.root = Path(self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.pending_error is not None:
            raise self.pending_error
        fut = super().write_data(plan, planner)
        fut.wait()
        report = _DigestReport(self.hash_rank, {**self.extra, **self.hashing_fs.digests})
        out: Future[list[WriteResult]] = Future()
        out.set_result([*fut.value(), report])  # type: ignore[list-item]
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests: dict[str, FileDigest] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([r for r in rank_results if isinstance(r, WriteResult)])
            for r in rank_results:
                if isinstance(r, _DigestReport):
                    digests.update(r.digests)
        super().finish(metadata, plain)  # writes .metadata through the hashing file system
        digests.update(self.hashing_fs.digests)
        self.all_digests = digests


# ---- reading and verifying ----------------------------------------------------------------------------------
_CHUNK = 8 << 20


def hash_file(path: Path, algorithm: str) -> FileDigest:
    """Size and digest of a file, read once in 8 MiB chunks into one reused buffer."""
    h = new_hasher(algorithm)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return FileDigest(size, h.hexdigest())


class ManifestError(ValueError):
    """``commit.json`` is not a manifest paratrain wrote."""


@dataclasses.dataclass
class Manifest:
    files: dict[str, int]
    """Relative path -> size in bytes, for every file of the checkpoint except ``commit.json``."""
    digests: dict[str, str] | None
    """Relative path -> hex digest; ``None`` for a checkpoint written before checksums (format 1)."""
    algorithm: str | None


def manifest_json(digests: dict[str, FileDigest], algorithm: str, committed_at: float) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "files": {k: d.size for k, d in sorted(digests.items())},
        "checksums": {k: d.digest for k, d in sorted(digests.items())},
        "checksum_algorithm": algorithm,
        "committed_at": committed_at,
    }


def _check_rel(rel: Any) -> str:
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"lists a file name that is not a string: {rel!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or "\\" in rel or rel == COMMIT_FILE:
        raise ManifestError(f"lists {rel!r}, which is not a file inside the checkpoint directory")
    return rel


def parse_manifest(obj: Any) -> Manifest:
    """Validate the decoded JSON of ``commit.json``; :class:`ManifestError` says what is wrong."""
    if not isinstance(obj, dict):
        raise ManifestError(f"holds a JSON {type(obj).__name__}, not an object")
    files = obj.get("files")
    if not isinstance(files, dict) or not files:
        raise ManifestError("has no 'files' object")
    sizes: dict[str, int] = {}
    for rel, size in files.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ManifestError(f"records {size!r} as the size of {rel!r}")
        sizes[_check_rel(rel)] = size
    fmt = obj.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise ManifestError(f"records {fmt!r} as its format (an integer >= 1)")
    if fmt > MANIFEST_FORMAT:
        raise ManifestError(
            f"has format {fmt}, newer than this paratrain ({MANIFEST_FORMAT}): upgrade paratrain to load it"
        )
    if "checksums" not in obj:
        if fmt >= 2:  # the checksums were removed: sizes alone would pass a same-size corruption
            raise ManifestError(f"declares format {fmt} but lists no checksums")
        return Manifest(sizes, None, None)
    sums, algorithm = obj.get("checksums"), obj.get("checksum_algorithm")
    if not isinstance(algorithm, str):
        raise ManifestError("has checksums but no 'checksum_algorithm'")
    if not isinstance(sums, dict) or set(sums) != set(sizes):
        raise ManifestError("does not have one checksum per file")
    if not all(isinstance(v, str) and v for v in sums.values()):
        raise ManifestError("holds a checksum that is not a string")
    return Manifest(sizes, dict(sums), algorithm)


def share(files: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` hashes when ``world_size`` ranks verify together: largest first onto the least
    loaded rank, so every rank reads about the same number of bytes (deterministic on every rank)."""
    loads = [0] * world_size
    mine = []
    for rel, size in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        loads[r] += size
        if r == rank:
            mine.append(rel)
    return mine


def verify_digests(step_dir: Path, manifest: Manifest, only: Iterable[str] | None = None) -> list[str]:
    """Hash the listed files (``only``: a subset) and name every one whose content changed."""
    if manifest.digests is None or manifest.algorithm is None:
        return []
    problems = []
    for rel in sorted(manifest.files) if only is None else only:
        try:
            got = hash_file(step_dir / rel, manifest.algorithm)
        except ValueError as e:
            return [f"cannot verify its checksums: {e}"]
        except OSError as e:
            problems.append(f"{rel} cannot be read ({e.strerror})")
            continue
        if got.digest != manifest.digests[rel]:
            problems.append(
                f"{rel} does not match its checksum ({manifest.algorithm} {got.digest}, "
                f"{manifest.digests[rel]} when written): corrupted or modified after the save"
            )
    return problems
