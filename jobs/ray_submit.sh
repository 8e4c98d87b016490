#!/usr/bin/env bash
# Submit a fibray sweep to a running Ray cluster through the Ray Jobs API.
#
#   RAY_ADDRESS=http://HEAD:8265 jobs/ray_submit.sh STORE_ROOT [HYDRA_OVERRIDES...]
#   e.g. jobs/ray_submit.sh /shared/fibray-store +experiment=smoke_gpu eval.trials=5
#
# RAY_ADDRESS here is the head's dashboard (job server) URL, default http://127.0.0.1:8265; the
# cluster and this machine need `ray[default]`. The sweep's driver runs on the head node and joins
# the cluster (cluster=ray). STORE_ROOT must be a path that the head can write and every node can
# read (the compiled-artifact cache lives under it); the dataset and solution roots must be the same
# path on every node.
#
# Code on the nodes, one of:
#   - fibray installed on every node (a shared venv or the cluster's image: `pip install -e /opt/fibray`);
#     this is the default.
#   - FIBRAY_UPLOAD=1: upload this checkout as the job's runtime_env working_dir (Ray unpacks it on
#     every node and puts it on the workers' PYTHONPATH; the bundled datasets/ and solutions/ travel
#     with it). Third-party Python dependencies still have to be installed on the nodes: a runtime_env
#     "pip" list installs them per job, but torch/triton matching the node's CUDA belong in the image.
# A cluster started with token authentication (Ray >= 2.60 enables it when ~/.ray/auth_token exists)
# needs RAY_AUTH_MODE=token and the same token here (~/.ray/auth_token or RAY_AUTH_TOKEN).
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
store=$1
shift
overrides=("$@")
if [[ ${#overrides[@]} -eq 0 ]]; then
    overrides=(+experiment=smoke)
fi

export RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
submit=(ray job submit --submission-id "fibray-$(date +%Y%m%d-%H%M%S)-$$")
if [[ ${FIBRAY_UPLOAD:-0} == 1 ]]; then
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    # everything that is not code or bundled data stays home
    submit+=(--working-dir "$repo" --runtime-env-json
             '{"excludes": [".git", ".ci-venv", "fibray-store", "outputs", "multirun", "*.so", "**/__pycache__"]}')
fi

# a head that has just started may have no job agent yet ("No available agent to submit job"):
# nothing was submitted then, so the same submission is tried again, for up to a minute
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for attempt in 1 2 3 4 5 6 7 8 9 10 11 12; do
    set +e
    "${submit[@]}" -- python -m fibray.sweep cluster=ray "store.root=$store" "${overrides[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    if [[ $rc -eq 0 ]] || ! grep -q "No available agent to submit job" "$log" || [[ $attempt -eq 12 ]]; then
        exit "$rc"
    fi
    echo "ray_submit.sh: the head's job agent is not up yet; trying again in 5 s ($attempt of 12)" >&2
    sleep 5
done
