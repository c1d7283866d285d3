"""The backend registry: name -> capability record + lazily imported implementation.

Registering a backend imports nothing. The built-in records (builtin_backends.py,
data only) are registered when this module is imported. `probe(name)` imports the
module its record's ``loader`` names, builds the backend and lets it import its
kernel; any exception on the way (a missing wheel, a wheel built for another GPU,
an ABI mismatch) is caught and kept as the reason the backend is unavailable. Probing therefore never raises, at import or
at model-registration time, and runs at most once per backend per process.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass

from modalmesh.attention.builtin_backends import BUILTIN_SPECS
from modalmesh.attention.capability import BackendSpec

log = logging.getLogger(__name__)

_SPECS: dict[str, BackendSpec] = {}
_PROBES: dict[str, Probe] = {}
_LOCK = threading.RLock()  # re-entrant: a probed module may register() more backends


@dataclass(frozen=True)
class Probe:
    """The outcome of loading one backend: the instance, or why there is none."""

    name: str
    backend: object | None  # an AttentionBackend
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.backend is not None

    @property
    def spec(self) -> BackendSpec:
        # A loaded backend may have narrowed its record (e.g. the forward-only FA3 wheel is bf16 only).
        return self.backend.spec if self.backend is not None else _SPECS[self.name]


def register(spec: BackendSpec, *, replace: bool = False) -> BackendSpec:
    """Add a backend. One call per backend; a plugin can register more before selection runs."""
    with _LOCK:
        if spec.name in _SPECS and not replace:
            raise ValueError(f"attention backend {spec.name!r} is already registered")
        _SPECS[spec.name] = spec
        _PROBES.pop(spec.name, None)
    return spec


def unregister(name: str) -> None:
    with _LOCK:
        _SPECS.pop(name, None)
        _PROBES.pop(name, None)


def names() -> tuple[str, ...]:
    """Registered backend names, in registration order."""
    return tuple(_SPECS)


def spec(name: str) -> BackendSpec:
    return _SPECS[name]


def probe(name: str) -> Probe:
    """Load backend `name` once; never raises (an unknown name is a KeyError)."""
    with _LOCK:
        cached = _PROBES.get(name)
        if cached is not None:
            return cached
        result = _load(_SPECS[name])
        _PROBES[name] = result
    if result.ok:
        log.debug("attention backend %s loaded", name)
    else:
        log.info("attention backend %s unavailable: %s", name, result.reason)
    return result


def forget_probes() -> None:
    """Drop cached probe results (tests that fake kernel modules call this)."""
    with _LOCK:
        _PROBES.clear()


def _load(spec: BackendSpec) -> Probe:
    module_name, _, attr = spec.loader.partition(":")
    try:
        module = importlib.import_module(module_name)
        backend = getattr(module, attr)(spec)
        backend.probe()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a broken kernel (even one calling exit()) must not end the process
        return Probe(spec.name, None, f"{type(exc).__name__}: {_first_line(exc)}")
    return Probe(spec.name, backend)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "(no message)"


def _register_builtins() -> None:
    for builtin in BUILTIN_SPECS:
        register(builtin)


_register_builtins()
