"""The agent loop: generators (shell, callable, built-in search), budgets, records in the store, resume,
and the public/hidden split (hidden workloads never reach a generator, and score the best at the end)."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fibray.dataset import load_dataset
from fibray.evolve import (
    CallableGenerator, PoolBackend, SearchGenerator, ShellGenerator, TuningTemplate, parse_output,
    run_evolve, split_workloads, validate_evolve_config,
)
from fibray.evolve.ledger import Ledger
from fibray.schema import Solution
from fibray.schema.reasons import GeneratorReason
from fibray.store import LOOP_COLUMNS, TraceStore, scan
from fibray.sweep.config import ConfigError

from _sweep_helpers import REPO, reachable_tmpdir

CORE = REPO / "datasets" / "core"
AGENT = Path(__file__).resolve().parent / "data" / "evolve" / "shell_generator.py"
TEMPLATE = REPO / "examples" / "evolve" / "rmsnorm_untuned.py"
DEF = "rmsnorm_h4096"


def _cfg(store: Path, run_id: str, **evolve) -> dict:
    budget = {"max_rounds": 3, "candidates": 2, **evolve.pop("budget", {})}
    return validate_evolve_config({
        "dataset": {"root": str(CORE), "definitions": [DEF], "workload_set": "cpu_small",
                    "max_workloads_per_definition": 2},
        "store": {"root": str(store)}, "cluster": {"num_gpus": 1},
        "eval": {"warmup": 0, "iterations": 1, "trials": 1},
        "runner": {"spare_isolated": 0},
        "evolve": {"run_id": run_id, "progress": False, "budget": budget, "split": {"hidden_fraction": 0.5},
                   "generator": evolve.pop("generator", {"kind": "shell", "command": [sys.executable, str(AGENT)]}),
                   **evolve},
    })


def _shell(*args: str) -> dict:
    return {"kind": "shell", "command": [sys.executable, str(AGENT), *args], "deadline_s": 60}


# -- fast: no Ray ----------------------------------------------------------------------------
KNOBBY = '''import triton
import triton.language as tl

TUNE = {"ROWS": [1, 2, 4]}
ROWS = 1
CHUNK = 32  # fibray-tune: CHUNK=[32, 64]


@triton.jit
def _k(x_ptr, BLOCK_SIZE: tl.constexpr):
    pass


def run(x, y):
    _k[(1,)](x, BLOCK_SIZE=128, num_warps=4, num_stages=2, other=3)
'''


def _template(text: str = KNOBBY) -> TuningTemplate:
    return TuningTemplate(Solution.model_validate({
        "name": "t", "definition": DEF, "author": "t",
        "spec": {"language": "triton", "target_hardware": ["cpu"], "entry_point": "k.py::run"},
        "sources": [{"path": "k.py", "content": text}]}))


def test_search_finds_declared_knobs_and_block_warps_stages_launch_arguments() -> None:
    t = _template()
    assert set(t.knobs) == {"ROWS", "CHUNK", "BLOCK_SIZE", "num_warps", "num_stages"}  # `other=3` is no knob
    assert t.knobs["CHUNK"].values == [32, 64] and t.knobs["ROWS"].values == [1, 2, 4]
    assert t.default == {"ROWS": 1, "CHUNK": 32, "BLOCK_SIZE": 128, "num_warps": 4, "num_stages": 2}
    src = t.render({**t.default, "CHUNK": 64, "BLOCK_SIZE": 256, "num_warps": 8}, name="x").sources[0].content
    assert "CHUNK = 64  # fibray-tune" in src and "BLOCK_SIZE=256, num_warps=8, num_stages=2, other=3" in src


def test_a_declared_knob_that_nothing_holds_is_a_template_error() -> None:
    with pytest.raises(ValueError, match="knob 'WIDTH' is declared"):
        _template(KNOBBY.replace("CHUNK=[32, 64]", "CHUNK=[32, 64] WIDTH=[1, 2]"))


def test_search_proposes_no_configuration_that_breaks_a_template_constraint(tmp_path: Path) -> None:
    text = KNOBBY.replace("CHUNK = 32  # fibray-tune: CHUNK=[32, 64]",
                          "CHUNK = 32  # fibray-tune: CHUNK=[32, 64]\n# fibray-tune-if: ROWS * CHUNK <= 64 * num_warps // 4")
    t = _template(text)
    assert [c.text for c in t.constraints] == ["ROWS * CHUNK <= 64 * num_warps // 4"]
    assert t.allows({"ROWS": 2, "CHUNK": 32}) and not t.allows({"ROWS": 4, "CHUNK": 64, "num_warps": 4})
    path = tmp_path / "k.py"
    path.write_text(text)
    gen = SearchGenerator({"*": str(path)}, seed=3)
    feedback, proposed = [], []
    for rnd in range(1, 6):
        out = gen.generate({"definition": {"name": DEF}, "round": rnd, "candidates": 6, "feedback": feedback})
        configs = [json.loads(it["description"].split(": ", 1)[1]) for it in out.items]
        proposed += configs[1:] if rnd == 1 else configs  # round 1 starts from the template as written
        feedback.append({"round": rnd, "candidates": [{"solution": it["name"], "description": it["description"],
                                                       "speedup": 1.0} for it in out.items]})
    assert len(proposed) > 10 and all(c["ROWS"] * c["CHUNK"] <= 64 * c["num_warps"] // 4 for c in proposed)
    assert any(c["ROWS"] * c["CHUNK"] > 64 for c in proposed)  # allowed with num_warps >= 8: not all refused


@pytest.mark.parametrize("line, error", [("ROWS * WIDTH < 4", "names \\['WIDTH'\\]"),
                                         ("__import__('os').system('x')", "only knob names"),
                                         ("ROWS <", "fibray-tune-if")])
def test_a_constraint_that_is_not_arithmetic_over_knobs_is_a_template_error(line: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        _template(KNOBBY + f"# fibray-tune-if: {line}\n")


def test_search_proposes_unseen_configurations_and_mutates_the_best() -> None:
    gen = SearchGenerator({"rmsnorm_*": str(TEMPLATE)}, seed=1, explore=0.0)
    definition = load_dataset(CORE).definitions[DEF].to_json_dict()
    first = gen.generate({"definition": definition, "round": 1, "candidates": 4, "feedback": []})
    assert len(first.items) == 4 and first.items[0]["parent"] == f"{DEF}_rmsnorm_untuned"
    assert json.loads(first.items[0]["description"].split(": ", 1)[1]) == {"BLOCK": 64, "NUM_STAGES": 1, "NUM_WARPS": 1}
    feedback = [{"round": 1, "candidates": [{"solution": it["name"], "description": it["description"],
                                             "speedup": 1.0 + i} for i, it in enumerate(first.items)]}]
    second = gen.generate({"definition": definition, "round": 2, "candidates": 4, "feedback": feedback})
    tried = {it["description"] for it in first.items}
    assert len(second.items) == 4 and not tried & {it["description"] for it in second.items}
    assert {it["parent"] for it in second.items} <= {it["name"] for it in first.items[1:]}  # the elite


def test_parse_output_accepts_a_list_an_object_or_jsonl_and_names_garbage() -> None:
    one = {"name": "a"}
    assert parse_output(json.dumps([one, one]))[0] == [one, one]
    assert parse_output(json.dumps(one))[0] == [one]
    assert parse_output(json.dumps(one) + "\n\n" + json.dumps(one) + "\n")[0] == [one, one]
    assert "neither JSON nor JSONL" in parse_output("here is your kernel")[1]
    assert "expected a solution object" in parse_output("[1, 2]")[1]


def test_a_hanging_shell_generator_is_killed_at_its_deadline_with_its_stderr_kept() -> None:
    gen = ShellGenerator([sys.executable, str(AGENT), "--hang", "1"], deadline_s=1.5)
    t0 = time.monotonic()
    out = gen.generate({"definition": {"name": DEF}, "round": 1, "candidates": 2, "best": None})
    assert out.reason is GeneratorReason.GENERATOR_TIMEOUT and time.monotonic() - t0 < 10
    assert "shell agent: round 1" in out.stderr and out.items == []


def test_a_crashing_shell_generator_and_a_raising_callable_cost_only_their_answer() -> None:
    out = ShellGenerator([sys.executable, str(AGENT), "--crash", "1"], 30).generate(
        {"definition": {"name": DEF}, "round": 1, "candidates": 2, "best": None})
    assert out.reason is GeneratorReason.GENERATOR_CRASHED and "fell over" in out.stderr
    out = CallableGenerator("json:loads", 5).generate({"round": 1})  # loads(dict) raises TypeError
    assert out.reason is GeneratorReason.GENERATOR_CRASHED and "TypeError" in out.error


def test_split_is_deterministic_and_the_splits_sidecar_wins(tmp_path: Path) -> None:
    ds = load_dataset(CORE, workload_set="cpu_small")
    a = split_workloads(ds, DEF, hidden_fraction=0.34, seed=0)
    assert len(a.hidden) == 2 and len(a.public) == 1 and a == split_workloads(ds, DEF, hidden_fraction=0.34, seed=0)
    ds.splits = {ds.workloads[DEF][0].uuid: "hidden"}
    b = split_workloads(ds, DEF, hidden_fraction=0.34, seed=0)
    assert [w.uuid for w in b.hidden] == [ds.workloads[DEF][0].uuid] and b.source == "splits/"


def test_a_bad_evolve_key_is_one_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"evolve.budget.max_rounds: .*greater than or equal to 1"):
        _cfg(tmp_path, "x", budget={"max_rounds": 0})
    with pytest.raises(ConfigError, match=r"evolve.generator: .*command: required"):
        _cfg(tmp_path, "x", generator={"kind": "shell"})


@pytest.mark.parametrize("experiment", ["evolve_smoke", "evolve_search"])
def test_the_evolve_experiments_compose_into_a_valid_config(experiment: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import fibray.evolve.__main__  # noqa: F401  (registers the fibray_root resolver)

    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        raw = compose(config_name="evolve", overrides=[f"+experiment={experiment}"])
    cfg = validate_evolve_config(OmegaConf.to_container(raw, resolve=True))
    assert cfg.evolve.generator.kind == "search"
    assert all(Path(p).is_file() for p in cfg.evolve.generator.templates.values())


def test_patience_stops_a_definition_after_k_rounds_without_improvement(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "patient", generator={"kind": "callable", "callable": "_evolve_agents:nothing"},
               budget={"max_rounds": 10, "patience": 2})
    report = run_evolve(cfg)  # nothing to evaluate: no worker ever starts
    s = report.definitions[DEF]
    assert (s.rounds, s.stop, s.best) == (2, "patience", None)
    assert [r.status for r in Ledger(tmp_path, "patient").rounds(DEF)] == ["no_candidates"] * 2


def test_the_wall_time_budget_stops_starting_rounds(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "hurried", generator={**_shell("--hang", "1"), "deadline_s": 1.5},
               budget={"max_rounds": 10, "wall_time_s": 1.0})
    s = run_evolve(cfg).definitions[DEF]
    assert (s.rounds, s.stop) == (1, "wall_time")  # the hanging round 1 used up the budget


# -- slow: real Ray, one warm pool for the module ----------------------------------------------
@pytest.fixture(scope="module")
def store() -> Path:
    return reachable_tmpdir("evolve-store-")


@pytest.fixture(scope="module")
def backend(store: Path):
    import ray

    ray.init(address="local", num_gpus=1, num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = PoolBackend(_cfg(store, "pool"))
    try:
        yield pool
    finally:
        pool.close()
        ray.shutdown()


def _rows(store: Path, run_id: str):
    import polars as pl

    return scan(store).filter(pl.col("sweep") == run_id).collect()


@pytest.mark.slow
def test_three_round_search_loop_records_round_parent_generator_and_run_id(store: Path, backend, monkeypatch,
                                                                          caplog) -> None:
    import fibray.evolve.backend

    monkeypatch.setattr(fibray.evolve.backend, "HEARTBEAT_S", 0.5)  # a batch this slow says how far it is
    cfg = _cfg(store, "search3", generator={"kind": "search", "templates": {"rmsnorm_*": str(TEMPLATE)}})
    with caplog.at_level(logging.INFO, logger="fibray.evolve.backend"):
        report = run_evolve(cfg, backend=backend)
    said = [r.getMessage() for r in caplog.records if r.name == "fibray.evolve.backend"]
    assert any(re.fullmatch(r"\d+/2 jobs of this batch done after \d+s", m) for m in said)
    assert any(re.match(rf"\d/\d jobs: {DEF}_search_r00\d_\d on \w{{8}}: PASSED", m) for m in said)
    df = _rows(store, "search3")
    public = df.filter(df["split"] == "public")
    assert set(LOOP_COLUMNS) <= set(df.columns)
    assert sorted(set(public["round"].to_list())) == [1, 2, 3] and public.height == 3 * 2 * 1
    assert set(df["generator"].to_list()) == {"search"} and set(df["run_id"].to_list()) == {"search3"}
    assert public.filter(public["round"] == 1)["parent"].to_list()[0] == f"{DEF}_rmsnorm_untuned"
    later = set(public.filter(public["round"] > 1)["parent"].to_list())
    assert later <= set(public["solution"].to_list()) | {f"{DEF}_rmsnorm_untuned"}
    s = report.definitions[DEF]
    assert s.rounds == 3 and s.stop == "max_rounds" and s.best_per_round == sorted(s.best_per_round)
    hidden = df.filter(df["split"] == "hidden")
    assert hidden["solution"].to_list() == [s.best] and s.hidden_status == "PASSED" and s.gap is not None


@pytest.mark.slow
def test_shell_generator_loop_resumes_at_the_next_round_without_repeating_work(store: Path, backend, tmp_path: Path) -> None:
    log = tmp_path / "tasks"
    run_evolve(_cfg(store, "shell", generator=_shell("--log", str(log)), budget={"max_rounds": 2}), backend=backend)
    first = _rows(store, "shell")
    report = run_evolve(_cfg(store, "shell", generator=_shell("--log", str(log)), budget={"max_rounds": 3}),
                        backend=backend)
    df = _rows(store, "shell")
    assert sorted(p.name for p in log.iterdir()) == [f"task-{DEF}-{r}.json" for r in (1, 2, 3)]  # asked once per round
    public = df.filter(df["split"] == "public")
    assert sorted(set(public["round"].to_list())) == [1, 2, 3] and public.height == 3 * 2
    assert df["job_id"].n_unique() == df.height and set(first["job_id"].to_list()) < set(df["job_id"].to_list())
    assert set(df["generator"].to_list()) == {"shell:" + " ".join([sys.executable, str(AGENT), "--log", str(log)])}
    assert report.definitions[DEF].rounds == 3
    task3 = json.loads((log / f"task-{DEF}-3.json").read_text())
    assert [r["round"] for r in task3["feedback"]] == [1, 2] and task3["best"]["solution"]["sources"]
    fb = task3["feedback"][0]["candidates"][0]
    assert fb["status"] == "PASSED" and fb["workloads"][0]["latency_ms"] > 0 and fb["speedup"] > 0


@pytest.mark.slow
def test_hidden_workloads_never_appear_in_the_task(store: Path, backend, tmp_path: Path) -> None:
    log = tmp_path / "tasks"
    run_evolve(_cfg(store, "hidden", generator=_shell("--log", str(log)), budget={"max_rounds": 2}), backend=backend)
    split = json.loads((Ledger(store, "hidden").root / "run.json").read_text())["split"][DEF]
    assert split["hidden"] and split["public"]
    for path in log.iterdir():
        text = path.read_text()
        assert not any(uuid in text for uuid in split["hidden"])
        assert [w["uuid"] for w in json.loads(text)["workloads"]] == split["public"]
    df = _rows(store, "hidden")
    assert set(df.filter(df["split"] == "hidden")["workload_uuid"].to_list()) == set(split["hidden"])


@pytest.mark.slow
def test_hanging_garbage_and_crashing_generators_cost_their_round_only(store: Path, backend) -> None:
    gen = {**_shell("--hang", "1", "--garbage", "2", "--crash", "3", "--wrong", "4"), "deadline_s": 3}
    report = run_evolve(_cfg(store, "faulty", generator=gen, budget={"max_rounds": 4, "candidates": 3}), backend=backend)
    rounds = Ledger(store, "faulty").rounds(DEF)
    assert [r.status for r in rounds] == ["generator_timeout", "generator_garbage", "generator_crashed", "ok"]
    assert "fell over" in rounds[2].stderr and not any(r.candidates for r in rounds[:3])
    df = _rows(store, "faulty")
    public = df.filter(df["split"] == "public")
    assert set(public["round"].to_list()) == {4}
    assert sorted(public["status"].to_list()) == ["INCORRECT_NUMERICAL", "PASSED", "PASSED"]
    assert report.definitions[DEF].rounds == 4 and report.definitions[DEF].best is not None


@pytest.mark.slow
def test_a_loop_killed_before_recording_its_round_re_evaluates_the_same_candidates(store: Path, backend,
                                                                                  tmp_path: Path) -> None:
    log = tmp_path / "tasks"
    cfg = _cfg(store, "killed", generator=_shell("--log", str(log)), budget={"max_rounds": 2})
    run_evolve(cfg, backend=backend)
    files = [p for p in TraceStore(store).files(sweep="killed") if pq.read_table(p, columns=["round", "split"]).to_pylist()
             == [{"round": 2, "split": "public"}] * 2]
    assert len(files) == 1  # one file per round
    lost = set(pq.read_table(files[0], columns=["job_id"])["job_id"].to_pylist())
    files[0].unlink()  # as if the loop died after writing round 2's candidates and before recording them
    (log / f"task-{DEF}-2.json").unlink()
    run_evolve(cfg, backend=backend)
    assert not (log / f"task-{DEF}-2.json").exists()  # the generator was not asked again
    assert lost <= set(_rows(store, "killed")["job_id"].to_list())


@pytest.mark.slow
def test_the_candidate_budget_cuts_a_round_and_stops_the_definition(store: Path, backend) -> None:
    report = run_evolve(_cfg(store, "budget", generator=_shell(), budget={"max_rounds": 5, "max_candidates": 3}),
                        backend=backend)
    rounds = Ledger(store, "budget").rounds(DEF)
    assert [len(r.candidates) for r in rounds] == [2, 1] and rounds[1].rejected[0]["reason"] == "over_budget"
    assert report.definitions[DEF].stop == "max_candidates"


@pytest.mark.slow
def test_a_callable_generator_answering_raw_modelnew_runs_on_a_kernelbench_definition(store: Path, backend) -> None:
    from fibray.interop.kernelbench import main as import_kernelbench

    dataset = reachable_tmpdir("evolve-kb-") / "kb"
    assert import_kernelbench([str(REPO / "tests" / "data" / "kernelbench" / "level1"), str(dataset), "--workloads", "2"]) == 0
    cfg = validate_evolve_config({
        "dataset": {"root": str(dataset)}, "store": {"root": str(store)}, "cluster": {"num_gpus": 1},
        "eval": {"warmup": 0, "iterations": 1, "trials": 1},
        "evolve": {"run_id": "kb", "progress": False, "budget": {"max_rounds": 2, "candidates": 1},
                   "generator": {"kind": "callable", "callable": "_evolve_agents:modelnew_matmul"}},
    })
    report = run_evolve(cfg, backend=backend)
    df = _rows(store, "kb")
    assert set(df["status"].to_list()) == {"PASSED"}, df.select("solution", "status", "reason", "log").to_dicts()
    assert sorted(set(df["round"].to_list())) == [1, 2] and df.height == 2 + 1  # 1 public per round, then 1 hidden
    assert set(df["generator"].to_list()) == {"callable:_evolve_agents:modelnew_matmul"}
    assert df.filter(df["round"] == 2)["parent"].to_list()[0] == "matmul_modelnew_r1"  # the best so far
    assert report.definitions["kb_1_square_matmul"].hidden_status == "PASSED"
