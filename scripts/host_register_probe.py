"""Does exporting a GPU answer through shared memory leave anything wrong behind in the process?

    python3 scripts/host_register_probe.py

One process plays both sides, as tests/test_transfer.py does: the encoder's exporter copies a GPU
tensor into a slab, then the LLM's reader copies the same slab onto the GPU, then a plain torch
kernel runs. Each step prints what CUDA said. A CUDA call that fails leaves its error behind for
the thread's next runtime check (cudaGetLastError), so an ignored failure shows up later, in an
unrelated call: this prints where. The exporter used to page-lock each slab (cudaHostRegister);
on the H200 host the driver refused, and the kernel after the export failed with "invalid
argument" (2026-12-01). It no longer page-locks.
"""

import tempfile
from pathlib import Path

import torch

from modalmesh import pb
from modalmesh.rpc.shm import ShmExporter, ShmProbe, ShmReader


def step(name, fn):
    try:
        out = fn()
        torch.cuda.synchronize()
        print(f"{name}: ok" + (f" ({out})" if out is not None else ""))
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}")


if __name__ == "__main__":
    tmp = Path(tempfile.mkdtemp())
    exporter, probe, reader = ShmExporter(directory=tmp), ShmProbe(tmp), ShmReader(tmp)
    x = torch.randn(256, 3584, device="cuda").to(torch.bfloat16)
    step("a kernel before", lambda: float((x.float() * 2).sum()))
    ref = {}
    step("export a CUDA tensor into a slab", lambda: ref.setdefault("t", exporter.export(
        pb.Tensor(dtype=pb.BFLOAT16, shape=[256, 3584]), x)) and None)
    step("a kernel after the export", lambda: float((x.float() * 2).sum()))
    step("read the slab onto the GPU", lambda: bool(torch.equal(reader.read(ref["t"], device="cuda"), x)))
    step("a kernel after the read", lambda: float((x.float() * 2).sum()))
    reader.close()
    probe.close()
    exporter.close()
    step("a kernel after closing", lambda: float((x.float() * 2).sum()))
