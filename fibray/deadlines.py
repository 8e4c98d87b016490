"""Every fixed deadline and polling period of fibray, in seconds, in one commented place.

The deadlines a user may change are config keys (`eval.build_deadline_s`, `eval.run_deadline_s`,
`cluster.start_deadline_s`); these are the ones that bound fibray's own machinery. This module
imports nothing, so every layer (the executor process included) may read it.
"""

from __future__ import annotations

# -- the driver (fibray.sweep) ------------------------------------------------------------------
SLOT_START_S = 180.0
"""A slot actor's start (Ray placement, imports, first executors warm) before it is given up
(the default of `cluster.start_deadline_s`)."""
POOL_POLL_S = 0.5
"""Longest the scheduling loop waits on Ray before it checks the slots' deadlines again."""
READY_REF_S = 10.0
"""`ray.get` of a result `ray.wait` already reported ready: only a transfer is left."""
SLOT_STATS_S = 30.0
"""The slots' counters, asked for at the end of a sweep."""
POOL_SHUTDOWN_S = 30.0
"""Slots retiring their executors at the end of a sweep, before their actors are killed."""
COMPILE_AHEAD_GRACE_S = 120.0
"""Beyond `eval.build_deadline_s`, for the CPU tasks that compile CUDA/C++ ahead of the GPUs
(scheduling and a cache lock held by another compiler)."""

# -- a slot's supervisor (fibray.workers) ---------------------------------------------------------
EXECUTOR_READY_S = 180.0
"""An executor's start (imports, device context) until it says it is ready."""
HEALTH_S = 30.0
"""The health check after a job (canary kernel, synchronise, memory) and the reply to `finish`."""
CLOSED_CHANNEL_EXIT_S = 5.0
"""An executor that closed its channel mid-job, to exit and say how it ended, before it is killed."""
RETIRE_EXIT_S = 5.0
"""An executor asked to exit, before its process tree is killed."""
OUTPUT_DRAIN_S = 1.0
"""The thread reading a retired executor's output, to read its last bytes into the log tail."""
QUIESCE_ACK_S = 0.25
"""Entering a timed window, how long the other executors get to synchronise their device work and
ack before they are stopped anyway (fibray.workers.quiesce): the window never waits longer."""
PARENT_WATCH_S = 1.0
"""How often an executor checks that its supervisor is alive (it ends soon after it is not)."""

# -- builds (fibray.compile) ------------------------------------------------------------------------
COMPILE_S = 600.0
"""One compile (nvcc, the host compiler) where the caller gives no deadline of its own."""
BUILD_LOCK_S = 900.0
"""Waiting for another process that holds a build-cache key's lock (it is compiling that key)."""
BUILD_LOCK_GRACE_S = 60.0
"""Beyond the compile's own deadline, for the lock of a key another process is compiling."""
BUILD_LOCK_POLL_S = 0.2
"""How often a waiting process tries a held build-cache lock again."""
TOOL_VERSION_S = 60.0
"""`nvcc --version` / `c++ --version`, for the build-cache key."""
