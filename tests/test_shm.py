"""The same-host transfer path (modalmesh.rpc.shm): probe, export, read, expiry, refusals."""

import asyncio
import collections
import os

import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import from_proto, to_payload, to_proto
from modalmesh.rpc.shm import (HEADER, SHM_DIR, SharedMemoryGone, ShmExporter, ShmProbe, ShmReader, read_tensor,
                                shm_available, sweep_orphans)


def objects(directory, prefix="modalmesh-emb-"):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))


def lease_word(directory, name):
    return int.from_bytes((directory / name).read_bytes()[:8], "little")


def returned_word(directory, name):
    return int.from_bytes((directory / name).read_bytes()[8:16], "little")


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (256, 48)), (torch.float32, (3, 5)),
                                         (torch.float16, (0, 8)), (torch.int64, (7,))])
def test_export_then_read_gives_the_same_tensor_and_hands_the_slab_back(tmp_path, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 100).to(dtype)
    exporter = ShmExporter(directory=tmp_path)
    message = exporter.export(*to_payload(x))
    ref = message.shared_memory
    assert message.data == b"" and message.HasField("shared_memory")
    assert ref.nbytes == x.numel() * x.element_size() and ref.offset == HEADER and ref.lease != 0
    assert objects(tmp_path) == [ref.name] and lease_word(tmp_path, ref.name) == ref.lease
    assert returned_word(tmp_path, ref.name) != ref.lease
    st = os.stat(tmp_path / ref.name)
    assert st.st_blocks * 512 >= st.st_size >= HEADER + ref.nbytes  # allocated up front: no SIGBUS later
    got = read_tensor(message, directory=tmp_path)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, x)
    assert returned_word(tmp_path, ref.name) == ref.lease  # handed back
    with pytest.raises(SharedMemoryGone):  # a second read of the same answer is refused
        read_tensor(message, directory=tmp_path)
    y = torch.full(shape, 3).to(dtype)
    again = exporter.export(*to_payload(y))
    assert again.shared_memory.name == ref.name and again.shared_memory.lease != ref.lease  # the slab is reused
    assert torch.equal(read_tensor(again, directory=tmp_path), y)
    exporter.close()
    assert objects(tmp_path) == []


def test_slabs_grow_by_size_class_and_stay_within_the_limit(tmp_path):
    exporter = ShmExporter(directory=tmp_path, max_bytes=4 << 20)
    small = [exporter.export(*to_payload(torch.zeros(1000))) for _ in range(2)]  # unreturned: two 1 MiB slabs
    assert len({m.shared_memory.name for m in small}) == 2 and exporter.slab_bytes == 2 << 20
    big = torch.arange((3 << 20) // 4, dtype=torch.float32)  # 3 MiB + header does not fit next to them
    assert exporter.export(*to_payload(big)) is None  # full: this answer goes as bytes
    read_tensor(small[0], directory=tmp_path)
    read_tensor(small[1], directory=tmp_path)
    moved = exporter.export(*to_payload(big))  # free slabs too small to use made room
    assert moved is not None and exporter.slab_bytes <= 4 << 20
    assert os.path.getsize(tmp_path / moved.shared_memory.name) >= HEADER + big.numel() * 4
    assert torch.equal(read_tensor(moved, directory=tmp_path), big)
    exporter.close()


def test_an_unreturned_slab_is_retired_after_the_ttl_and_its_late_reader_is_refused(tmp_path):
    patient = ShmExporter(directory=tmp_path, ttl_s=600)
    first = patient.export(*to_payload(torch.ones(4)))
    second = patient.export(*to_payload(torch.ones(4)))
    assert first.shared_memory.name != second.shared_memory.name  # still leased: a new slab
    patient.close()
    assert objects(tmp_path) == []
    hasty = ShmExporter(directory=tmp_path, ttl_s=0)
    early = hasty.export(*to_payload(torch.ones(4)))
    reader = ShmReader(tmp_path)
    stale = ShmReader(tmp_path)
    stale._map(early.shared_memory.name, HEADER + 16, "early")  # a reader that mapped it before
    late = hasty.export(*to_payload(torch.zeros(4)))
    # Never overwritten: the unreturned slab was unlinked and replaced.
    assert late.shared_memory.name != early.shared_memory.name
    assert objects(tmp_path) == [late.shared_memory.name]
    with pytest.raises(SharedMemoryGone, match="is gone"):
        reader.read(early)
    with pytest.raises(SharedMemoryGone, match="was retired"):
        stale.read(early)
    assert torch.equal(reader.read(late), torch.zeros(4))
    hasty.close()
    reader.close()
    stale.close()
    assert objects(tmp_path) == []


def test_a_probe_proves_a_shared_directory_and_nothing_else(tmp_path):
    elsewhere = tmp_path / "other-host"
    elsewhere.mkdir()
    probe = ShmProbe(directory=tmp_path)
    try:
        assert oct((tmp_path / probe.name).stat().st_mode & 0o777) == "0o600"
        assert ShmExporter(directory=tmp_path).peer_shares(probe.options())
        assert not ShmExporter(directory=elsewhere).peer_shares(probe.options())  # cannot see the probe
        wrong = pb.TransferOptions(shm_probe=probe.name, shm_nonce=bytes(16))
        assert not ShmExporter(directory=tmp_path).peer_shares(wrong)
        (tmp_path / "secret").write_bytes(probe.nonce)
        fifo = "modalmesh-probe-" + "0" * 32
        os.mkfifo(tmp_path / fifo)  # must not hang the encoder's event loop
        for name in ("../secret", "secret", f"{probe.name}/..", "", probe.name + "\n", fifo):
            assert not ShmExporter(directory=tmp_path).peer_shares(
                pb.TransferOptions(shm_probe=name, shm_nonce=probe.nonce))
    finally:
        probe.close()
    assert not (tmp_path / probe.name).exists()


def test_peer_shares_is_cached_per_probe(tmp_path):
    probe = ShmProbe(directory=tmp_path)
    exporter = ShmExporter(directory=tmp_path)
    assert exporter.peer_shares(probe.options())
    probe.close()  # answered from the cache, without opening the file again
    assert exporter.peer_shares(probe.options())
    assert not ShmExporter(directory=tmp_path).peer_shares(probe.options())


def test_read_refuses_malformed_refs(tmp_path):
    exporter = ShmExporter(directory=tmp_path)
    good = exporter.export(*to_payload(torch.arange(6, dtype=torch.float32)))
    ref = good.shared_memory
    (tmp_path / "passwd").write_bytes(bytes(1 << 20))

    def variant(**changes):
        fields = dict(name=ref.name, nbytes=ref.nbytes, offset=ref.offset, lease=ref.lease)
        shape = changes.pop("shape", [6])
        fields.update(changes)
        return pb.Tensor(dtype=pb.FLOAT32, shape=shape, shared_memory=pb.SharedMemoryRef(**fields))

    with pytest.raises(InvalidArgument, match="not one modalmesh writes"):
        read_tensor(variant(name="../passwd"), directory=tmp_path)
    with pytest.raises(InvalidArgument, match="holds 24 bytes but shape \\[5\\]"):
        read_tensor(variant(shape=[5]), directory=tmp_path)
    with pytest.raises(InvalidArgument, match="offset 0"):
        read_tensor(variant(offset=0), directory=tmp_path)  # would read the lease word as data
    with pytest.raises(InvalidArgument, match="lease 0"):
        read_tensor(variant(lease=0), directory=tmp_path)
    with pytest.raises(InvalidArgument, match="the ref needs"):
        read_tensor(variant(offset=1 << 21), directory=tmp_path)
    with pytest.raises(SharedMemoryGone, match="is gone"):
        read_tensor(variant(name="modalmesh-emb-" + "e" * 32), directory=tmp_path)
    os.mkfifo(tmp_path / ("modalmesh-emb-" + "f" * 32))  # opening a FIFO must not hang the reader
    with pytest.raises(PermissionError, match="not a regular file"):
        read_tensor(variant(name="modalmesh-emb-" + "f" * 32), directory=tmp_path)
    with pytest.raises(InvalidArgument, match="not one modalmesh writes"):
        read_tensor(variant(name=ref.name + "\n"), directory=tmp_path)
    assert returned_word(tmp_path, ref.name) != ref.lease  # none of that handed the slab back
    assert torch.equal(read_tensor(good, directory=tmp_path), torch.arange(6, dtype=torch.float32))
    exporter.close()


def test_the_codec_refuses_shared_memory_refs_where_none_was_offered():
    message = pb.Tensor(dtype=pb.FLOAT32, shape=[2],
                        shared_memory=pb.SharedMemoryRef(name="modalmesh-emb-" + "0" * 32, nbytes=8))
    with pytest.raises(InvalidArgument, match="items\\[0\\].embedding: a shared-memory reference is not accepted"):
        from_proto(message, name="items[0].embedding")


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_the_real_dev_shm_round_trip():
    probe = ShmProbe()
    exporter = ShmExporter()
    try:
        assert exporter.peer_shares(probe.options())
        x = torch.randn(64, 32).to(torch.bfloat16)
        message = exporter.export(*to_payload(x))
        assert lease_word(SHM_DIR, message.shared_memory.name) == message.shared_memory.lease
        assert torch.equal(read_tensor(message), x)
        assert returned_word(SHM_DIR, message.shared_memory.name) == message.shared_memory.lease
    finally:
        probe.close()
        exporter.close()
    assert not (SHM_DIR / message.shared_memory.name).exists()


# ---- the LLM's encoder pool against a real gRPC encoder ------------------------------------------
def _pool_round_trip(mode):
    from services.llm.encoders import EncoderPool
    from tests.helpers.echo_service import build

    async def body():
        server, servicer = build()
        exporter = ShmExporter()
        servicer.shared_memory = {"export": exporter, "stale": ("stale", exporter)}.get(mode, mode)
        port = await server.start()
        probe = ShmProbe()
        pool = EncoderPool(pb.IMAGE, f"127.0.0.1:{port}", probe=probe)
        x = torch.randn(5, 8)
        try:
            reply, tensor = await pool.encode_one(pb.EncodeItem(pcm=to_proto(x)), 3, timeout=30)
            if mode == "stale":  # the next item is offered shared memory again
                await pool.encode_one(pb.EncodeItem(pcm=to_proto(x)), 4, timeout=30)
            return x, reply, tensor, servicer.encode_calls, pool.probe
        finally:
            await pool.close()
            probe.close()
            exporter.close()
            for path in servicer.planted:
                os.unlink(path)
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(body(), timeout=60))


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_the_encoder_pool_reads_shared_memory_answers():
    x, reply, tensor, calls, probe = _pool_round_trip("export")
    assert reply.embeddings[0].embedding.HasField("shared_memory") and calls == 1
    assert torch.equal(tensor, x) and probe is not None


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_a_gone_shared_memory_answer_is_asked_again_as_bytes():
    x, reply, tensor, calls, probe = _pool_round_trip("gone")
    assert calls == 2 and probe is not None  # this item as bytes; the path stays on
    assert not reply.embeddings[0].embedding.HasField("shared_memory") and torch.equal(tensor, x)


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_an_unreadable_shared_memory_answer_turns_the_path_off_for_good():
    x, reply, tensor, calls, probe = _pool_round_trip("fifo")
    assert calls == 2 and probe is None  # asked again without the offer, and stops offering
    assert not reply.embeddings[0].embedding.HasField("shared_memory") and torch.equal(tensor, x)


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_a_stale_shared_memory_answer_is_asked_again_as_bytes_and_the_path_stays_on():
    x, reply, tensor, calls, probe = _pool_round_trip("stale")
    # Each item: the stale answer, then bytes. The second item was offered shared memory again (else 3 calls).
    assert calls == 4 and probe is not None
    assert not reply.embeddings[0].embedding.HasField("shared_memory") and torch.equal(tensor, x)


def test_a_reader_keeps_recent_slabs_mapped_within_its_limit(tmp_path, monkeypatch):
    import modalmesh.rpc.shm as shm

    opened = []
    real_open = shm._open_own_regular
    def counting(path, flags):  # the reader opens read-write (the exporters' orphan sweep read-only)
        if flags & os.O_RDWR:
            opened.append(path.name)
        return real_open(path, flags)

    monkeypatch.setattr(shm, "_open_own_regular", counting)
    exporter = ShmExporter(directory=tmp_path)
    reader = ShmReader(tmp_path, max_mapped_bytes=2 << 20)
    first = exporter.export(*to_payload(torch.ones(8)))
    assert torch.equal(reader.read(first), torch.ones(8))
    second = exporter.export(*to_payload(torch.full((8,), 2.0)))
    assert second.shared_memory.name == first.shared_memory.name  # handed back, so reused
    assert torch.equal(reader.read(second), torch.full((8,), 2.0))
    assert opened == [first.shared_memory.name]  # the second read used the mapping it kept
    others = [ShmExporter(directory=tmp_path) for _ in range(2)]  # two more 1 MiB slabs: the oldest ages out
    for i, other in enumerate(others):
        assert torch.equal(reader.read(other.export(*to_payload(torch.full((4,), float(i))))), torch.full((4,), float(i)))
    third = exporter.export(*to_payload(torch.ones(8)))
    assert torch.equal(reader.read(third), torch.ones(8))
    assert opened.count(first.shared_memory.name) == 2  # mapped again after it aged out
    for other in [*others, exporter]:
        other.close()
    reader.close()


def test_orphans_of_dead_processes_are_swept_and_live_objects_kept(tmp_path):
    live = ShmExporter(directory=tmp_path)
    kept = live.export(*to_payload(torch.ones(4))).shared_memory.name
    probe = ShmProbe(directory=tmp_path)
    dead = ["modalmesh-emb-" + "a" * 32, "modalmesh-probe-" + "b" * 32]  # nobody holds their flock
    for name in dead:
        (tmp_path / name).write_bytes(bytes(64))
    (tmp_path / "unrelated").write_bytes(b"x")
    assert sweep_orphans(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept, probe.name, "unrelated"])
    live.close()
    probe.close()


def test_a_full_dev_shm_means_bytes_not_a_crash(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    exporter = ShmExporter(directory=tmp_path)
    assert exporter.export(*to_payload(torch.ones(4))) is None
    assert objects(tmp_path) == [] and exporter.slab_bytes == 0


def test_concurrent_exports_and_reads_never_mix_up_contents(tmp_path):
    import concurrent.futures as cf

    exporter = ShmExporter(directory=tmp_path, ttl_s=0.0005, max_bytes=8 << 20)  # retire eagerly
    reader = ShmReader(tmp_path, max_mapped_bytes=4 << 20)
    outcomes = collections.Counter()

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(150):
            x = torch.randn(int(torch.randint(1, 4000, (1,), generator=g)), generator=g)
            ref = exporter.export(*to_payload(x))
            if ref is None:
                outcomes["bytes"] += 1
                continue
            try:
                got = reader.read(ref)
            except SharedMemoryGone:
                outcomes["gone"] += 1
                continue
            assert torch.equal(got, x), (seed, i)
            outcomes["ok"] += 1

    with cf.ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(worker, s) for s in range(4)]:
            f.result()
    assert outcomes["ok"] > 0 and sum(outcomes.values()) == 600
    exporter.close()
    reader.close()
    assert objects(tmp_path) == []


def test_lease_live_follows_a_lease_from_export_to_hand_back(tmp_path):
    # lease_live finds a slab by name (the CUDA IPC exporter asks it for every held answer on each export).
    exporter, reader = ShmExporter(directory=tmp_path), ShmReader(tmp_path)
    try:
        ref = exporter.export(pb.Tensor(dtype=pb.UINT8, shape=[0]), b"").shared_memory
        other = exporter.export(pb.Tensor(dtype=pb.UINT8, shape=[0]), b"").shared_memory
        assert exporter.lease_live(ref.name, ref.lease) and exporter.lease_live(other.name, other.lease)
        assert not exporter.lease_live(ref.name, ref.lease ^ 1)  # another lease of the same slab
        assert not exporter.lease_live("modalmesh-emb-" + "0" * 32, ref.lease)  # no such slab
        reader.hand_back(ref)
        assert not exporter.lease_live(ref.name, ref.lease) and exporter.lease_live(other.name, other.lease)
    finally:
        reader.close()
        exporter.close()
