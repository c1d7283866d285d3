"""modalmesh.batch_graphs: fixed-shape towers replayed per batch bucket (CPU: the logic with a stand-in
replay; CUDA: real graphs of the SigLIP and Whisper towers against their eager forwards)."""

import numpy as np
import pytest
import torch

from modalmesh import pb
from modalmesh.batch_graphs import BatchGraphs, buckets
from modalmesh.testing import tiny


def test_every_batch_size_up_to_the_largest_has_a_graph_of_its_own():
    # No padding rows: with buckets 1, 2, 4, 6, 8, 12, 16, ... a batch of 13 ran 16 rows' work.
    assert buckets(8) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert buckets(44)[-1] == 44 and len(buckets(44)) == 44 and buckets(0) == [1]


def test_a_batch_replays_its_own_size_and_owns_its_rows():
    torch.manual_seed(0)
    tower = torch.nn.Linear(4, 3)  # every row on its own, as in the towers
    sizes = [1, 2, 4, 6, 8]  # a sparse set, as capture may be handed: a batch replays the smallest that fits
    inputs = torch.zeros(8, 4)
    shared = torch.empty(8, 3)
    outputs = {n: shared[:n] for n in sizes}  # as captured: views of one buffer

    class Replay:  # what a CUDA graph does: the captured forward on the static buffers
        def __init__(self, n):
            self.n, self.count = n, 0

        def replay(self):
            outputs[self.n].copy_(tower(inputs[:self.n]))
            self.count += 1

    graphs = BatchGraphs(tower, inputs, {n: Replay(n) for n in sizes}, outputs)
    with torch.no_grad():
        x5, x3, x9 = torch.randn(5, 4), torch.randn(3, 4), torch.randn(9, 4)
        out5 = graphs(x5)
        assert graphs.graphs[6].count == 1 and out5.shape == (5, 3)
        torch.testing.assert_close(out5, tower(x5))
        out3 = graphs(x3)  # a later replay overwrites the buffers, never the rows handed out
        assert graphs.graphs[4].count == 1
        torch.testing.assert_close(out5, tower(x5))
        torch.testing.assert_close(out3, tower(x3))
        out9 = graphs(x9)  # larger than every bucket: eager
        assert graphs.replays == 2
        torch.testing.assert_close(out9, tower(x9))
        x6 = torch.randn(6, 4)
        out6 = graphs(x6)  # x5's bucket again: its buffer is rewritten, the rows handed out for x5 are not
        assert graphs.graphs[6].count == 2
        torch.testing.assert_close(out5, tower(x5))
        torch.testing.assert_close(out6, tower(x6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_siglip_and_whisper_towers_replayed_equal_their_eager_forwards(tmp_path):
    from services.audio_encoder.model import build_encoder_model as build_audio
    from services.vision_encoder.model import build_encoder_model as build_vision

    vision = tiny.ensure("siglip", tmp_path / "siglip")
    whisper = tiny.ensure("whisper", tmp_path / "whisper")
    rng = np.random.default_rng(0)
    for build, path, item in (
        (build_vision, vision, lambda i: pb.EncodeItem(pixels=pb.Tensor(
            dtype=pb.UINT8, shape=[40, 52, 3], data=rng.integers(0, 256, (40, 52, 3), dtype=np.uint8).tobytes()))),
        (build_audio, whisper, lambda i: pb.EncodeItem(pcm=pb.Tensor(
            dtype=pb.FLOAT32, shape=[16000 + 1000 * i], data=rng.standard_normal(16000 + 1000 * i).astype(
                np.float32).tobytes()), sample_rate=16000)),
    ):
        graphed = build(path, device="cuda", dtype=torch.float32, options={"cuda_graphs": True})
        eager = build(path, device="cuda", dtype=torch.float32, options={"cuda_graphs": False})
        assert graphed.graphs is not None and eager.graphs is None
        assert graphed.describe()["cuda_graphs"] == "on"
        graphs = graphed.graphs
        assert graphs.sizes == list(range(1, graphs.sizes[-1] + 1))  # every size: no padding rows
        # One output buffer for all of them: the graphs' memory does not grow with their number.
        assert {graphs.outputs[n].data_ptr() for n in graphs.sizes} == {graphs.outputs[graphs.sizes[-1]].data_ptr()}
        for n in (1, 3, 5, 3):  # 3 again: its graph replayed after 5's wrote the shared buffer
            batch = [graphed.prepare(item(i), i) for i in range(n)]
            assert graphs.bucket(n) == n
            before = graphed.graphs.replays
            got, want = graphed.encode(batch), eager.encode(batch)
            assert graphed.graphs.replays == before + 1
            for g, w in zip(got, want):
                scale = w.embedding.abs().max().item()
                assert (g.embedding - w.embedding).abs().max().item() <= 1e-4 * max(scale, 1.0)
