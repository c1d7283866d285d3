"""Where a service's compiled kernels persist between starts: Triton's and inductor's on-disk caches in one place.

A service compiles kernels as it starts: the Triton kernels of `modalmesh.kernels` and the paged-attention forms
(`warm_paged`), and whatever `torch.compile` builds. Triton keeps them under ~/.triton/cache and inductor under
/tmp, which a container loses when it restarts, so each start compiled everything again. `--compile-cache DIR`
points both at DIR, a volume in docker compose, and the second start reads them back.

The caches key their own entries (Triton: the kernel's source, the GPU target, its version and options;
inductor: the graph, shapes, device and versions), so one directory serves every GPU kind, version and replica;
both write an entry to a temporary name and rename it, so replicas starting together may share it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from modalmesh.errors import ConfigError

log = logging.getLogger("modalmesh")


@dataclasses.dataclass(frozen=True)
class CompileCache:
    root: Path

    def environment(self) -> dict[str, str]:
        """The variables Triton and inductor read their cache directories from (each when it first compiles)."""
        return {"TRITON_CACHE_DIR": str(self.root / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(self.root / "inductor")}

    def entries(self) -> tuple[int, int]:
        """(files, bytes) held now (a walk of the whole tree: for benches, not start-up)."""
        files = [p for p in self.root.rglob("*") if p.is_file()]
        return len(files), sum(p.stat().st_size for p in files)


def configure(path: str | None) -> CompileCache | None:
    """Point this process's (and its children's) compile caches at `path`, made if missing; None leaves them
    where the libraries put them. Called once at start-up, before anything compiles."""
    if not path:
        return None
    cache = CompileCache(Path(path).expanduser().resolve())
    for directory in cache.environment().values():
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--compile-cache {path}: cannot create it: {exc.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):  # else the first compile fails, mid-start
            raise ConfigError(f"--compile-cache {path}: {directory} is not writable by this user")
    os.environ.update(cache.environment())  # the flag wins over variables set by hand
    log.info("compile cache: %s", cache.root)
    return cache
