"""Tiled decoding: tile placement, linear seam blending, tiled vs untiled, AUTO decisions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modalmesh.errors import DeadlineExceeded
from modalmesh.testing import tiny
from services.vae.config import VAEConfig
from services.vae.engine import AUTO, OFF, ON, DecodeAbandoned, TilingDefaults, TilingRequest, VAEEngine
from services.vae.tiling import TileGrid, ramp_weights, tile_starts, tiled_decode
from services.vae.weights import build_decoder, load_decoder

CPU = torch.device("cpu")


@pytest.mark.parametrize("size, tile, overlap", [(5, 8, 2), (8, 8, 2), (9, 8, 2), (24, 8, 2), (25, 8, 3),
                                                 (100, 16, 4), (33, 16, 8), (17, 16, 15)])
def test_tiles_cover_the_latent_with_at_least_the_requested_overlap(size, tile, overlap):
    starts = tile_starts(size, tile, overlap)
    span = min(tile, size)
    assert starts[0] == 0 and starts[-1] + span == size  # the last tile ends at the far edge, full size
    assert list(starts) == sorted(set(starts))
    for a, b in zip(starts, starts[1:]):
        assert tile - (b - a) >= overlap  # consecutive tiles overlap by at least `overlap`


def test_ramp_weights_of_neighbours_sum_to_one():
    starts = tile_starts(40, 16, 4)
    weights = ramp_weights(starts, 16, scale=2)
    total = torch.zeros(80)
    for s, w in zip(starts, weights):
        total[s * 2:(s + 16) * 2] += w
    torch.testing.assert_close(total, torch.ones(80))
    assert weights[0][0] == 1 and weights[-1][-1] == 1  # no ramp at the image border


def _upsample(scale):
    return lambda z: F.interpolate(z[:, :3], scale_factor=scale, mode="nearest")


@pytest.mark.parametrize("h, w, tile, overlap, batch", [(20, 13, 8, 2, 1), (31, 31, 8, 4, 3), (7, 30, 6, 1, 5)])
def test_pointwise_decoder_tiles_to_exactly_the_untiled_image(h, w, tile, overlap, batch):
    # With a decoder that looks at one latent pixel per output pixel, any correct placement and
    # any weights that are normalised reproduce the untiled output exactly.
    torch.manual_seed(0)
    z = torch.randn(2, 4, h, w)
    grid = TileGrid.plan(h, w, tile=tile, overlap=overlap)
    out = tiled_decode(_upsample(4), z, grid, scale=4, tile_batch=batch)
    torch.testing.assert_close(out, _upsample(4)(z), atol=1e-6, rtol=0)


def test_seams_are_linear_cross_fades():
    # Each tile decodes to a constant (its own index): the output must ramp linearly from one
    # tile's value to the next across every overlap, and be flat elsewhere.
    grid = TileGrid.plan(1, 20, tile=8, overlap=4)
    assert grid.xs == (0, 4, 8, 12)
    scale = 2
    values = iter(range(100))

    def decode(crops):
        return torch.stack([torch.full((3, crops.shape[2] * scale, crops.shape[3] * scale), float(next(values)))
                            for _ in crops])

    row = tiled_decode(decode, torch.zeros(1, 4, 1, 20), grid, scale=scale, tile_batch=1)[0, 0, 0]
    steps = row.diff()
    assert row[0] == 0 and row[-1] == 3
    # Overlap of 4 latent = 8 pixels; neighbours differ by 1, so each step is 1/8.
    assert torch.all(steps >= -1e-6) and steps.max() <= 1 / 8 + 1e-6
    torch.testing.assert_close(row[8:16], (torch.arange(8) + 0.5) / 8)  # tile 0 -> 1 across pixels 8..15


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    vae_dir = tiny.ensure("vae", tmp_path_factory.mktemp("tiling"))
    cfg = VAEConfig.from_dir(vae_dir)
    model = build_decoder(cfg, dtype=torch.float32)
    load_decoder(model, vae_dir, device=CPU, dtype=torch.float32, metrics=False)
    return VAEEngine(cfg, model, device=CPU, dtype=torch.float32), vae_dir


def test_defaults_follow_diffusers_tile_size(engine):
    eng, _ = engine
    assert eng.tiling == TilingDefaults(tile=16, overlap=4, threshold=16, batch=4)  # sample_size 32 / x2


def test_tiled_is_close_to_untiled_and_closer_than_diffusers_tiled_decode(engine):
    diffusers = pytest.importorskip("diffusers")
    eng, vae_dir = engine
    ref = diffusers.AutoencoderKL.from_pretrained(vae_dir).eval()
    ref.enable_tiling()  # its tiles: 16 latent, overlap 0.25 (4 latent): the same as ours here
    torch.manual_seed(0)
    z = torch.randn(2, 4, 24, 20)
    untiled = eng.decode(z, TilingRequest(mode=OFF))
    tiled = eng.decode(z, TilingRequest(mode=ON))
    assert (untiled.tiles, tiled.tiles) == (1, 4)
    with torch.inference_mode():
        theirs = ref.decode(z).sample
    ours_err, their_err = (tiled.pixels - untiled.pixels).abs(), (theirs - untiled.pixels).abs()
    # diffusers' own tiling test accepts a max difference below 0.5 on tiny random VAEs.
    assert ours_err.max() < 0.5 and ours_err.mean() < 0.05
    assert ours_err.mean() < their_err.mean()


def test_one_tile_is_the_untiled_decode_and_tile_batching_changes_nothing(engine):
    eng, _ = engine
    torch.manual_seed(1)
    z = torch.randn(3, 4, 10, 12)
    untiled = eng.decode(z, TilingRequest(mode=OFF)).pixels
    one = eng.decode(z, TilingRequest(mode=ON, tile=16))
    assert one.tiles == 1
    torch.testing.assert_close(one.pixels, untiled, atol=1e-5, rtol=0)
    many = eng.decode(z, TilingRequest(mode=ON, tile=6, overlap=2))  # 4 crops per decoder call
    eng.tiling = TilingDefaults(tile=16, overlap=4, threshold=16, batch=1)
    try:
        single = eng.decode(z, TilingRequest(mode=ON, tile=6, overlap=2))
    finally:
        eng.tiling = TilingDefaults(tile=16, overlap=4, threshold=16, batch=4)
    assert many.tiles == single.tiles == 2 * 3  # rows start at 0, 4; columns at 0, 4, 6
    torch.testing.assert_close(many.pixels, single.pixels, atol=1e-5, rtol=0)


def test_auto_tiles_beyond_the_threshold_or_the_memory_budget(engine):
    eng, _ = engine
    assert not eng.should_tile(1, 16, 16, TilingRequest(AUTO))
    assert eng.should_tile(1, 17, 8, TilingRequest(AUTO))
    assert eng.should_tile(1, 4, 4, TilingRequest(ON)) and not eng.should_tile(1, 64, 64, TilingRequest(OFF))
    need = eng.untiled_bytes(1, 16, 16)
    assert eng.untiled_bytes(2, 16, 16) == 2 * need and eng.untiled_bytes(1, 16, 32) > need
    eng.untiled_budget_bytes = need - 1
    try:
        assert eng.should_tile(1, 16, 16, TilingRequest(AUTO))  # would not fit: tiled even under the threshold
        result = eng.decode(torch.randn(1, 4, 16, 16), TilingRequest(AUTO, tile=8))
        assert result.tiles == 9
    finally:
        eng.untiled_budget_bytes = 0


def test_the_workspace_is_a_pool_in_the_shared_schema(engine):
    """pool="vae_workspace", in bytes: the running decode's estimated activations against the untiled budget."""
    from modalmesh.metrics import Metrics

    base, _ = engine
    metrics = Metrics("vae", process_metrics=False)
    need = base.untiled_bytes(1, 16, 16)
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32, untiled_budget_bytes=4 * need,
                    metrics=metrics)
    pool = {"service": "vae", "pool": "vae_workspace"}
    get = metrics.registry.get_sample_value
    seen = []
    run = eng._run
    eng._run = lambda z: (seen.append((get("modalmesh_kv_pool_used_tokens", pool),
                                       get("modalmesh_kv_pool_bytes", pool))), run(z))[1]
    eng.warm_up()
    assert get("modalmesh_kv_pool_capacity_tokens", pool) == 4 * need  # the budget for untiled decodes
    assert get("modalmesh_kv_pool_used_tokens", pool) == 0 and get("modalmesh_kv_pool_usage_ratio", pool) == 0
    seen.clear()
    eng.decode(torch.randn(1, 4, 16, 16), TilingRequest(OFF))
    assert seen == [(need, need)]  # in use while it ran
    assert get("modalmesh_kv_pool_used_tokens", pool) == 0  # and given back
    seen.clear()
    eng.decode(torch.randn(1, 4, 16, 16), TilingRequest(ON, tile=8))  # tiled: one tile batch's workspace
    tile_need = eng.untiled_bytes(min(9, eng.tiling.batch), 8, 8)
    assert seen and all(s == (tile_need, tile_need) for s in seen)
    assert get("modalmesh_kv_pool_page_size", pool) == 0


def test_the_warm_up_decodes_the_tile_shape_on_cuda_where_it_fits(engine):
    """So the first request after SERVING does not compile kernels for its sizes; on the CPU (and where the tile
    does not fit) a small latent."""
    base, _ = engine
    assert base.warm_up_side() == 8  # CPU
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32)
    eng.device = torch.device("cuda")  # the choice alone; nothing runs
    eng.fits = lambda batch, h, w: (batch, h, w) == (1, eng.tiling.tile, eng.tiling.tile)
    assert eng.warm_up_side() == eng.tiling.tile > 8
    eng.fits = lambda *_: False
    assert eng.warm_up_side() == 8


class _Replays:
    """BatchGraphs' surface (inputs, sizes, a call per replay) for an engine on the CPU: records each replay's
    batch; `run` says what a replay returns."""

    def __init__(self, eng, sizes, run):
        tile = eng.tiling.tile
        self.inputs = torch.zeros(sizes[-1], eng.cfg.latent_channels, tile, tile)
        self.sizes, self.run, self.batches = sizes, run, []

    def __call__(self, x):
        self.batches.append(x.shape[0])
        return self.run(x)


def test_tile_shaped_decodes_replay_the_graphs_in_turn_and_other_shapes_run_eagerly(engine):
    base, _ = engine
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32)
    tile, c = eng.tiling.tile, eng.cfg.latent_channels
    eng.graphs = replays = _Replays(eng, [1, 2], eng._forward)
    torch.manual_seed(3)
    z = torch.randn(5, c, tile, tile)
    got = eng.decode(z, TilingRequest(OFF)).pixels
    assert replays.batches == [2, 2, 1]  # a batch past the largest graph replays it in turn
    torch.testing.assert_close(got, base.decode(z, TilingRequest(OFF)).pixels, atol=1e-5, rtol=0)
    replays.batches.clear()
    eng.decode(torch.randn(1, c, tile // 2, tile), TilingRequest(OFF))
    assert replays.batches == []  # another shape: eager
    tiled = eng.decode(torch.randn(1, c, tile + tile // 2, tile), TilingRequest(ON))
    assert tiled.tiles == 2 and replays.batches == [2]  # every tile has the tile's shape


def test_a_decode_stops_between_graph_replays(engine):
    """A replay is one launch, so no resnet hook runs inside it: the stop check runs before each replay."""
    base, _ = engine
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32)
    tile, scale = eng.tiling.tile, eng.cfg.scale_factor
    eng.graphs = replays = _Replays(eng, [1, 2], lambda x: torch.zeros(x.shape[0], 3, tile * scale, tile * scale))
    answers = iter([False, True])
    with pytest.raises(DecodeAbandoned):
        eng.decode(torch.randn(4, eng.cfg.latent_channels, tile, tile), TilingRequest(OFF),
                   should_stop=lambda: next(answers))
    assert replays.batches == [2] and eng._before_replay is None
    with pytest.raises(DeadlineExceeded):  # the deadline likewise
        eng.decode(torch.randn(4, eng.cfg.latent_channels, tile, tile), TilingRequest(OFF), budget_s=1e-9)
    assert replays.batches == [2]


def test_the_graphs_pool_is_not_counted_as_memory_an_eager_decode_may_take(engine, monkeypatch):
    base, _ = engine
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32)
    eng.device = torch.device("cuda")  # the arithmetic alone; nothing runs
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * gib)
    assert eng.budget_bytes() == int(0.9 * 15 * gib)
    eng.graph_pool_bytes = 4 * gib
    assert eng.budget_bytes() == int(0.9 * 11 * gib)


def test_the_graphs_batch_is_the_tile_batch_where_it_fits(engine):
    base, _ = engine
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32, max_batch=8)
    assert eng.graph_batch() == eng.tiling.batch == 4
    eng.fits = lambda batch, h, w: batch <= 2
    assert eng.graph_batch() == 2
    eng.max_batch = 1  # a tiled decode still sends a tile batch at a time
    assert eng.graph_batch() == 2
    eng.fits = lambda batch, h, w: False
    assert eng.graph_batch() == 1


def test_the_warm_up_captures_graphs_on_cuda_when_asked_and_the_tile_fits(engine, monkeypatch):
    base, _ = engine
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    for graphs_on, fits, captures in ((True, True, 1), (False, True, 0), (True, False, 0)):
        eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32, cuda_graphs=graphs_on)
        eng.device = torch.device("cuda")  # the choices alone: the decode and the capture are stand-ins
        eng.fits = lambda *_, fits=fits: fits  # the warm-up decodes the tile's side only where it fits
        sides, captured = [], []
        eng.decode = lambda z, req: sides.append(z.shape[-1])
        eng.capture_graphs = lambda: captured.append(True)
        eng.publish_workspace = lambda used: None
        eng.warm_up()
        assert sides == [eng.tiling.tile if fits else 8] and len(captured) == captures, (graphs_on, fits)


def test_a_failed_capture_leaves_the_engine_eager_with_no_pool(engine, monkeypatch):
    from services.vae import engine as engine_mod

    base, _ = engine
    eng = VAEEngine(base.cfg, base.model, device=CPU, dtype=torch.float32, cuda_graphs=True)
    reserved = iter([1 << 30, 3 << 30, 1 << 30, 1 << 30])  # before / after a capture, then a failed one
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: next(reserved))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 << 29)
    got = []
    monkeypatch.setattr(engine_mod.BatchGraphs, "capture", lambda forward, **kw: got.append(kw) or "graphs")
    eng.capture_graphs()
    assert eng.graphs == "graphs" and eng.graph_pool_bytes == 2 << 30
    tile = eng.tiling.tile
    assert got == [dict(item_shape=(eng.cfg.latent_channels, tile, tile), dtype=torch.float32, device=CPU,
                        max_batch=eng.tiling.batch)]
    monkeypatch.setattr(engine_mod.BatchGraphs, "capture", lambda forward, **kw: None)  # capture failed
    eng.capture_graphs()
    assert eng.graphs is None and eng.graph_pool_bytes == 0
