"""Paired A/B: one benchmark command run alternately in another revision's checkout and in this one.

    python -m bench.ab --base REV [--pairs 5] --metric REGEX [--lower-is-better] -- COMMAND...

e.g. `python -m bench.ab --base HEAD~1 --metric '"engine_tok_s": ([0-9.]+)' -- python -m
bench.offline --workload W1-mixed-64 --model smollm2 --quantization gguf --no-baseline`.

On a shared CPU the speed of the same code moves by tens of percent within minutes, so two runs
made minutes apart compare the machine, not the code. Here each pair runs COMMAND once in each
checkout back to back (which goes first alternates from pair to pair) and reads the metric from each
output (REGEX's first group); the result is the median of the per-pair ratios, this checkout over
the base (or base over this one with --lower-is-better: above 1 is faster either way).

The base checkout is `git archive REV` in the temporary folder (kept, and reused for the same
commit), with this checkout's `.venv` linked in and its compiled kernels built there. COMMAND runs
in each checkout's folder with that folder first on PYTHONPATH, so `python -m bench.X` and the
engine core it starts import that checkout's code; a leading `python` is this interpreter.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.cpu_servers import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
KERNEL_BUILDS = ("gpu.cpu_ops", "gpu.packed_linear")  # each builds into its checkout's build/


def main() -> None:
    args = _args()
    pattern = re.compile(args.metric)
    base = base_checkout(args.base)
    trees = {"base": base, "this": ROOT}
    print(f"base {args.base} at {base}; this checkout {ROOT}; metric {args.metric!r}; cpu flags: {cpu_flags()}")
    print("| pair | base | this | ratio |\n| --- | --- | --- | --- |", flush=True)
    ratios = []
    for pair in range(args.pairs):
        order = ("base", "this") if pair % 2 == 0 else ("this", "base")
        value = {name: read_metric(run_in(trees[name], args.command), pattern) for name in order}
        ratio = value["base"] / value["this"] if args.lower_is_better else value["this"] / value["base"]
        ratios.append(ratio)
        print(f"| {pair + 1} | {value['base']:g} | {value['this']:g} | {ratio:.3f} |", flush=True)
    print(f"\nmedian ratio over {len(ratios)} pairs: {statistics.median(ratios):.3f} (above 1: this checkout is faster)")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare against (anything git rev-parse takes)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--metric", required=True, help="a regular expression whose first group is the number to compare")
    p.add_argument("--lower-is-better", action="store_true", help="the metric is a time, not a rate")
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the benchmark command")
    args = p.parse_args()
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        p.error("give the benchmark command after --")
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    return args


def base_checkout(rev: str) -> Path:
    """`rev`'s files in a folder of their own with this .venv and their kernels built (once per commit)."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--base {rev}: not a commit here ({commit.stderr.strip()})")
    tree = Path(tempfile.gettempdir()) / f"actorserve-ab-{commit.stdout.strip()[:12]}"
    ready = tree / ".ab-ready"
    if ready.exists():
        return tree
    tree.mkdir(exist_ok=True)
    archive = subprocess.Popen(["git", "archive", commit.stdout.strip()], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {rev} failed")
    venv = tree / ".venv"
    if not venv.exists():
        venv.symlink_to(ROOT / ".venv")
    for module in KERNEL_BUILDS:  # a build that cannot run leaves the torch path, as `make setup` does
        subprocess.run([sys.executable, "-m", module], cwd=tree, env=_env(tree), check=False)
    ready.touch()
    return tree


def run_in(tree: Path, command: list[str]) -> str:
    """COMMAND's stdout and stderr, run in `tree`; its exit status must be 0."""
    argv = [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command
    done = subprocess.run(argv, cwd=tree, env=_env(tree), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {tree} (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def read_metric(output: str, pattern: re.Pattern[str]) -> float:
    """The last match's first group in `output`, as a number."""
    found = pattern.findall(output)
    if not found:
        raise SystemExit(f"the metric {pattern.pattern!r} is not in the output:\n{output[-3000:]}")
    last = found[-1]
    return float(last[0] if isinstance(last, tuple) else last)


def _env(tree: Path) -> dict[str, str]:
    paths = [str(tree), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


if __name__ == "__main__":
    main()
