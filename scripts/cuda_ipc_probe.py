"""Can this host share CUDA memory between processes? torch.multiprocessing's own CUDA IPC, no modalmesh code.

    python3 scripts/cuda_ipc_probe.py     # prints "CUDA IPC works" or the error a child got opening a handle

The CUDA IPC transfer path (modalmesh/rpc/cuda_ipc.py) falls back to shared memory when a handle
cannot be opened; this tells a platform without CUDA IPC (some sandboxes) from a bug of ours.
"""

import torch
import torch.multiprocessing as mp


def child(queue, answers):
    try:
        tensor = queue.get(timeout=60)
        answers.put(f"CUDA IPC works: the child read sum {float(tensor.sum()):.1f}")
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        answers.put(f"CUDA IPC failed in the child: {type(exc).__name__}: {exc}".splitlines()[0])


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(queue, answers))
    proc.start()
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    queue.put(x)
    print(answers.get(timeout=120))
    proc.join(30)
