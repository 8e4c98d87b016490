"""The service's HTTP front, a Ray Serve deployment: POST /evaluate (a solution, a definition, workloads,
settings -> JSON verdicts) and GET /status. A malformed, invalid or oversized request gets a 4xx naming
the field and nothing is queued; a full queue is 503 (a request's jobs are all admitted, or none)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from fibray.serve.config import ServeConfig
from fibray.sweep.service import NAMESPACE


class HttpFront:
    """One Serve replica: validates requests, submits them to the coordinator, waits for verdicts."""

    def __init__(self, raw: dict) -> None:
        import ray

        from fibray.dataset import load_dataset

        self.cfg = cfg = ServeConfig.model_validate(raw)
        self.coordinator = ray.get_actor(cfg.service.name, namespace=NAMESPACE)
        self.dataset = load_dataset(cfg.dataset.root, workload_set=cfg.dataset.workload_set) if cfg.dataset.root else None
        self.defaults = cfg.eval.model_dump(mode="json")
        self._ids = 0

    async def __call__(self, request: Any) -> Any:
        path, method = request.url.path.rstrip("/") or "/", request.method
        if path == "/status" and method == "GET":
            return _json(200, await self.coordinator.status.remote())
        if path == "/evaluate" and method == "POST":
            return await self._evaluate(request)
        if path in ("/status", "/evaluate"):
            return _error(405, "method", f"{method} is not allowed on {path}")
        return _error(404, "path", f"no route {path!r} (POST /evaluate, GET /status)")

    async def _evaluate(self, request: Any) -> Any:
        from fibray.client.request import RequestError, resolve_jobs

        limit = self.cfg.service.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return _error(413, "body", f"{declared} bytes exceeds the limit of {limit} (service.http.max_body_bytes)")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return _error(413, "body", f"more than {limit} bytes (service.http.max_body_bytes)")
        try:
            data = json.loads(body)
        except ValueError as e:
            return _error(400, "body", f"not valid JSON ({e})")
        if isinstance(data, dict) and isinstance(data.get("settings"), dict):
            data = {**data, "settings": {**self.defaults, **data["settings"]}}
        elif isinstance(data, dict) and "settings" not in data:
            data = {**data, "settings": self.defaults}
        try:
            jobs = resolve_jobs(data, sweep=self.cfg.service.http.sweep, dataset=self.dataset,
                                dataset_root=self.cfg.dataset.root, max_workloads=self.cfg.service.http.max_workloads)
        except RequestError as e:
            return _error(422, e.field, str(e))
        self._ids += 1
        client = request.headers.get("x-fibray-client") or f"http:{request.client.host if request.client else '?'}"
        answer = await self.coordinator.submit.remote(client, jobs, self.cfg.store.root, True)
        if answer["refused"]:
            if answer["refused"].startswith("store:"):
                return _error(409, "sweep", answer["refused"])
            return _error(503, None, answer["refused"], {"Retry-After": "1"})
        results = await asyncio.gather(*(self.coordinator.result.remote(t) for t in answer["tickets"]))
        return _json(200, {
            "sweep": jobs[0].sweep, "definition": jobs[0].definition.name, "solution": jobs[0].solution.name,
            "verdicts": [{"workload": job.workload.uuid, "job_id": job.job_id, "status": r.evaluation.status.value,
                          "reason": r.evaluation.reason, "attempt": r.attempt, "evaluation": r.evaluation.to_json_dict()}
                         for job, r in zip(jobs, results)]})


def _json(status: int, payload: Any, headers: Optional[dict] = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(payload, status_code=status, headers=headers)


def _error(status: int, field: Optional[str], message: str, headers: Optional[dict] = None) -> Any:
    return _json(status, {"error": message, "field": field}, headers)


def start_http(cfg: ServeConfig) -> str:
    """Deploy the HTTP front on Ray Serve (its proxy on service.http.host:port); returns its URL."""
    from ray import serve

    h = cfg.service.http
    serve.start(http_options={"host": h.host, "port": h.port})
    app = serve.deployment(HttpFront, name=f"{cfg.service.name}-http", num_replicas=1,
                           ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000).bind(cfg.model_dump(mode="json"))
    serve.run(app, name=f"{cfg.service.name}-http", route_prefix="/")
    return f"http://{h.host}:{h.port}"
