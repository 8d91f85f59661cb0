"""Seconds from a command to its answer on bad input and ``--help``: each command a fresh
process, timed from its start to its exit, with whether torch had been loaded by then.

    python -m benchmarks.time_to_answer                          # this tree, 5 runs of each
    python -m benchmarks.time_to_answer --against ../before      # beside another checkout

``--against DIR`` runs the same commands in another checkout (e.g. ``git worktree add
../before <commit>``) with the same Python, alternating with this tree's run by run, so that
both see the same machine load; the table then gives both medians and their ratio. The last
row, ``import torch`` alone, is the floor that a command which loads torch cannot go under.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The command (its script and arguments) and the exit code its answer should have.
CASES = {
    "train-bad": (["train.py", "--lr", "fast"], 2),
    "train-help": (["train.py", "--help"], 0),
    "mp-bad": (["train_mp.py", "--lr", "fast"], 2),
    "graph-bad": (["train_graph.py", "--lr", "fast"], 2),
    "score-bad": (["score.py", "--run", "nowhere"], 2),
    "score-help": (["score.py", "--help"], 0),
    "torch": ([None], 0),  # import torch alone (a script written for it)
}

# Runs the script as ``python script args`` would (its __main__), then says on stderr's last
# line whether torch was loaded, whatever the script's exit.
WRAPPER = """import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    sys.stderr.write("torch loaded: %s\\n" % ("torch" in sys.modules))
"""


def time_once(argv: list[str], cwd: str) -> tuple[float, int, bool]:
    """(seconds to exit, exit code, whether torch was loaded) of one fresh process."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", WRAPPER, *argv], cwd=cwd, capture_output=True,
                       text=True)
    seconds = time.perf_counter() - start
    last = r.stderr.strip().splitlines()[-1:] or [""]
    if not last[0].startswith("torch loaded: "):
        raise SystemExit(f"error: {' '.join(argv)} in {cwd} ended without the wrapper's line "
                         f"(exit {r.returncode}): {r.stderr.strip()[-300:]}")
    return seconds, r.returncode, last[0] == "torch loaded: True"


def measure(names: list[str], trees: list[str], repeats: int, torch_script: str) -> dict:
    """{(case, tree): {"s": [seconds...], "code": exit code, "torch": loaded}}, the trees
    alternating run by run."""
    results = {}
    for _ in range(repeats):
        for name in names:
            argv, _ = CASES[name]
            argv = [torch_script] if argv == [None] else argv
            for tree in trees:
                seconds, code, loaded = time_once(argv, tree)
                row = results.setdefault((name, tree), {"s": [], "code": code, "torch": loaded})
                row["s"].append(seconds)
    return results


def table(names: list[str], trees: list[str], results: dict) -> list[str]:
    head = "| command | exit | torch loaded | s (this tree) |"
    rule = "|---|---:|---|---:|"
    if len(trees) > 1:
        head += " torch loaded (other) | s (other) | other / this |"
        rule += "---|---:|---:|"
    lines = [head, rule]
    for name in names:
        argv, expected = CASES[name]
        this = results[(name, trees[0])]
        command = "import torch" if argv == [None] else "python " + " ".join(argv)
        code = f"{this['code']}" + ("" if this["code"] == expected else f" (not {expected})")
        median = statistics.median(this["s"])
        line = f"| {command} | {code} | {'yes' if this['torch'] else 'no'} | {median:.2f} |"
        if len(trees) > 1:
            other = results[(name, trees[1])]
            other_median = statistics.median(other["s"])
            line += (f" {'yes' if other['torch'] else 'no'} | {other_median:.2f} | "
                     f"{other_median / median:.1f}x |")
        lines.append(line)
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_answer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"the commands to time, by name (default all: {', '.join(CASES)})")
    p.add_argument("--against", default=None,
                   help="another checkout to time the same commands in, alternating")
    args = p.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names or args.repeats < 1:
        p.error(f"--cases {args.cases} --repeats {args.repeats}: give names among "
                f"{', '.join(CASES)} and at least one repeat")
    trees = [ROOT] + ([os.path.abspath(args.against)] if args.against else [])
    for tree in trees[1:]:
        if not os.path.isfile(os.path.join(tree, "train.py")):
            p.error(f"--against {tree}: not a checkout (no train.py there)")
    with tempfile.TemporaryDirectory() as tmp:
        torch_script = os.path.join(tmp, "import_torch.py")
        with open(torch_script, "w") as f:
            f.write("import torch\n")
        results = measure(names, trees, args.repeats, torch_script)
    print(f"Seconds from start to exit, median of {args.repeats} fresh processes each"
          f" ({sys.executable})")
    print("\n".join(table(names, trees, results)))
    return results


if __name__ == "__main__":
    main()
