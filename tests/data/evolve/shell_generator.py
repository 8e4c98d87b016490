"""A shell generator for the agent-loop tests: reads the task JSON on stdin, writes solution JSONs on stdout.

--log DIR      save each task as DIR/task-<definition>-<round>.json (and count calls there)
--hang R       sleep forever in round R (the loop must kill it at its deadline)
--garbage R    print something that is not JSON in round R
--crash R      exit 3 in round R, after writing to stderr
--wrong R      in round R, also return one candidate whose output is wrong (INCORRECT_NUMERICAL)
Candidates are PyTorch rmsnorm solutions (value-returning) that scale the epsilon by the round, so each
is new code; the second one names the best solution so far as its parent.
"""

import argparse
import json
import sys
import time
from pathlib import Path

SOURCE = '''import torch


@torch.no_grad()
def run(hidden_states, weight):
    x = hidden_states.to(torch.float32)
    inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + {eps!r})
    return (x * inv * weight.to(torch.float32) * {scale!r}).to(hidden_states.dtype)
'''


def solution(name: str, definition: str, eps: float, scale: float = 1.0) -> dict:
    return {"name": name, "definition": definition, "author": "test-shell-agent",
            "spec": {"language": "python", "target_hardware": ["cpu"], "entry_point": "main.py::run",
                     "destination_passing_style": False},
            "sources": [{"path": "main.py", "content": SOURCE.format(eps=eps, scale=scale)}]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--log")
    p.add_argument("--hang", type=int, default=-1)
    p.add_argument("--garbage", type=int, default=-1)
    p.add_argument("--crash", type=int, default=-1)
    p.add_argument("--wrong", type=int, default=-1)
    a = p.parse_args()
    task = json.load(sys.stdin)
    d, r = task["definition"]["name"], task["round"]
    if a.log:
        Path(a.log).mkdir(parents=True, exist_ok=True)
        (Path(a.log) / f"task-{d}-{r}.json").write_text(json.dumps(task))
    print(f"shell agent: round {r} of {d}", file=sys.stderr)
    if r == a.hang:
        time.sleep(3600)
    if r == a.garbage:
        print("I am a language model and here is your kernel: ```python ...")
        return 0
    if r == a.crash:
        print("the agent fell over", file=sys.stderr)
        return 3
    eps = 1e-5 * (1 + r / 1000)
    out = [solution(f"{d}_agent_r{r}_0", d, eps)]
    second = solution(f"{d}_agent_r{r}_1", d, eps * 1.0001)
    if task["best"]:
        second["parent"] = task["best"]["solution"]["name"]
    out.append(second)
    if r == a.wrong:
        out.append(solution(f"{d}_agent_r{r}_wrong", d, eps, scale=1.5))
    for s in out:  # all of them, even past task["candidates"]: the loop cuts
        print(json.dumps(s))  # JSONL
    return 0


if __name__ == "__main__":
    sys.exit(main())
