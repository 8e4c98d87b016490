"""Promotion: from a PASSED sweep result to a served kernel, gate by gate, recorded per artifact.

`python -m fibray.promote` runs the gates (hidden workloads, compute-sanitizer, shared-memory
poison, fresh-process re-benchmark), records reviews and rollout steps, and reports stages; the
records live in the store's promotions table (fibray.store.promotions). This package exports only
the light identity helpers; the gates (which start sweeps) are in fibray.promote.gates.
"""

from fibray.promote.artifact import (
    ENVIRONMENT_FIELDS,
    Artifact,
    artifact_of,
    driver_version,
    environment_key,
    environment_record,
    recipe_hash,
    running_environment_record,
)
from fibray.store.promotions import (
    AUTOMATED_GATES,
    SANITIZER_GATES,
    SERVING_STAGES,
    Gate,
    Outcome,
    PromotionLog,
    PromotionRecord,
    Stage,
)

__all__ = [
    "AUTOMATED_GATES", "ENVIRONMENT_FIELDS", "SANITIZER_GATES", "SERVING_STAGES", "Artifact", "Gate", "Outcome",
    "PromotionLog", "PromotionRecord", "Stage", "artifact_of", "driver_version", "environment_key",
    "environment_record", "recipe_hash", "running_environment_record",
]
