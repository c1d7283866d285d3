"""Can this host share CUDA memory between processes, and does our wire form of a handle open?

    python3 scripts/cuda_ipc_probe.py

Two children each open memory the parent shares: one through torch.multiprocessing's own CUDA
IPC (no modalmesh code), one through the fields modalmesh's CudaIpcRef carries (the parent's
`_share_cuda_()` put through the proto and opened as modalmesh/rpc/cuda_ipc.py opens it). The
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


def wire_child(message: bytes, answers):
    try:
        from modalmesh import pb

        ref = pb.CudaIpcRef.FromString(message)
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            0, ref.handle, ref.storage_size_bytes, ref.storage_offset_bytes, ref.ref_counter_handle,
            ref.ref_counter_offset, ref.event_handle, ref.event_sync_required)
        src = torch.empty(0, dtype=torch.uint8, device="cuda").set_(storage, ref.offset, (ref.nbytes,), (1,))
        total = float(src.clone().view(torch.float32).sum())
        answers.put(f"modalmesh wire form: works, the child read sum {total:.1f}")
    except Exception as exc:  # noqa: BLE001
        answers.put(f"modalmesh wire form: failed: {type(exc).__name__}: {exc}".splitlines()[0])


if __name__ == "__main__":
    from modalmesh import pb

    print("PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    ctx = mp.get_context("spawn")
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    queue, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=torch_child, args=(queue, answers))
    child.start()
    queue.put(x)
    print(answers.get(timeout=120))
    child.join(30)

    y = (x * 2).clone()
    (_device, handle, size, offset, counter, counter_offset, event, event_sync) = y.untyped_storage()._share_cuda_()
    ref = pb.CudaIpcRef(device=0, handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                        ref_counter_handle=counter, ref_counter_offset=counter_offset, event_handle=event or b"",
                        event_sync_required=bool(event_sync), offset=y.storage_offset() * 4, nbytes=y.numel() * 4)
    print(f"handle {len(handle)} bytes, storage {size} B at {offset}, event_sync {event_sync}")
    answers = ctx.Queue()
    child = ctx.Process(target=wire_child, args=(ref.SerializeToString(), answers))
    child.start()
    print(answers.get(timeout=120), f"(expected {float(y.sum()):.1f})")
    child.join(30)
