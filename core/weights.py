"""Model weights over the bus, for runs without a shared disk.

The learner writes each version to its checkpoint directory as always, and with
`publish_weights = "store"` also puts the directory's files into the run's JetStream object
store (`subjects.weights_bucket(run)`), one object per file named `v<version>/<file>`;
`WeightsPublished.store` names the bucket, which keeps as many copies as the run's stream
(three in a cluster: a version outlives the loss of one node). A sampler or evaluator on
another host, where the message's `path` does not exist, fetches the version into a local
directory first (`local_weights`).

A fetch reads each file's chunks (nats-py puts 128 KiB each) one request at a time, by
stream sequence, straight into the file: its cost is linear in the size (nats-py's own
`get` appends to one bytes object, quadratic for a real model's gigabytes) and a cut-off
host resumes at the chunk it was waiting for once the cluster answers again. Every file's
size and SHA-256 digest are checked against the object's metadata on every fetch (a
mismatch raises `WeightsCorrupt`). A version's last object is the list of its files
(`FILE_LIST`): a fetch takes a version as whole only when it lists them all, since the
store's listing seen from one host may lack files another host already put (its replica
behind the leader's after a partition heals). The directory appears only once every file arrived and
was checked (written under a temporary name, then renamed), so an interrupted fetch leaves
nothing that looks complete and the next message fetches again. The learner deletes a
version's objects when it prunes the version's checkpoint.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from reinforge.core import subjects


CHUNK_DEADLINE_S = 600.0
"""How long a fetch waits for the cluster to answer for one chunk (a host cut off, a leader
election) before it gives up; the next weights message or poll starts it again."""


FILE_LIST = ".files.json"
"""The object, put after a version's files, that names them: `{"files": [name, ...]}`."""


LISTING_WAIT_S = 30.0
"""How long a fetch reads a version's listing again while it lacks files its list names."""


class WeightsUnavailable(RuntimeError):
    """A version is neither on this host's disk nor in the object store."""


class WeightsCorrupt(RuntimeError):
    """A fetched file is not what the object store's metadata says (size or SHA-256)."""


@dataclass(frozen=True)
class Fetched:
    """What one fetch moved: every file's size and digest were checked."""

    path: Path
    files: int
    bytes: int
    chunks: int
    seconds: float


def object_name(version: int, file: str) -> str:
    return f"v{version}/{file}"


async def put_version(bus: Any, run: str, version: int, model_dir: str | Path) -> str:
    """Put every file of `model_dir` into the run's weights bucket; returns the bucket."""
    bucket = subjects.weights_bucket(run)
    replicas = await bus.stream_replicas(subjects.stream_name(run))
    store = await bus.object_store(bucket, create=True, replicas=replicas)
    files = [p for p in sorted(Path(model_dir).iterdir()) if p.is_file()]
    listed = json.dumps({"files": [p.name for p in files]}).encode()
    for name, read in [*((p.name, p.read_bytes) for p in files), (FILE_LIST, lambda: listed)]:
        data = read()
        await bus.js_call(lambda n=name, d=data: store.put(object_name(version, n), d),
                          what=f"putting {name} of v{version} into {bucket}")
    return bucket


async def delete_versions(bus: Any, bucket: str, keep: set[int]) -> list[int]:
    """Delete the objects of every version not in `keep`; returns the versions deleted. An
    object already gone is no error (a delete retried after a lost reply, a learner that
    restarted mid-prune)."""
    import nats.js.errors

    store = await bus.object_store(bucket)

    async def delete(name: str) -> None:
        try:
            await store.delete(name)
        except nats.js.errors.ObjectNotFoundError:
            pass

    gone: set[int] = set()
    for name in [i.name for i in await _object_infos(bus, store, bucket)]:
        version = int(name.split("/", 1)[0][1:])
        if version not in keep:
            await bus.js_call(lambda n=name: delete(n), what=f"deleting {name}")
            gone.add(version)
    return sorted(gone)


async def fetch_version(bus: Any, bucket: str, version: int, dest: str | Path, *,
                        wait_s: float = LISTING_WAIT_S) -> Fetched:
    """Fetch version `version` from `bucket` into the directory `dest` (created whole, or
    not at all). Raises WeightsUnavailable when the bucket or the version is not there, or
    the store lists it in part for longer than `wait_s`; WeightsCorrupt when a file does
    not match its metadata."""
    import nats.js.errors

    try:
        store = await bus.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        raise WeightsUnavailable(f"v{version}: no object store {bucket} (does the learner "
                                 "publish_weights = 'store'?)") from None

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    started, size, chunks = time.monotonic(), 0, 0
    try:
        infos, names = await _whole_version(bus, store, bucket, version, tmp, wait_s)
        for name in names:
            n = await _fetch_object(bus, bucket, infos[name], tmp / name)
            size, chunks = size + infos[name].size, chunks + n
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Fetched(path=dest, files=len(names), bytes=size, chunks=chunks,
                   seconds=time.monotonic() - started)


async def _whole_version(bus: Any, store: Any, bucket: str, version: int, tmp: Path,
                         wait_s: float) -> tuple[dict[str, Any], list[str]]:
    """The objects of `version` by file name, and the names of its files (its `FILE_LIST`,
    read through `tmp`), once the store lists every one; a listing that lacks some is read
    again for up to `wait_s` (a replica catching up takes seconds)."""
    prefix = f"v{version}/"
    deadline = time.monotonic() + wait_s
    while True:
        infos = {i.name[len(prefix):]: i for i in await _object_infos(bus, store, bucket)
                 if i.name.startswith(prefix)}
        if not infos:
            raise WeightsUnavailable(f"object store {bucket} holds no files of v{version}")
        if FILE_LIST in infos:
            await _fetch_object(bus, bucket, infos[FILE_LIST], tmp / FILE_LIST)
            names = json.loads((tmp / FILE_LIST).read_bytes())["files"]
            (tmp / FILE_LIST).unlink()
            if not (missing := [n for n in names if n not in infos]):
                return infos, names
            problem = (f"lists {len(infos) - 1} of the {len(names)} files of v{version} "
                       f"(missing: {', '.join(missing)})")
        else:
            problem = f"holds {len(infos)} files of v{version} but not their list ({FILE_LIST})"
        if time.monotonic() >= deadline:
            raise WeightsUnavailable(
                f"object store {bucket} {problem} after {wait_s:.0f} s: this host's copy of "
                "the store is behind the learner's, or the version is being put or pruned")
        await trio.sleep(min(1.0, wait_s / 4))


async def _object_infos(bus: Any, store: Any, bucket: str) -> list[Any]:
    """The metadata of the objects `bucket` holds (deleted ones left out)."""
    import nats.js.errors

    async def infos() -> list[Any]:
        try:
            return [o for o in await store.list() if not o.deleted]
        except nats.js.errors.NotFoundError:  # an empty bucket
            return []

    return await bus.js_call(infos, what=f"listing {bucket}")


async def _fetch_object(bus: Any, bucket: str, info: Any, path: Path) -> int:
    """Write the object `info` of `bucket` to `path`, chunk by chunk in stream order, and
    check its size and SHA-256 digest; returns the number of chunks. Raises
    WeightsUnavailable when the object is deleted meanwhile (the learner pruned it)."""
    import nats.js.errors
    from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

    stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=info.nuid)
    digest, size, seq, chunks = hashlib.sha256(), 0, 0, 0
    with open(path, "wb") as out:
        while size < (info.size or 0):
            try:
                seq, data = await bus.next_message(
                    stream, subject, seq + 1, deadline_s=CHUNK_DEADLINE_S,
                    what=f"fetching {info.name} ({size} of {info.size} bytes)")
            except nats.js.errors.NotFoundError:
                raise WeightsUnavailable(
                    f"{info.name} left {bucket} while it was fetched ({size} of {info.size} "
                    "bytes): the learner pruned it, a newer version is out") from None
            if not data:  # a chunk is never empty: the object changed under us
                break
            out.write(data)
            digest.update(data)
            size, chunks = size + len(data), chunks + 1
    want = base64.urlsafe_b64decode(_digest_b64(info.digest or ""))
    if size != info.size or digest.digest() != want:
        raise WeightsCorrupt(f"{bucket}/{info.name}: fetched {size} bytes with SHA-256 "
                             f"{digest.hexdigest()[:16]}..., the store's metadata says "
                             f"{info.size} bytes, {info.digest}")
    return chunks


def _digest_b64(digest: str) -> str:
    """The base64 part of an object's digest, "SHA-256=<base64url>" (either case)."""
    head, _, tail = digest.partition("=")
    if head.upper() != "SHA-256":
        raise WeightsCorrupt(f"unknown digest {digest!r} (not SHA-256)")
    return tail


class FetchStats:
    """What one process fetched from the store, for its figures: every fetched file's
    size and digest were checked (`files_checked`), so that count is the fetched files."""

    def __init__(self) -> None:
        self.versions = self.files_checked = self.bytes = self.chunks = 0
        self.longest_s = 0.0

    def record(self, f: Fetched) -> None:
        self.versions += 1
        self.files_checked += f.files
        self.bytes += f.bytes
        self.chunks += f.chunks
        self.longest_s = max(self.longest_s, f.seconds)

    def figures(self) -> dict[str, float]:
        return {"weights_fetched": float(self.versions),
                "weights_files_checked": float(self.files_checked),
                "weights_fetched_bytes": float(self.bytes),
                "weights_fetched_chunks": float(self.chunks),
                "weights_fetch_longest_s": self.longest_s}


def fetched_weights_dir(owner: str) -> Path:
    """Where one process (a sampler's, an evaluator's) keeps the versions it fetched: a
    folder of its own under the temp dir, named but not made (`local_weights` makes it on a
    host that fetches; on the learner's host nothing is fetched). Its owner removes it on
    close; the random part keeps a later process with a reused pid off stale versions."""
    import uuid

    return Path(tempfile.gettempdir()) / f"rf-{owner}-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def local_weights(bus: Any, path: str, store: str, version: int,
                        cache_dir: str | Path, stats: FetchStats | None = None) -> str:
    """A local directory with the weights of `version`: `path` when it is on this host's
    disk, else the version fetched from `store` into `cache_dir` (once; counted in
    `stats`)."""
    if Path(path).is_dir() or not store:
        return path
    dest = Path(cache_dir) / f"v{version}"
    if not dest.is_dir():
        fetched = await fetch_version(bus, store, version, dest)
        if stats is not None:
            stats.record(fetched)
    return str(dest)
