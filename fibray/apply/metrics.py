"""Prometheus text exposition of apply()'s counters: per definition, per solution, per artifact.

`prometheus_text(stats())` is what a /metrics endpoint returns (text format 0.0.4). It reads a
stats snapshot only; nothing here runs on the call path.
"""

from __future__ import annotations

from fibray.apply.runtime import ApplyStats


def _labels(**labels: str) -> str:
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def prometheus_text(stats: ApplyStats | None) -> str:
    """The counters as Prometheus text; an empty exposition when apply is not enabled."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{_labels(**labels)} {value:g}" for labels, value in samples)

    if stats is None:
        return ""
    family("fibray_apply_enabled", "gauge", "1 while this runtime dispatches calls.", [({}, float(stats.enabled))])
    family("fibray_apply_calls_total", "counter", "Calls per definition by how they were answered.", [
        ({"definition": d, "kind": k}, v) for d, s in sorted(stats.definitions.items())
        for k, v in (("hit", s.hits), ("bucketed", s.bucketed), ("miss", s.misses), ("fallback", s.fallbacks))])
    family("fibray_apply_solution_calls_total", "counter", "Calls a substituted solution answered.",
           [({"solution": n}, v) for n, v in sorted(stats.solution_calls.items())])
    family("fibray_apply_switched_off", "gauge", "1 for a solution whose circuit breaker tripped.",
           [({"solution": n}, 1) for n in sorted(stats.switched_off)])
    arts = sorted(stats.artifacts.values(), key=lambda a: (a.definition, a.solution))
    calls, demoted, p99 = [], [], []
    for a in arts:
        base = {"artifact": a.artifact_id, "definition": a.definition, "solution": a.solution, "stage": a.stage}
        c = a.counters
        kinds = [("served", a.calls)]
        if c is not None:
            kinds += [("shadow", c.shadow_calls), ("baseline", c.baseline_calls), ("compared", c.compared),
                      ("mismatch", c.mismatches), ("exception", c.exceptions), ("non_finite", c.non_finite)]
            p99 += [({**base, "of": "artifact"}, c.p99_ms / 1e3) for _ in [0] if c.p99_ms is not None]
            p99 += [({**base, "of": "baseline"}, c.baseline_p99_ms / 1e3) for _ in [0] if c.baseline_p99_ms is not None]
        calls += [({**base, "kind": k}, v) for k, v in kinds]
        demoted.append((base, float(a.demoted is not None)))
    family("fibray_apply_artifact_calls_total", "counter",
           "Calls of a promoted artifact: served, run in shadow, answered by its baseline, compared, mismatched, failed.",
           calls)
    family("fibray_apply_artifact_demoted", "gauge", "1 once the artifact was demoted in this process.", demoted)
    family("fibray_apply_artifact_p99_seconds", "gauge",
           "P99 latency over the last window of compared calls, of the artifact and of its baseline.", p99)
    return "\n".join(lines) + "\n"
