"""How often an oslo run under the real ``torchrun`` exits 0 (target: every run).

A process that ends with live gloo groups may die after its last line with ``terminate called without an
active exception`` (exit -6), which torchrun reports as ``ChildFailedError``; oslo destroys the groups it
created at interpreter exit (``oslo.parallel.context.destroy_process_group_at_exit``). Each run launches
``python -m torch.distributed.run --nproc_per_node=N tests/scripts/clean_exit.py TP PP``: a tiny GPT2 built
at that layout, one training step, one forward pass, then the script returns. ``--keep-process-group``
runs the script with oslo's teardown unregistered (the behaviour before it existed), for comparison;
``--context-only`` builds only the ``ParallelContext`` and runs one all-reduce (a few seconds a run).

Run: ``python benchmarks/clean_exit.py --runs 30`` (each run takes 10-40 s: two to four processes importing
torch and transformers), ``--layouts 2x1`` for one layout. Prints ``N/RUNS exited 0`` per layout and the
exit codes and last stderr lines of the runs that did not; exits 1 unless every run exited 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "clean_exit.py")


def run_once(tp: int, pp: int, flags: list[str], timeout: float) -> tuple[int | None, str]:
    """One torchrun of the script with ``flags``: (its exit code, ``None`` on timeout; the tail of its output)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp * pp}", "--standalone",
               SCRIPT, str(tp), str(pp), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return None, (exc.stderr or b"")[-2000:].decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], help="TPxPP, e.g. 2x1 2x2")
    parser.add_argument("--keep-process-group", action="store_true",
                        help="unregister oslo's teardown at exit (the behaviour before it)")
    parser.add_argument("--context-only", action="store_true",
                        help="build only the ParallelContext and run one all-reduce (no model; a few seconds a run)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    args = parser.parse_args()
    flags = [flag for flag, on in (("--keep-process-group", args.keep_process_group),
                                   ("--context-only", args.context_only)) if on]
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs; teardown at exit: "
          f"{'off (--keep-process-group)' if args.keep_process_group else 'on'}; "
          f"{'ParallelContext only' if args.context_only else 'tiny GPT2, one training step'}", flush=True)
    everything_clean = True
    for layout in args.layouts:
        tp, pp = (int(part) for part in layout.split("x"))
        codes: Counter = Counter()
        failures = []
        started = time.monotonic()
        for run in range(args.runs):
            code, tail = run_once(tp, pp, flags, args.timeout)
            codes[code] += 1
            if code != 0:
                failures.append((run, code, tail))
            print(f"  tp={tp} pp={pp} run {run + 1}/{args.runs}: exit {code}", flush=True)
        clean = codes[0]
        everything_clean &= clean == args.runs
        print(f"tp={tp} x pp={pp}: {clean}/{args.runs} exited 0 (exit codes {dict(codes)}; "
              f"{(time.monotonic() - started) / args.runs:.1f} s per run)", flush=True)
        for run, code, tail in failures[:3]:
            lines = [line for line in tail.splitlines() if line.strip()][-6:]
            print(f"  run {run + 1} exited {code}:\n    " + "\n    ".join(lines), flush=True)
    print("PASS" if everything_clean else "FAIL")
    return 0 if everything_clean else 1


if __name__ == "__main__":
    sys.exit(main())
