"""`python -m fibray.compile.jailed OUTDIR TIMEOUT_S < solution.json`: compile one solution into OUTDIR
in this process, which its caller has put in a sandbox (fibray.workers.process.compile_jail), and print
the outcome as the last line of stdout: {"ok": true} or {"ok": false, "reason": ..., "message": ...}.

The compiler reads whatever files the solution's sources name (`#include`, `.incbin`): run as an
unprivileged uid of its own, it reads only what any user may, never the store's keys or root's files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MARK = "fibray-compile-result: "


def main(argv: list[str]) -> int:
    from fibray.compile import BuildError  # registers the compilers
    from fibray.compile.cache import compiler_for
    from fibray.schema import Solution

    outdir, timeout_s = Path(argv[1]), float(argv[2])
    solution = Solution.model_validate_json(sys.stdin.read())
    compiler, _ = compiler_for(solution.spec.language.value)
    try:
        compiler(solution, outdir, timeout_s)
        result = {"ok": True}
    except BuildError as e:
        result = {"ok": False, "reason": str(e.reason), "message": str(e)}
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
