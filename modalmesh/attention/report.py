"""The selector's decisions as the Info RPC carries them (pb.AttentionChoice per component)."""

from __future__ import annotations

from modalmesh.attention.selector import AttentionSelector, Selection, current_selector


def attention_choice(selection: Selection):
    from modalmesh import pb  # generated stubs: imported here so the attention package works without them

    return pb.AttentionChoice(
        component=selection.component,
        backend=selection.backend,
        reason=selection.reason,
        rejected=[pb.BackendRejection(backend=name, reason=why) for name, why in selection.rejected.items()],
    )


def attention_choices(selector: AttentionSelector | None = None) -> list:
    """For ``ServiceInfo(attention=...)``: one AttentionChoice per component built so far."""
    selector = selector or current_selector()
    return [attention_choice(s) for s in selector.selections()]
