"""Weights over the bus: a version's files put into the run's object store come back whole
on a host without the checkpoint, pruned versions leave the store, and a missing version
is a clear error; a file that does not match its metadata is refused, and a fetch whose
server stops answering resumes where it was. Real nats-server."""

import json
import os
import signal
import time

import pytest
import trio

from reinforge.core import subjects
from reinforge.core.bus import open_bus
from reinforge.core.natsd import EmbeddedNats
from reinforge.core.weights import (
    FetchStats,
    WeightsCorrupt,
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

    stats = FetchStats()

    async def main():
        async with open_bus(creds) as bus:
            bucket = await put_version(bus, run_name, 1, v1)
            assert bucket == subjects.weights_bucket(run_name)
            await put_version(bus, run_name, 2, v2)
            # on this host the path exists: used as it is
            assert await local_weights(bus, str(v2), bucket, 2, elsewhere) == str(v2)
            # elsewhere it does not: fetched once into the cache
            got = await local_weights(bus, "/nowhere/v2", bucket, 2, elsewhere, stats)
            again = await local_weights(bus, "/nowhere/v2", bucket, 2, elsewhere, stats)
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
    # one fetch: both files checked, 1 chunk of config and 3 of the 300,000 bytes
    assert stats.figures() | {"weights_fetch_longest_s": 0.0} == {
        "weights_fetched": 1.0, "weights_files_checked": 2.0,
        "weights_fetched_bytes": float(300_000 + len('{"version": 2}')),
        "weights_fetched_chunks": 4.0, "weights_fetch_longest_s": 0.0}
    assert deleted == [1]
    assert not (tmp_path / "v1-again").exists()  # nothing half-made is left behind
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_version_the_store_lists_in_part_is_waited_for_then_refused(
        creds, run_name, tmp_path):
    """Seen from a host whose copy of the store is behind (after a partition heals), a
    version's listing may lack files the learner put: here one is deleted after the put, so
    the listing lacks it. The fetch reads the listing again for `wait_s`, then refuses the
    version (the next message or poll fetches it again) instead of making a directory
    without the file; a version put without its list of files (an interrupted put) is
    refused too. A file that shows up while the fetch waits is fetched with the rest."""
    from reinforge.core.weights import FILE_LIST, object_name

    v1 = checkpoint(tmp_path, 1)
    fetched = tmp_path / "fetched"

    async def put_back_once_listed(bus, store):
        while not any(fetched.glob(".v1-*")):  # the fetch is under way: its listing lacks
            await trio.sleep(0.01)
        await trio.sleep(0.3)
        config = (v1 / "config.json").read_bytes()
        await bus.js_call(lambda: store.put("v1/config.json", config), what="put")

    async def main():
        async with open_bus(creds) as bus:
            bucket = await put_version(bus, run_name, 1, v1)
            store = await bus.object_store(bucket)
            await bus.js_call(lambda: store.delete("v1/config.json"), what="delete")
            with pytest.raises(WeightsUnavailable, match=r"lists 1 of the 2 files of v1 "
                               r"\(missing: config.json\) after 0 s"):
                await fetch_version(bus, bucket, 1, fetched / "v1", wait_s=0)
            await put_version(bus, run_name, 2, checkpoint(tmp_path, 2))
            await bus.js_call(lambda: store.delete(object_name(2, FILE_LIST)), what="delete")
            with pytest.raises(WeightsUnavailable, match="holds 2 files of v2 but not their "
                               "list"):
                await fetch_version(bus, bucket, 2, fetched / "v2", wait_s=0)
            assert list(fetched.iterdir()) == []  # no half-made directory
            async with trio.open_nursery() as nursery:
                nursery.start_soon(put_back_once_listed, bus, store)
                return await fetch_version(bus, bucket, 1, fetched / "v1", wait_s=30)

    got = trio.run(main)
    assert got.files == 2
    assert sorted(p.name for p in fetched.iterdir()) == ["v1"]
    for name in ("config.json", "model.safetensors"):
        assert (fetched / "v1" / name).read_bytes() == (v1 / name).read_bytes()


def test_a_file_whose_digest_does_not_match_its_metadata_is_refused_and_leaves_nothing(
        creds, run_name, tmp_path):
    """The chunks are the real ones; the object's metadata is republished with the digest
    of other bytes, as a store damaged between put and get would answer."""
    import hashlib
    from base64 import urlsafe_b64encode

    from nats.js.object_store import OBJ_META_PRE_TEMPLATE

    v1 = checkpoint(tmp_path, 1)

    async def main():
        async with open_bus(creds) as bus:
            bucket = await put_version(bus, run_name, 1, v1)
            store = await bus.object_store(bucket)
            info = await bus.js_call(lambda: store.get_info("v1/model.safetensors"), what="info")
            wrong = urlsafe_b64encode(hashlib.sha256(b"other bytes").digest()).decode()
            meta = dict(info.as_dict(), digest=f"SHA-256={wrong}")
            name = urlsafe_b64encode(b"v1/model.safetensors").decode()
            subject = OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=name)
            js = bus._js  # a raw publish: nothing in reinforge writes metadata by hand
            await bus.aio(js.publish)(subject, json.dumps(meta).encode(),
                                      headers={"Nats-Rollup": "sub"})
            with pytest.raises(WeightsCorrupt, match="model.safetensors: fetched 300000 "
                               "bytes with SHA-256 .* the store's metadata says 300000"):
                await fetch_version(bus, bucket, 1, tmp_path / "fetched" / "v1")

    trio.run(main)
    assert list((tmp_path / "fetched").iterdir()) == []  # no half-made directory


def test_a_fetch_whose_server_stops_answering_resumes_at_its_chunk_when_it_answers(tmp_path):
    """A nats-server of its own, stopped (SIGSTOP) for 4 s in the middle of a fetch of a
    32 MiB file: the fetch waits, then goes on from the chunk it was waiting for; it reads
    each of the file's 256 chunks once, and the file is whole and checked."""
    server = EmbeddedNats(data_dir=tmp_path / "nats")
    server.start()
    model = tmp_path / "learner" / "v1"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(32 << 20))
    paused = {}

    async def pause_mid_fetch(dest):
        while not any(dest.parent.glob(".v1-*/model.safetensors")):
            await trio.sleep(0.01)
        part = next(dest.parent.glob(".v1-*/model.safetensors"))
        while part.stat().st_size < 4 << 20:  # a few chunks in
            await trio.sleep(0.01)
        os.kill(server.proc.pid, signal.SIGSTOP)
        paused["at_bytes"] = part.stat().st_size
        await trio.to_thread.run_sync(time.sleep, 4.0)  # real time: the server is stopped
        paused["resumed_at_bytes"] = part.stat().st_size
        os.kill(server.proc.pid, signal.SIGCONT)

    async def main():
        async with open_bus(server.credentials) as bus:
            await put_version(bus, "resume", 1, model)
            dest = tmp_path / "sampler" / "v1"
            dest.parent.mkdir()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pause_mid_fetch, dest)
                fetched = await fetch_version(bus, subjects.weights_bucket("resume"), 1, dest)
            return fetched

    try:
        fetched = trio.run(main)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
    # it did wait: at most the one chunk already on its way came in while the server slept
    assert 0 <= paused["resumed_at_bytes"] - paused["at_bytes"] <= 128 << 10
    assert paused["resumed_at_bytes"] < 32 << 20
    assert fetched.chunks == 256 and fetched.bytes == 32 << 20 and fetched.seconds > 4.0
    assert (fetched.path / "model.safetensors").read_bytes() == \
        (model / "model.safetensors").read_bytes()


def test_a_version_pruned_in_the_middle_of_its_fetch_is_unavailable_and_leaves_nothing(
        creds, run_name, tmp_path):
    """The learner may prune a version while a slow host still fetches it: the fetch ends
    with WeightsUnavailable (a newer version is out), not with the store's "no message"."""
    model = tmp_path / "learner" / "v1"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(os.urandom(32 << 20))
    dest = tmp_path / "sampler" / "v1"
    dest.parent.mkdir()
    seen = {}

    async def prune_mid_fetch(bus, bucket):
        while not any(dest.parent.glob(".v1-*/model.safetensors")):
            await trio.sleep(0.001)
        part = next(dest.parent.glob(".v1-*/model.safetensors"))
        while part.stat().st_size < 1 << 20:
            await trio.sleep(0.001)
        seen["pruned_at_bytes"] = part.stat().st_size
        seen["deleted"] = await delete_versions(bus, bucket, keep=set())

    async def main():
        async with open_bus(creds) as bus:
            bucket = await put_version(bus, run_name, 1, model)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(prune_mid_fetch, bus, bucket)
                with pytest.raises(WeightsUnavailable, match=r"v1/model.safetensors left .* "
                                   r"while it was fetched .*the learner pruned it"):
                    await fetch_version(bus, bucket, 1, dest)

    trio.run(main)
    assert seen["deleted"] == [1] and seen["pruned_at_bytes"] < 32 << 20
    assert list(dest.parent.iterdir()) == []  # no half-made directory

