"""The console scripts' `main`, called once for each of many cases, in one process (tests/test_cli_errors.py).

    python -m tests.cli_runner < cases.json > results.json

Each case: {"script": "swarmtrain-node" | "swarmtrain-coordinator", "args": [...], "env": {...},
"cwd": "..."}; each result: {"code", "stdout", "stderr"}, as the script run alone would give
them (its exit status: what `main` returns, or the SystemExit argparse raises). Run where torch
and hivemind cannot be imported (tests/test_cli_errors.py's "too-early" modules first on
PYTHONPATH): the cases here are refused by checks that must come before either loads, and an
import that comes too early shows up as that case's traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

MAINS = {"swarmtrain-node": "node.cli", "swarmtrain-coordinator": "coordinator.cli"}


def run_case(case: dict, base_env: dict[str, str]) -> dict:
    import importlib

    os.environ.clear()
    os.environ.update({**base_env, **case["env"]})
    os.chdir(case["cwd"])
    sys.argv = [case["script"], *case["args"]]  # (argparse names the program from it)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = importlib.import_module(MAINS[case["script"]]).main(case["args"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # what the script alone would print, and its status
            traceback.print_exc()
            code = 1
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> int:
    cases = json.load(sys.stdin)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMTRAIN_")}
    results = [run_case(c, base_env) for c in cases]
    sys.stdout.write(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
