"""Start, stop and describe a service: a Ray cluster (joined, or a local head started in its own
process group), the detached coordinator actor and its slots, and optionally the HTTP front.

Each step of a start is timed, so the command says where its seconds went.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from fibray.serve.config import ServeConfig
from fibray.serve.state import start_head, stop_head
from fibray.sweep.service import (NAMESPACE, ServiceError, ServiceState, auth_mode, find_coordinator, join, read_state,
                                  remove_state, state_dir, write_state)
from fibray.sweep.config import ConfigError

_CALL_DEADLINE_S = 120.0
"""Deadline of one call to the coordinator from these commands (status, stop)."""


def _gpus_for_local_head(cfg: ServeConfig) -> int:
    from fibray.workers.start import visible_gpu_count

    real = visible_gpu_count()
    if real and cfg.cluster.num_gpus and cfg.cluster.num_gpus > real:
        raise ConfigError(f"cluster.num_gpus: {cfg.cluster.num_gpus} requested but this machine has {real} GPU(s)")
    return (cfg.cluster.num_gpus or real) if real else (cfg.cluster.num_gpus or 2)


def _absolute(cfg: ServeConfig) -> ServeConfig:
    """Paths as the coordinator (another process, another cwd) must see them."""
    store = cfg.store.model_copy(update={"root": str(Path(cfg.store.root).resolve())})
    ds = cfg.dataset
    if ds.root:
        ds = ds.model_copy(update={"root": str(Path(ds.root).resolve())})
    return cfg.model_copy(update={"store": store, "dataset": ds})


def start_service(cfg: ServeConfig) -> tuple[dict, dict[str, float]]:
    """Start the service named cfg.service.name; returns its status and the seconds of each step.
    ServiceError if one of that name is running already or it cannot start (nothing is left running)."""
    import ray

    cfg = _absolute(cfg)
    name, sd = cfg.service.name, cfg.service.state_dir
    steps: dict[str, float] = {}
    t = time.monotonic()
    previous = read_state(name, sd)
    if previous is not None and previous.head_alive():
        if find_coordinator(name, previous.address, sd) is not None:
            raise ServiceError(f"service {name!r} is already running on {previous.address} "
                               f"(python -m fibray.serve --status service.name={name})")
        ray.shutdown()
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    head_pid = temp = None
    coordinator = None
    try:
        if not address:
            head_pid, address, temp = start_head(_gpus_for_local_head(cfg), cfg.cluster.num_cpus,
                                                 state_dir(sd) / f"{name}.head.log")
            steps["ray_head"] = time.monotonic() - t
            t = time.monotonic()
        auth = auth_mode()
        join(address, auth, cfg.cluster.log_to_driver)
        steps["join"] = time.monotonic() - t
        t = time.monotonic()
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            raise ServiceError(f"service {name!r} is already running on {address}")
        except ValueError:
            pass
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from fibray.serve.coordinator import Coordinator

        # on this node (the head it started, or the node it joined from), never on a GPU node that may
        # be lost: the coordinator holds the queue and the slots it restores when their node goes
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        coordinator = ray.remote(Coordinator).options(
            name=name, namespace=NAMESPACE, lifetime="detached", max_concurrency=10_000, num_cpus=0, max_restarts=0,
            scheduling_strategy=here,
        ).remote(cfg.model_dump(mode="json"))
        deadline = cfg.service.ready_deadline_s
        status = ray.get(coordinator.ready.remote(deadline), timeout=deadline + 60)
        if not any(s["phase"] == "ready" for s in status["slots"]):
            raise ServiceError(f"service {name!r}: no slot started within service.ready_deadline_s={deadline:g}s "
                               "(see the Ray logs of the SlotActor)")
        steps["coordinator_and_slots"] = time.monotonic() - t
        t = time.monotonic()
        http_url = None
        if cfg.service.http.enabled:
            from fibray.serve.http import start_http

            http_url = start_http(cfg)
            steps["http"] = time.monotonic() - t
        write_state(ServiceState(name=name, address=address, auth_mode=auth, head_pid=head_pid, temp_dir=temp,
                                 started_at=time.time(), http_url=http_url), sd)
        status["http_url"], status["address"] = http_url, address
        return status, steps
    except BaseException:
        if coordinator is not None:
            ray.kill(coordinator, no_restart=True)
        ray.shutdown()
        if head_pid is not None:
            stop_head(head_pid)
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _coordinator(name: str, address: Optional[str], sd: Optional[str]) -> Any:
    coordinator = find_coordinator(name, address, sd)
    if coordinator is None:
        raise ServiceError(f"no service named {name!r} is running (python -m fibray.serve service.name={name} starts one)")
    return coordinator


def service_status(name: str, address: Optional[str] = None, sd: Optional[str] = None) -> dict:
    import ray

    status = ray.get(_coordinator(name, address, sd).status.remote(), timeout=_CALL_DEADLINE_S)
    state = read_state(name, sd)
    status["http_url"] = state.http_url if state else None
    status["address"] = state.address if state else address
    return status


def stop_service(name: str, address: Optional[str] = None, sd: Optional[str] = None) -> dict:
    """Stop the service: its slots end, its records are published, its HTTP front and (if it
    started one) its Ray head go. ServiceError if there is none of that name."""
    import ray

    state = read_state(name, sd)
    coordinator = find_coordinator(name, address, sd) if state is None or state.head_alive() else None
    if coordinator is None and state is None:
        raise ServiceError(f"no service named {name!r} is running")
    status: dict = {"name": name}
    if coordinator is not None:
        try:
            status = ray.get(coordinator.stop.remote(), timeout=_CALL_DEADLINE_S)
        finally:
            ray.kill(coordinator, no_restart=True)
        if state is not None and state.http_url:
            from ray import serve

            serve.shutdown()
    if ray.is_initialized():
        ray.shutdown()
    if state is not None and state.head_pid is not None:
        stop_head(state.head_pid)
        if state.temp_dir:
            shutil.rmtree(state.temp_dir, ignore_errors=True)
    remove_state(name, sd)
    return status


def _span(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def format_status(st: dict) -> str:
    """The status as the few lines `--status` prints."""
    slots = st["slots"]
    ready = sum(s["phase"] == "ready" for s in slots)
    lines = [f"service {st['name']!r}: up {_span(st['uptime_s'])} on {st.get('address') or '?'}"
             + (f", http {st['http_url']}" if st.get("http_url") else ""),
             f"slots: {ready}/{len(slots)} ready, {st['lanes']} lane(s) each, isolation {st['isolation']}"]
    for s in slots:
        lines.append(f"  gpu{s['index']}: {s['phase']}" + (f" {s['name']} on {s['device']}, {s['inflight']} in flight"
                                                          if s["phase"] == "ready" else ""))
    lines.append(f"queue: {st['queue_depth']} waiting (max {st['max_queue']}, {st['max_queue_per_client']} per client), "
                 f"{st['in_flight']} in flight, {st['clients']} client(s)")
    lines.append(f"answered {st['answered']} ({st['from_store']} from the store, {st['deduplicated']} joined a running job), "
                 f"throughput {st['throughput_eval_s']:.2f} eval/s over the last minute")
    q = st["quarantined"]
    lines.append("quarantined: " + (", ".join(f"{x['solution']} (sweep {x['sweep']})" for x in q) if q else "none"))
    lines.append(f"slot restarts {st['slot_restarts']}, restores {st['slot_restores']}, jobs re-run {st['requeued']}; "
                 f"writing sweeps: {', '.join(st['writers']) or 'none'}")
    return "\n".join(lines)
