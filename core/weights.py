"""Model weights over the bus, for runs without a shared disk.

The learner writes each version to its checkpoint directory as always, and with
`publish_weights = "store"` also puts the directory's files into the run's JetStream object
store (`subjects.weights_bucket(run)`), one object per file named `v<version>/<file>`;
`WeightsPublished.store` names the bucket. A sampler or evaluator on another host, where
the message's `path` does not exist, fetches the version into a local directory first
(`local_weights`). nats-py chunks each object and checks its SHA-256 digest on every
fetch (a mismatch raises); the directory appears only once every file arrived (written to
a temporary name, then renamed), so an interrupted fetch leaves nothing that looks
complete and the next message fetches again. The learner deletes a version's objects when
it prunes the version's checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from reinforge.core import subjects


class WeightsUnavailable(RuntimeError):
    """A version is neither on this host's disk nor in the object store."""


def object_name(version: int, file: str) -> str:
    return f"v{version}/{file}"


async def put_version(bus: Any, run: str, version: int, model_dir: str | Path) -> str:
    """Put every file of `model_dir` into the run's weights bucket; returns the bucket."""
    bucket = subjects.weights_bucket(run)
    store = await bus.object_store(bucket, create=True)
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            data = path.read_bytes()
            await bus.js_call(lambda p=path, d=data: store.put(object_name(version, p.name), d),
                              what=f"putting {path.name} of v{version} into {bucket}")
    return bucket


async def _object_names(bus: Any, store: Any, bucket: str) -> list[str]:
    """The names of the objects `bucket` holds (deleted ones left out)."""
    import nats.js.errors

    async def names() -> list[str]:
        try:
            return [o.name for o in await store.list() if not o.deleted]
        except nats.js.errors.NotFoundError:  # an empty bucket
            return []

    return await bus.js_call(names, what=f"listing {bucket}")


async def delete_versions(bus: Any, bucket: str, keep: set[int]) -> list[int]:
    """Delete the objects of every version not in `keep`; returns the versions deleted."""
    store = await bus.object_store(bucket)
    gone: set[int] = set()
    for name in await _object_names(bus, store, bucket):
        version = int(name.split("/", 1)[0][1:])
        if version not in keep:
            await bus.js_call(lambda n=name: store.delete(n), what=f"deleting {name}")
            gone.add(version)
    return sorted(gone)


async def fetch_version(bus: Any, bucket: str, version: int, dest: str | Path) -> Path:
    """Fetch version `version` from `bucket` into the directory `dest` (created whole, or
    not at all). Raises WeightsUnavailable when the bucket or the version is not there."""
    import nats.js.errors

    try:
        store = await bus.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        raise WeightsUnavailable(f"v{version}: no object store {bucket} (does the learner "
                                 "publish_weights = 'store'?)") from None

    prefix = f"v{version}/"
    wanted = [n for n in await _object_names(bus, store, bucket) if n.startswith(prefix)]
    if not wanted:
        raise WeightsUnavailable(f"object store {bucket} holds no files of v{version}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        for name in wanted:
            got = await bus.js_call(lambda n=name: store.get(n), what=f"fetching {name}")
            (tmp / name[len(prefix):]).write_bytes(got.data)  # digest checked by nats-py
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def fetched_weights_dir(owner: str) -> Path:
    """Where one process (a sampler's, an evaluator's) keeps the versions it fetched: a
    folder of its own under the temp dir, named but not made (`local_weights` makes it on a
    host that fetches; on the learner's host nothing is fetched). Its owner removes it on
    close; the random part keeps a later process with a reused pid off stale versions."""
    import uuid

    return Path(tempfile.gettempdir()) / f"rf-{owner}-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"


async def local_weights(bus: Any, path: str, store: str, version: int,
                        cache_dir: str | Path) -> str:
    """A local directory with the weights of `version`: `path` when it is on this host's
    disk, else the version fetched from `store` into `cache_dir` (once)."""
    if Path(path).is_dir() or not store:
        return path
    dest = Path(cache_dir) / f"v{version}"
    if not dest.is_dir():
        await fetch_version(bus, store, version, dest)
    return str(dest)
