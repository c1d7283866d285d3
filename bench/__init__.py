"""What the benches share."""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nearest rank); NaN for none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")
