"""Weights over the bus: a version's files put into the run's object store come back whole
on a host without the checkpoint, pruned versions leave the store, and a missing version
is a clear error. Real nats-server."""

import os

import pytest
import trio

from reinforge.core import subjects
from reinforge.core.bus import open_bus
from reinforge.core.weights import (
    WeightsUnavailable,
    delete_versions,
    fetch_version,
    local_weights,
    put_version,
)

pytestmark = pytest.mark.nats


def checkpoint(root, version: int):
    d = root / f"v{version}"
    d.mkdir()
    (d / "config.json").write_text(f'{{"version": {version}}}')
    (d / "model.safetensors").write_bytes(os.urandom(300_000))  # several 128 KiB chunks
    return d


def test_a_version_travels_through_the_object_store_and_pruned_ones_leave_it(
        creds, run_name, tmp_path):
    learner = tmp_path / "learner"
    learner.mkdir()
    v1, v2 = checkpoint(learner, 1), checkpoint(learner, 2)
    elsewhere = tmp_path / "sampler-host"

    async def main():
        async with open_bus(creds) as bus:
            bucket = await put_version(bus, run_name, 1, v1)
            assert bucket == subjects.weights_bucket(run_name)
            await put_version(bus, run_name, 2, v2)
            # on this host the path exists: used as it is
            assert await local_weights(bus, str(v2), bucket, 2, elsewhere) == str(v2)
            # elsewhere it does not: fetched once into the cache
            got = await local_weights(bus, "/nowhere/v2", bucket, 2, elsewhere)
            again = await local_weights(bus, "/nowhere/v2", bucket, 2, elsewhere)
            deleted = await delete_versions(bus, bucket, keep={2})
            with pytest.raises(WeightsUnavailable, match="holds no files of v1"):
                await fetch_version(bus, bucket, 1, tmp_path / "v1-again")
            with pytest.raises(WeightsUnavailable, match="no object store nope"):
                await fetch_version(bus, "nope", 1, tmp_path / "v1-again")
            return got, again, deleted

    got, again, deleted = trio.run(main)
    assert got == again == str(elsewhere / "v2")
    assert sorted(p.name for p in (elsewhere / "v2").iterdir()) == [
        "config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (elsewhere / "v2" / name).read_bytes() == (v2 / name).read_bytes()
    assert deleted == [1]
    assert not (tmp_path / "v1-again").exists()  # nothing half-made is left behind
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
