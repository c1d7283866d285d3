"""The same-host transfer path (modalmesh.rpc.shm): probe, export, read, expiry, refusals."""

import asyncio
import os
import time

import pytest
import torch

from modalmesh import pb
from modalmesh.errors import InvalidArgument
from modalmesh.rpc.codec import from_proto, to_proto
from modalmesh.rpc.shm import SHM_DIR, ShmExporter, ShmProbe, read_tensor, shm_available


def objects(directory, prefix="modalmesh-emb-"):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (256, 48)), (torch.float32, (3, 5)),
                                         (torch.float16, (0, 8)), (torch.int64, (7,))])
def test_export_then_read_gives_the_same_tensor_and_leaves_nothing(tmp_path, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 100).to(dtype)
    exporter = ShmExporter(directory=tmp_path)
    message = exporter.export(to_proto(x))
    assert message.data == b"" and message.HasField("shared_memory")
    assert message.shared_memory.nbytes == x.numel() * x.element_size()
    assert objects(tmp_path) == [message.shared_memory.name]
    got = read_tensor(message, directory=tmp_path)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, x)
    assert objects(tmp_path) == []  # the reader took it
    assert exporter.sweep(now=float("inf")) == 0  # nothing left for the janitor


def test_unread_objects_are_removed_after_the_ttl_and_on_close(tmp_path):
    exporter = ShmExporter(ttl_s=30.0, directory=tmp_path)
    early = exporter.export(to_proto(torch.ones(4)))
    assert exporter.sweep() == 0  # not expired yet
    assert objects(tmp_path) == [early.shared_memory.name]
    assert exporter.sweep(now=time.monotonic() + 31) == 1
    assert objects(tmp_path) == []
    with pytest.raises(FileNotFoundError):  # the client came too late: it falls back to bytes
        read_tensor(early, directory=tmp_path)
    exporter.export(to_proto(torch.ones(4)))
    exporter.export(to_proto(torch.zeros(2)))
    exporter.close()
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
        for name in ("../secret", "secret", f"{probe.name}/..", ""):  # only probe names are ever opened
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
    good = exporter.export(to_proto(torch.arange(6, dtype=torch.float32)))
    (tmp_path / "passwd").write_bytes(bytes(24))
    bad_name = pb.Tensor(dtype=pb.FLOAT32, shape=[6], shared_memory=pb.SharedMemoryRef(name="../passwd", nbytes=24))
    with pytest.raises(InvalidArgument, match="not one modalmesh writes"):
        read_tensor(bad_name, directory=tmp_path)
    wrong_count = pb.Tensor(dtype=pb.FLOAT32, shape=[5], shared_memory=good.shared_memory)
    with pytest.raises(InvalidArgument, match="holds 24 bytes but shape \\[5\\]"):
        read_tensor(wrong_count, directory=tmp_path)
    lying = pb.Tensor(dtype=pb.FLOAT32, shape=[3, 2],
                      shared_memory=pb.SharedMemoryRef(name=good.shared_memory.name, nbytes=24))
    os.truncate(tmp_path / good.shared_memory.name, 8)
    with pytest.raises(InvalidArgument, match="has 8 bytes, expected 24"):
        read_tensor(lying, directory=tmp_path)
    assert objects(tmp_path) == []  # a bad object is removed all the same


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
        message = exporter.export(to_proto(x))
        assert (SHM_DIR / message.shared_memory.name).exists()
        assert torch.equal(read_tensor(message), x)
        assert not (SHM_DIR / message.shared_memory.name).exists()
    finally:
        probe.close()
        exporter.close()


# ---- the LLM's encoder pool against a real gRPC encoder ------------------------------------------
def _pool_round_trip(mode):
    from services.llm.encoders import EncoderPool
    from tests.helpers.echo_service import build

    async def body():
        server, servicer = build()
        servicer.shared_memory = ShmExporter() if mode == "export" else mode
        port = await server.start()
        probe = ShmProbe()
        pool = EncoderPool(pb.IMAGE, f"127.0.0.1:{port}", probe=probe)
        x = torch.randn(5, 8)
        try:
            reply, tensor = await pool.encode_one(pb.EncodeItem(pcm=to_proto(x)), 3, timeout=30)
            return x, reply, tensor, servicer.encode_calls, pool.probe
        finally:
            await pool.close()
            probe.close()
            if mode == "export":
                servicer.shared_memory.close()
            await server.stop(0)

    return asyncio.run(asyncio.wait_for(body(), timeout=60))


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_the_encoder_pool_reads_shared_memory_answers():
    x, reply, tensor, calls, probe = _pool_round_trip("export")
    assert reply.embeddings[0].embedding.HasField("shared_memory") and calls == 1
    assert torch.equal(tensor, x) and probe is not None


@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_an_unreadable_shared_memory_answer_falls_back_to_bytes_for_good():
    x, reply, tensor, calls, probe = _pool_round_trip("gone")
    assert calls == 2 and tensor is None and probe is None  # asked again without the offer, and stops offering
    assert torch.equal(from_proto(reply.embeddings[0].embedding), x)
