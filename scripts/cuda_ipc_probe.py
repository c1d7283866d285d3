"""Can this host share CUDA memory between processes, and does our wire form of a handle open?

    python3 scripts/cuda_ipc_probe.py

Two children each open memory the parent shares: one through torch.multiprocessing's own CUDA
IPC (no modalmesh code), one through modalmesh's own code (modalmesh/rpc/cuda_ipc.py: `share` in
the parent, the CudaIpcRef through the proto, `copy_shared` in the child). The
CUDA IPC transfer path falls back to shared memory when a handle does not open; this tells a
platform without CUDA IPC from a bug of ours.
"""

import os

import torch
import torch.multiprocessing as mp


def torch_child(queue, answers):
    try:
        tensor = queue.get(timeout=60)
        answers.put(f"torch.multiprocessing: works, the child read sum {float(tensor.sum()):.1f}")
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        answers.put(f"torch.multiprocessing: failed: {type(exc).__name__}: {exc}".splitlines()[0])


def timing_child(messages: list[bytes], answers):
    """Median cost of one `copy_shared` (open the handle, copy, close) over distinct shared tensors."""
    import statistics
    import time

    from modalmesh import pb
    from modalmesh.rpc.cuda_ipc import copy_shared

    times = []
    for message in messages:
        ref = pb.CudaIpcRef.FromString(message)
        start = time.perf_counter()
        _out, copied, storage = copy_shared(ref, torch.device("cuda"))
        copied.synchronize()
        del storage  # closes the mapping
        times.append(time.perf_counter() - start)
    answers.put(f"copy_shared of {ref.nbytes / 1e6:.1f} MB: first {times[0] * 1e3:.2f} ms, "
                f"median of the rest {statistics.median(times[1:]) * 1e3:.3f} ms")


def wire_child(message: bytes, answers):
    try:
        from modalmesh import pb
        from modalmesh.rpc.cuda_ipc import copy_shared

        out, copied, _storage = copy_shared(pb.CudaIpcRef.FromString(message), torch.device("cuda"))
        copied.synchronize()
        answers.put(f"modalmesh wire form: works, the child read sum {float(out.view(torch.float32).sum()):.1f}")
    except Exception as exc:  # noqa: BLE001
        answers.put(f"modalmesh wire form: failed: {type(exc).__name__}: {exc}".splitlines()[0])


if __name__ == "__main__":
    print("PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    ctx = mp.get_context("spawn")
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    queue, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=torch_child, args=(queue, answers))
    child.start()
    queue.put(x)
    print(answers.get(timeout=120))
    child.join(30)

    from modalmesh.rpc.cuda_ipc import share  # after the first child: it proves torch alone

    y = (x * 2).clone()
    ref = share(y)  # what the encoder's CudaIpcExporter puts in its answer, less the lease
    print(f"handle {len(ref.handle)} bytes, storage {ref.storage_size_bytes} B at {ref.storage_offset_bytes}, "
          f"event_sync {ref.event_sync_required}")
    answers = ctx.Queue()
    child = ctx.Process(target=wire_child, args=(ref.SerializeToString(), answers))
    child.start()
    print(answers.get(timeout=120), f"(expected {float(y.sum()):.1f})")
    child.join(30)

    # What one handoff costs each side: 20 distinct 1.8 MB answers (a 448x448 image's rows x 3584, bf16).
    import statistics
    import time

    held = [torch.randn(256, 3584, device="cuda").to(torch.bfloat16) for _ in range(20)]
    torch.cuda.synchronize()
    refs, times = [], []
    for t in held:
        start = time.perf_counter()
        refs.append(share(t).SerializeToString())
        times.append(time.perf_counter() - start)
    print(f"share (producer): first {times[0] * 1e3:.2f} ms, median of the rest {statistics.median(times[1:]) * 1e3:.3f} ms")
    answers = ctx.Queue()
    child = ctx.Process(target=timing_child, args=(refs, answers))
    child.start()
    print(answers.get(timeout=120))
    child.join(30)
