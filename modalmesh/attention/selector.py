"""Choosing a backend per component, once, and rerouting single calls that do not fit.

First match wins:
  1. per-component override   (``--attention-backend llm=fa3,vision_encoder=sdpa_cudnn``)
  2. global override          (``--attention-backend sdpa_math``, or MODALMESH_ATTENTION_BACKEND)
  3. the component's declared default
  4. automatic: ranking.py's order for this platform, layout and head dim,
     filtered by the component's supported set and what it needs.

An override that cannot run here is a ConfigError at start-up naming the request,
the reasons and the usable alternatives. Automatic choice cannot fail while SDPA
math (which serves everything) is registered.

Precision contract: a backend is chosen only for dtypes it takes, with one
exception: a fused backend named for *this component* (``vae=fa3``) is an explicit
request, so inputs are cast to its compute dtype and the output cast back. A
global override is "wherever it fits": a component or call in a dtype it cannot
take goes to the best backend that can, and a rerouted call is counted in
``modalmesh_attention_fallback_total``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from modalmesh.attention import ranking, registry
from modalmesh.attention.capability import Needs, dtype_name, unmet
from modalmesh.attention.overrides import (
    AUTOMATIC,
    COMPONENT_DEFAULT,
    COMPONENT_OVERRIDE,
    COMPONENT_RE,
    ENV_VAR,
    GLOBAL_OVERRIDE,
    normalize_name,
    parse_backend_spec,
)
from modalmesh.attention.platform import Platform, detect_platform
from modalmesh.attention.smoke import smoke_test
from modalmesh.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selection:
    """The backend of one component and why; every other backend with why it lost."""

    component: str
    backend: str
    reason: str
    source: str  # COMPONENT_OVERRIDE | GLOBAL_OVERRIDE | COMPONENT_DEFAULT | AUTOMATIC
    needs: Needs
    rejected: Mapping[str, str]
    cast_dtype: torch.dtype | None = None  # explicit fused backend computing in another dtype
    supported: tuple[str, ...] | None = None


@dataclass
class Route:
    """What one call (layout, dtype, device) of a component runs on."""

    backend: object  # AttentionBackend
    cast_dtype: torch.dtype | None = None
    rerouted_from: str | None = None
    reason: str | None = None  # short, bounded: a metric label
    counter: object = None  # the labelled fallback counter, bound on first use


class AttentionSelector:
    def __init__(
        self,
        spec: str | None = None,
        *,
        platform: Platform | None = None,
        device: torch.device | str | None = None,
        metrics=None,
        smoke: bool | None = None,
        rules: tuple[ranking.RankRule, ...] = ranking.RANKING,
    ):
        self.overrides = parse_backend_spec(os.environ.get(ENV_VAR) if spec is None else spec)
        self.platform = platform if platform is not None else detect_platform(device)
        self.smoke = self.platform.detected if smoke is None else smoke
        self.rules = rules
        self._metrics = metrics
        self._lock = threading.RLock()
        self._selections: dict[tuple, Selection] = {}
        self._by_component: dict[str, Selection] = {}
        self._routes: dict[tuple, Route] = {}
        self._check_named_backends()

    # ---- start-up -------------------------------------------------------------------------
    def _check_named_backends(self) -> None:
        """Every backend named in an override must at least run on this platform."""
        for name in sorted(self.overrides.named_backends()):
            why = self._availability(name)
            if why:
                users = [c for c, b in self.overrides.per_component.items() if b == name]
                who = ", ".join(users) if users else "all components"
                raise ConfigError(
                    f"--attention-backend: {name} (for {who}) cannot run on {self.platform.describe()}: {why}. "
                    f"Usable here: {', '.join(self.usable()) or 'none'}")

    def _availability(self, name: str) -> str | None:
        targets, reasons = registry.spec(name).targets_for(self.platform)
        if not targets:
            return f"not available on {self.platform.describe()} ({'; '.join(reasons)})"
        probe = registry.probe(name)
        return None if probe.ok else probe.reason

    def usable(self) -> list[str]:
        """Backends that load and run on this platform (for any needs)."""
        return [n for n in registry.names() if self._availability(n) is None]

    # ---- per component ----------------------------------------------------------------------
    def verdict(self, name: str, needs: Needs, *, supported=None, ignore_dtype=False, platform=None) -> str | None:
        """None if backend `name` can serve `needs`, else why not."""
        if supported is not None and name not in supported:
            return "not in the component's supported set"
        platform = platform or self.platform
        targets, reasons = registry.spec(name).targets_for(platform)
        if not targets:
            return f"not available on {platform.describe()} ({'; '.join(reasons)})"
        probe = registry.probe(name)
        if not probe.ok:
            return probe.reason
        return "; ".join(unmet(probe.spec, needs, platform, ignore_dtype=ignore_dtype)) or None

    def select(
        self, component: str, needs: Needs, *, default: str | None = None, supported: Iterable[str] | None = None
    ) -> Selection:
        """The backend for `component` (cached per component and needs); logged and exported once."""
        component = normalize_name(component)
        if not COMPONENT_RE.match(component):
            raise ValueError(f"{component!r} is not a component name")
        supported = _check_names(supported, "supported") if supported is not None else None
        default = _check_names([default], "default")[0] if default else None
        key = (component, needs, default, supported)
        with self._lock:
            if key not in self._selections:
                selection = self._select(component, needs, default, supported)
                self._selections[key] = selection
                self._report(selection)
            return self._selections[key]

    def _select(self, component, needs, default, supported) -> Selection:
        verdicts = {n: self.verdict(n, needs, supported=supported) for n in registry.names()}
        requested, source = self.overrides.lookup(component)
        notes: dict[str, str] = {}
        if requested:
            chosen = self._try_override(component, requested, source, needs, supported, verdicts, notes)
            if chosen:
                return chosen
        if default:
            why = verdicts[default] or self._smoke(default, needs)
            if why is None:
                return self._selection(component, default, COMPONENT_DEFAULT, COMPONENT_DEFAULT, needs, verdicts, notes,
                                       supported=supported)
            notes[default] = f"component default unusable: {why}"
            verdicts[default] = notes[default]
        order, why_order = ranking.rank(self.platform, needs.layouts[0], needs.max_head_dim, self.rules,
                                        dtype=needs.dtype, seqlen=needs.seqlen_hint)
        for name in order:
            if verdicts[name] is None:
                failed = self._smoke(name, needs)
                if failed is None:
                    return self._selection(component, name, f"auto: {why_order}", AUTOMATIC, needs, verdicts, notes,
                                           supported=supported)
                verdicts[name] = failed
        reasons = "; ".join(f"{n}: {r}" for n, r in verdicts.items())
        raise ConfigError(f"no attention backend can serve {component} ({_describe(needs)}): {reasons}")

    def _try_override(self, component, requested, source, needs, supported, verdicts, notes) -> Selection | None:
        cast = None
        if source == GLOBAL_OVERRIDE:
            # "Wherever it fits": a component the global override cannot serve as it is — another dtype
            # (FP32 keeps its precision), head dim, page size or layout — goes to its own best choice.
            # A kernel that fits but fails its smoke test is broken, and that stays a start-up error.
            if verdicts[requested] is not None:
                notes[requested] = f"global override skipped: {verdicts[requested]}"
                return None
            why = None
        else:
            why = self.verdict(requested, needs, supported=supported, ignore_dtype=True)
        if why is None and verdicts[requested] is not None:  # runs here, but not in this dtype
            cast = registry.probe(requested).spec.cast_dtype
            why = None if cast is not None else verdicts[requested]
        if why is None:
            why = self._smoke(requested, needs, dtype=cast)
        if why is not None:
            alternatives = [n for n, v in verdicts.items() if v is None and n != requested]
            raise ConfigError(
                f"attention backend {requested} requested for {component} ({source}) cannot run "
                f"on {self.platform.describe()} for {_describe(needs)}: {why}. "
                f"Usable alternatives: {', '.join(alternatives) or 'none'}")
        reason = source
        if cast is not None:
            reason = f"{source} (computes in {dtype_name(cast)})"
            log.warning("%s: %s takes no %s; inputs are cast to %s (explicit override)",
                        component, requested, dtype_name(needs.dtype), dtype_name(cast))
        return self._selection(component, requested, reason, source, needs, verdicts, notes,
                               cast_dtype=cast, supported=supported)

    def _smoke(self, name: str, needs: Needs, dtype: torch.dtype | None = None) -> str | None:
        if not self.smoke:
            return None
        backend = registry.probe(name).backend
        return smoke_test(backend, needs, torch.device(self.platform.torch_device_type), dtype or needs.dtype)

    def _selection(self, component, name, reason, source, needs, verdicts, notes, *, cast_dtype=None, supported=None):
        rejected = {}
        for other, why in verdicts.items():
            if other != name:
                rejected[other] = notes.get(other) or why or f"usable; not chosen ({name} wins: {source})"
        return Selection(component, name, reason, source, needs, rejected, cast_dtype, supported)

    def _report(self, selection: Selection) -> None:
        previous = self._by_component.get(selection.component)
        self._by_component.setdefault(selection.component, selection)
        if previous is not None and previous.backend == selection.backend:
            return
        if previous is not None:
            # Layers of one component with different needs (e.g. a windowed layer) chose differently.
            log.warning("attention %s: another layer kind uses %s (%s); exported choice stays %s",
                        selection.component, selection.backend, selection.reason, previous.backend)
            return
        log.info("attention %s -> %s (%s)", selection.component, selection.backend, selection.reason)
        self.metrics.set_attention_backend(selection.component, selection.backend, selection.reason)

    @property
    def metrics(self):
        if self._metrics is not None:
            return self._metrics
        from modalmesh import metrics

        return metrics.current()

    def selections(self) -> list[Selection]:
        """The exported choice per component, in the order components were built."""
        return list(self._by_component.values())

    def unused_overrides(self) -> list[str]:
        """Components named in --attention-backend that no layer was built for (likely a typo)."""
        return sorted(set(self.overrides.per_component) - set(self._by_component))

    # ---- per call ---------------------------------------------------------------------------
    def route(self, selection: Selection, layout: str, dtype: torch.dtype, device: torch.device,
              page_size: int | None = None, causal_offset: bool = False) -> Route:
        """The backend for one call; cached, so the steady state is one dict lookup."""
        key = (id(selection), layout, dtype, device.type, page_size, causal_offset)
        route = self._routes.get(key)
        if route is None:
            with self._lock:
                route = self._routes.get(key) or self._route(selection, layout, dtype, device, page_size,
                                                             causal_offset)
                self._routes[key] = route
        return route

    def _route(self, selection, layout, dtype, device, page_size, causal_offset) -> Route:
        needs = dataclasses.replace(selection.needs, layouts=(layout,), dtype=dtype, causal_offset=causal_offset,
                                    page_size=page_size or selection.needs.page_size)
        platform = self.platform if device.type == self.platform.torch_device_type else detect_platform(device)
        chosen = registry.probe(selection.backend)
        why = self.verdict(selection.backend, needs, platform=platform, ignore_dtype=True)
        if why is None:
            if self.verdict(selection.backend, needs, platform=platform) is None:
                return Route(chosen.backend)
            if selection.source == COMPONENT_OVERRIDE and chosen.spec.cast_dtype is not None:
                return Route(chosen.backend, cast_dtype=chosen.spec.cast_dtype)
            reason = f"dtype {dtype_name(dtype)}"
        elif layout not in selection.needs.layouts:
            reason = f"layout {layout}"
        elif page_size is not None and page_size != selection.needs.page_size:
            reason = f"page size {page_size}"
        elif causal_offset:
            reason = "causal offset"
        elif platform != self.platform:
            reason = f"device {device.type}"
        else:
            reason = "capability"
        order, _ = ranking.rank(platform, layout, needs.max_head_dim, self.rules, dtype=needs.dtype,
                                seqlen=needs.seqlen_hint)
        for name in order:
            if self.verdict(name, needs, supported=selection.supported, platform=platform) is None:
                log.warning("attention %s: %s cannot take a %s call (%s); rerouted to %s",
                            selection.component, selection.backend, _describe(needs), reason, name)
                return Route(registry.probe(name).backend, rerouted_from=selection.backend, reason=reason)
        raise ValueError(f"attention {selection.component}: no backend can serve a {_describe(needs)} call")

    def count_reroute(self, selection: Selection, route: Route) -> None:
        if route.counter is None:
            route.counter = self.metrics.attention_fallback_total.labels(
                component=selection.component, **{"from": route.rerouted_from, "to": route.backend.name,
                                                   "reason": route.reason})
        route.counter.inc()


def _check_names(names, what: str) -> tuple[str, ...]:
    normalized = tuple(normalize_name(n) for n in names)
    unknown = [n for n in normalized if n not in registry.names()]
    if unknown:
        raise ValueError(f"{what} backends {unknown} are not registered; valid: {', '.join(registry.names())}")
    return normalized


def _describe(needs: Needs) -> str:
    parts = [dtype_name(needs.dtype), f"hd{needs.head_dim}", "/".join(needs.layouts)]
    if needs.v_head_dim and needs.v_head_dim != needs.head_dim:
        parts.append(f"v_hd{needs.v_head_dim}")
    if needs.causal:
        parts.append("causal")
    if needs.window is not None:
        parts.append(f"window{tuple(needs.window)}")
    if needs.gqa:
        parts.append("gqa")
    if needs.page_size:
        parts.append(f"page{needs.page_size}")
    return " ".join(parts)


# ---- the process's selector ------------------------------------------------------------------
_CURRENT: AttentionSelector | None = None
_CURRENT_LOCK = threading.Lock()


def configure(spec: str | None = None, **kwargs) -> AttentionSelector:
    """Build the process's selector from --attention-backend (None: MODALMESH_ATTENTION_BACKEND).

    Services call this at start-up; a bad or unrunnable override raises ConfigError here.
    """
    global _CURRENT
    selector = AttentionSelector(spec, **kwargs)
    with _CURRENT_LOCK:
        _CURRENT = selector
    return selector


def current_selector() -> AttentionSelector:
    """The process's selector (configured from the environment on first use)."""
    global _CURRENT
    with _CURRENT_LOCK:
        if _CURRENT is None:
            _CURRENT = AttentionSelector()
        return _CURRENT


def select_backend(component: str, needs: Needs, **kwargs) -> Selection:
    return current_selector().select(component, needs, **kwargs)
