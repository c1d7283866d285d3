"""--attention-backend / MODALMESH_ATTENTION_BACKEND: parsing and lookup.

Syntax: comma-separated entries, each ``backend`` (for every component) or
``component=backend``. ``-`` and ``_`` are the same in names, case is ignored,
``auto`` means "no override" (``llm=auto`` exempts llm from a global one).
Unknown backend names are an error listing the valid ones.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from modalmesh.attention import registry
from modalmesh.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "MODALMESH_ATTENTION_BACKEND"
AUTO = "auto"
KNOWN_COMPONENTS = ("llm", "vision_encoder", "audio_encoder", "vae")
COMPONENT_OVERRIDE, GLOBAL_OVERRIDE, COMPONENT_DEFAULT, AUTOMATIC = (
    "component override", "global override", "component default", "auto")
COMPONENT_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


def normalize_name(name: str) -> str:
    """Component and backend names: case-insensitive, '-' and '_' equivalent."""
    return name.strip().lower().replace("-", "_")


@dataclass(frozen=True)
class BackendOverrides:
    """A parsed --attention-backend value."""

    everything: str | None = None
    per_component: Mapping[str, str] = field(default_factory=dict)

    def lookup(self, component: str) -> tuple[str | None, str]:
        if component in self.per_component:
            name = self.per_component[component]
            return (None, AUTOMATIC) if name == AUTO else (name, COMPONENT_OVERRIDE)
        return (self.everything, GLOBAL_OVERRIDE) if self.everything else (None, AUTOMATIC)

    def named_backends(self) -> set[str]:
        return {n for n in (self.everything, *self.per_component.values()) if n and n != AUTO}


def parse_backend_spec(text: str | None) -> BackendOverrides:
    """Parse ``"fa3"``, ``"llm=fa3,vision-encoder=sdpa_cudnn"`` or both mixed; ConfigError if malformed."""
    if text is None or not text.strip():
        return BackendOverrides()
    valid = registry.names()
    everything, per_component = None, {}
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            raise ConfigError(f"--attention-backend {text!r}: empty entry")
        component, sep, backend = entry.rpartition("=")
        backend = normalize_name(backend)
        if backend != AUTO and backend not in valid:
            raise ConfigError(
                f"--attention-backend {text!r}: unknown backend {backend!r}; valid: {', '.join(valid)}, {AUTO}")
        if not sep:
            if everything is not None:
                raise ConfigError(f"--attention-backend {text!r}: more than one backend for all components")
            everything = None if backend == AUTO else backend
            continue
        component = normalize_name(component)
        if not COMPONENT_RE.match(component):
            raise ConfigError(f"--attention-backend {text!r}: {component!r} is not a component name")
        if component in per_component:
            raise ConfigError(f"--attention-backend {text!r}: {component} given twice")
        per_component[component] = backend
    unknown = sorted(set(per_component) - set(KNOWN_COMPONENTS))
    if unknown:
        log.warning("--attention-backend names components %s; known ones are %s", unknown, list(KNOWN_COMPONENTS))
    return BackendOverrides(everything, per_component)
