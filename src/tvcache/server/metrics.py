"""Prometheus text exposition of the server's counters and a lookup latency histogram (no dependency)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

__all__ = ["Histogram", "label_expositions", "render"]

BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Histogram:
    """Cumulative-bucket histogram of seconds, per label value."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, seconds: float) -> None:
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = [0] * (len(self.buckets) + 1)
            self.sums[label] = 0.0
        counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sums[label] += seconds

    def lines(self, name: str, label_name: str) -> list[str]:
        lines = [f"# TYPE {name} histogram"]
        for label, counts in sorted(self.counts.items()):
            running = 0
            for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
                running += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'{name}_bucket{{{label_name}="{label}",le="{le}"}} {running}')
            lines.append(f'{name}_sum{{{label_name}="{label}"}} {self.sums[label]!r}')
            lines.append(f'{name}_count{{{label_name}="{label}"}} {running}')
        return lines


_GAUGES = {"tasks", "nodes", "snapshots", "snapshot_bytes", "claims_active", "leases_active", "nondeterministic_tools"}
_GAUGES |= {"wire_envs", "wire_envs_over_budget_leased", "wire_envs_pending_removal", "wire_leases"}


def render(stats: dict[str, Any], histogram: Histogram, requests: dict[str, int]) -> str:
    lines: list[str] = []
    for key, value in stats.items():
        name = f"tvcache_{key}" if key in _GAUGES else f"tvcache_{key}_total"
        kind = "gauge" if key in _GAUGES else "counter"
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {value}")
    lines.append("# TYPE tvcache_http_requests_total counter")
    for status, count in sorted(requests.items()):
        lines.append(f'tvcache_http_requests_total{{status="{status}"}} {count}')
    lines.extend(histogram.lines("tvcache_lookup_seconds", "route"))
    return "\n".join(lines) + "\n"


def label_expositions(texts: Mapping[str, str], *, label: str) -> list[str]:
    """Several processes' ``render`` output as the lines of one exposition: every sample gains ``label="<key
    of texts>"`` (first among its labels) and each metric family is written once, its samples from all processes
    together under its ``# TYPE`` line, as the text format requires. Only parses what ``render`` writes."""
    kinds: dict[str, str] = {}
    samples: dict[str, list[str]] = {}
    for value, text in texts.items():
        family: list[str] | None = None
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                kinds.setdefault(name, kind)
                family = samples.setdefault(name, [])
            elif line and not line.startswith("#") and family is not None:
                family.append(_add_label(line, label, value))
    lines: list[str] = []
    for name, kind in kinds.items():
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples[name])
    return lines


def label_value(value: str) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _add_label(sample: str, label: str, value: str) -> str:
    pair = f'{label}="{label_value(value)}"'
    end = len(sample.split(" ", 1)[0].split("{", 1)[0])  # a metric name holds neither "{" nor " "
    if sample[end : end + 1] == "{":
        return f"{sample[: end + 1]}{pair},{sample[end + 1 :]}"
    return f"{sample[:end]}{{{pair}}}{sample[end:]}"
