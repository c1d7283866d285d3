"""modalmesh.staging: uploads through reused pinned buffers equal plain copies, and the buffers stay."""

import pytest
import torch

from modalmesh.staging import HostStaging


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (3, 17, 5), generator=g, dtype=torch.uint8),
            torch.randn(7, 3, generator=g, dtype=torch.float32),
            torch.arange(5, dtype=torch.int64),
            torch.empty(0, 4, dtype=torch.bfloat16),
            torch.randn(4, 6, generator=g).t()]  # not contiguous


def test_cpu_device_returns_the_tensors():
    staging = HostStaging("cpu")
    batch = _batch(0)
    out = staging.upload(batch)
    for a, b in zip(batch, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    assert staging.pinned_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_equal_plain_copies_and_reuse_buffers():
    staging = HostStaging("cuda", slots=2)
    results = []
    for seed in range(6):  # more batches than slots: each slot is packed again after its copy ran
        batch = _batch(seed)
        results.append((batch, staging.upload(batch)))
    torch.cuda.synchronize()
    for batch, out in results:
        for a, b in zip(batch, out):
            assert b.is_cuda and b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous()
            assert torch.equal(a, b.cpu())
    assert staging.grown == 2  # one allocation per slot, then reuse
