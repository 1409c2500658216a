"""Saves killed at random instants: a reader finds the complete old checkpoint, the complete new one, or a
clear error, never a mix. Also the save-time overhead of the crash-safe publish.

What runs (faults, the default): a GPT2 (n_embd 64, 4 layers, vocab 1001, 1.3 MB of float32 weights) at
``tensor_parallel_size=2``, two forked gloo ranks. Variants, in turn: ``split`` (a split save over a split
checkpoint), ``merged`` (a merged save in several shard files over a merged one), ``merged-over-split``,
and ``split-rename-fallback`` (as ``split``, on a "file system" without ``renameat2(RENAME_EXCHANGE)``:
the target is renamed aside, then the new checkpoint into place). The previous checkpoint (seed 1) holds
a ``tokenizer.json`` and a subdirectory of the user's. Each run copies it to the target (leaving beside
it whatever the previous run's killed save left), starts the save of the new model (seed 2) and, at a
random instant after the save started, SIGKILLs one rank (chosen at random; the other 0.3 s later, as a
launcher tearing the job down would). In every other round of the four variants the instants are
uniform over the whole save, in the others over its publishing part (from the index written to the
previous checkpoint removed), both timed by an uninterrupted save of the variant beforehand. Then oslo
loads the target at tp=2 and, for merged variants, so does transformers' ``from_pretrained``; each
outcome is: ``old`` or ``new`` (every weight equal to that model's), ``error`` (the message is printed:
it must be clear; transformers cannot read the split checkpoint that ``merged-over-split`` starts from,
so its "no file named model.safetensors" there is the old checkpoint), ``MIX`` (anything else) or
``LOST`` (old or new, but the user's files are gone). Finally one uninterrupted save per variant must
publish and leave no leftovers. PASS when no run gives MIX or LOST and the final saves are clean.

``--implementation baseline`` runs the same loop against oslo/checkpoint.py of ``--baseline`` (a git
revision; default f781e09, before this publish), which moved files into place one ``os.replace`` at a
time. Its publishing part is not timed (no hooks), so all instants are uniform over the whole save, and
they seldom land in the microseconds between two of its renames (measured: 0 MIX in 50 runs); the tests
(tests/test_checkpoint_publish.py) kill it right after a rename instead, and get the mix.

Overhead (``--overhead``): a gpt2-small-shaped model (n_embd 768, 12 layers, vocab 50257, 124 M
parameters, 498 MB float32) at tp=2 saved split and merged over an existing checkpoint of the same kind,
alternating this implementation and the baseline's, ``--repeats`` times each (default 3), medians of the
wall time on rank 0 between two barriers; plus the new save's phases (rank 0's hashing and fsync of its
files; link + swap + removal of the previous checkpoint).

Usage: python benchmarks/publish_faults.py [--runs 50] [--seed 0] [--implementation new|baseline]
       python benchmarks/publish_faults.py --overhead [--repeats 3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import errno  # noqa: E402
import multiprocessing as mp  # noqa: E402
import pickle  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config  # noqa: E402

import oslo  # noqa: E402
from oslo import checkpoint as ckpt  # noqa: E402
from oslo.models import base  # noqa: E402
from oslo.parallel.dtensor import local_named_parameters
from oslo.parallel.plan import parameter_specs  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()

OLD_SEED, NEW_SEED = 1, 2
VARIANTS = ("split", "merged", "merged-over-split", "split-rename-fallback")
USER_FILES = {"tokenizer.json": '{"user": 1}', os.path.join("extra", "notes.txt"): "kept"}
TP = 2
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(small: bool = True) -> GPT2Config:
    sizes = dict(n_embd=64, n_layer=4, n_head=4, vocab_size=1001) if small else \
        dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
    return GPT2Config(n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **sizes)


def _merged(variant: str) -> bool:
    return variant in ("merged", "merged-over-split")


# ---------------------------------------------------------------------------------------------
# Launching ranks that can be killed
# ---------------------------------------------------------------------------------------------
def _worker(fn, rank, world_size, port, args, conn) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        conn.send_bytes(pickle.dumps(("ok", fn(rank, world_size, conn, *args))))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
    finally:
        conn.close()
        os._exit(0)


def _start(fn, world_size, *args):
    """Fork ``world_size`` ranks running ``fn(rank, world_size, conn, *args)``; (processes, connections)."""
    ctx = mp.get_context("fork")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, child), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    return procs, conns


def _finish(procs, conns, timeout: float = 120.0) -> list:
    """Every rank's result; raises the error of the first rank to fail."""
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < len(conns):
            waiting = [conn for rank, conn in enumerate(conns) if rank not in results]
            ready = mp.connection.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks {sorted(set(range(len(conns))) - set(results))} did not finish within "
                                   f"{timeout:.0f} s")
            for conn in ready:
                rank = conns.index(conn)
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "error", f"exited without a result (exit code {procs[rank].exitcode})"
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                if status == "ok":
                    results[rank] = payload
    finally:
        _kill(procs)
        for conn in conns:
            conn.close()
    return [results[rank] for rank in range(len(conns))]


def _kill(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _run(fn, world_size, *args, timeout: float = 120.0) -> list:
    return _finish(*_start(fn, world_size, *args), timeout=timeout)


# ---------------------------------------------------------------------------------------------
# In the ranks
# ---------------------------------------------------------------------------------------------
def _model(seed: int, small: bool = True):
    return oslo.GPT2LMHeadModel.from_config_with_parallel(_config(small), tensor_parallel_size=TP, seed=seed,
                                                          timeout=60)


def _full_weights(model) -> dict[str, torch.Tensor]:
    """The model's unsplit weights (all-gathered over its tensor-parallel group)."""
    context, specs, out = model.parallel_context, parameter_specs(model), {}
    for name, param in local_named_parameters(model):
        spec, local = specs[name], param.detach().contiguous()
        if spec is None:
            out[name] = local.clone()
            continue
        parts = [torch.empty_like(local) for _ in range(context.tensor_parallel_size)]
        dist.all_gather(parts, local, group=context.tensor_parallel_group)
        out[name] = spec.merge(parts)
    return out


def _unsupported_exchange(a, b):
    raise OSError(errno.EINVAL, "Invalid argument")


def _use(implementation: types.ModuleType | None) -> None:
    if implementation is not None:
        base.ckpt = implementation  # save_pretrained_with_parallel calls base.ckpt.save_split / save_merged


def _saver(rank, world_size, conn, variant, target, seed, implementation, record):
    """Save the model of ``seed`` over ``target``; tell the parent when the save starts (rank 0)."""
    _use(implementation)
    model = _model(seed)
    if variant == "split-rename-fallback":
        ckpt._exchange = _unsupported_exchange
    steps: dict[str, float] = {}
    if record:
        ckpt._publish_hook = lambda step: steps.setdefault(step, time.monotonic())
    dist.barrier(group=model.parallel_context.world_group)
    start = time.monotonic()
    if rank == 0:
        conn.send_bytes(pickle.dumps(("ready", start)))
    model.save_pretrained_with_parallel(target, save_with_merging=_merged(variant), max_shard_size="400KB")
    steps["end"] = time.monotonic()
    return {step: moment - start for step, moment in steps.items()}


def _loader(rank, world_size, conn, path):
    """The full weights oslo loads from ``path`` at tp=2, or the error it raises."""
    try:
        model = oslo.GPT2LMHeadModel.from_pretrained_with_parallel(path, tensor_parallel_size=TP, timeout=60)
    except Exception as exc:  # noqa: BLE001 - the parent classifies it
        return f"{type(exc).__name__}: {exc}"
    return _full_weights(model)


def _references(rank, world_size, conn):
    return {seed: _full_weights(_model(seed)) for seed in (OLD_SEED, NEW_SEED)}


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------
def _classify(weights, references) -> str:
    if isinstance(weights, str):
        return "error"
    for seed, name in ((OLD_SEED, "old"), (NEW_SEED, "new")):
        reference = references[seed]
        if all(name in weights and torch.equal(weights[name], value) for name, value in reference.items()):
            return name
    return "MIX"


def _transformers_weights(path):
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _user_files_intact(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) and open(os.path.join(path, name)).read() == text
               for name, text in USER_FILES.items())


def _outcome(path, weights, references) -> tuple[str, str | None]:
    found = _classify(weights, references)
    if found in ("old", "new") and not _user_files_intact(path):
        found = "LOST"
    return found, weights if found == "error" else None


def _phase(instant: float, steps: dict[str, float]) -> str:
    """The save step an instant (seconds after the start) falls in, by the calibration's timings."""
    order = ["prepare", "write", "index", "link", "aside", "swap", "cleanup", "end"]
    for step in order:
        if step in steps and instant < steps[step]:
            return f"before {step}"
    return "after the save"


def _load_implementation(revision: str) -> types.ModuleType:
    source = subprocess.run(["git", "-C", REPOSITORY, "show", f"{revision}:oslo/checkpoint.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("oslo_checkpoint_baseline")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:oslo/checkpoint.py", "exec"), module.__dict__)  # noqa: S102
    return module


def run(runs: int = 50, seed: int = 0, directory: str | None = None, implementation: types.ModuleType | None = None,
        verbose: bool = False) -> dict:
    """The fault loop; returns the counts of outcomes per reader ("oslo", "transformers") and per variant."""
    rng = random.Random(seed)
    counts: dict = {"oslo": collections.Counter(), "transformers": collections.Counter(),
                    "variants": collections.defaultdict(collections.Counter), "phases": collections.Counter(),
                    "errors": collections.Counter(), "final": {}}
    with contextlib.ExitStack() as stack:
        root = directory or stack.enter_context(tempfile.TemporaryDirectory(prefix="publish-faults-"))
        references = _run(_references, TP)[0]
        templates, timings = {}, {}
        for kind in ("split", "merged"):
            templates[kind] = os.path.join(root, "templates", kind)
            _run(_saver, TP, kind, templates[kind], OLD_SEED, None, False)
            for name, text in USER_FILES.items():
                os.makedirs(os.path.dirname(os.path.join(templates[kind], name)), exist_ok=True)
                with open(os.path.join(templates[kind], name), "w") as f:
                    f.write(text)

        def prepare_target(variant: str) -> str:
            target = os.path.join(root, variant, "ckpt")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(templates["split" if variant.startswith("split") or variant == "merged-over-split"
                                      else "merged"], target)
            return target

        for variant in VARIANTS:  # calibration: an uninterrupted save, timed by the hook
            timings[variant] = _run(_saver, TP, variant, prepare_target(variant), NEW_SEED, implementation,
                                    implementation is None)[0]
        for run_index in range(runs):
            variant = VARIANTS[run_index % len(VARIANTS)]
            steps, target = timings[variant], prepare_target(variant)
            publishing = implementation is None and run_index // len(VARIANTS) % 2 == 1  # every other round
            low, high = (steps["index"], steps["cleanup"]) if publishing else (0.0, steps["end"] * 1.1)
            instant = rng.uniform(low, high)
            victim = rng.randrange(TP)
            procs, conns = _start(_saver, TP, variant, target, NEW_SEED, implementation, False)
            status, start = pickle.loads(conns[0].recv_bytes())
            if status != "ready":
                _kill(procs)
                raise RuntimeError(f"the saver failed before saving:\n{start}")
            time.sleep(max(0.0, start + instant - time.monotonic()))
            finished = conns[0].poll()  # rank 0 has already answered: the save is over
            os.kill(procs[victim].pid, signal.SIGKILL)
            time.sleep(0.3)
            _kill(procs)
            for conn in conns:
                conn.close()
            counts["phases"]["save finished first" if finished else _phase(instant, steps)] += 1

            oslo_outcome, error = _outcome(target, _run(_loader, TP, target)[0], references)
            counts["oslo"][oslo_outcome] += 1
            counts["variants"][variant][f"oslo {oslo_outcome}"] += 1
            if error:
                counts["errors"][error.splitlines()[0][:300]] += 1
            if _merged(variant):
                hf = _transformers_weights(target)
                hf_outcome, error = _outcome(target, hf if isinstance(hf, str) else
                                             {n: hf[n] for n in references[OLD_SEED] if n in hf}, references)
                counts["transformers"][hf_outcome] += 1
                counts["variants"][variant][f"transformers {hf_outcome}"] += 1
                if error:
                    counts["errors"][error.splitlines()[0][:300]] += 1
            if verbose:
                print(f"run {run_index:3d} {variant:22s} kill rank {victim} at {instant * 1e3:7.1f} ms: "
                      f"oslo {oslo_outcome}" + (f", transformers {hf_outcome}" if _merged(variant) else ""),
                      flush=True)
        for variant in VARIANTS:  # the next, uninterrupted save cleans up
            target = os.path.join(root, variant, "ckpt")
            _run(_saver, TP, variant, target, NEW_SEED, implementation, False)
            leftovers = sorted(n for n in os.listdir(os.path.dirname(target)) if n.startswith("."))
            outcome = _outcome(target, _run(_loader, TP, target)[0], references)[0]
            counts["final"][variant] = (outcome, leftovers)
    return counts


# ---------------------------------------------------------------------------------------------
# Overhead
# ---------------------------------------------------------------------------------------------
def _timer(rank, world_size, conn, root, implementation, repeats):
    model = _model(0, small=False)
    group = model.parallel_context.world_group
    hashing = [0.0]
    digest = ckpt._file_digest

    def timed_digest(*args):
        begin = time.perf_counter()
        try:
            return digest(*args)
        finally:
            hashing[0] += time.perf_counter() - begin

    ckpt._file_digest = timed_digest
    steps: dict[str, float] = {}
    ckpt._publish_hook = lambda step: steps.setdefault(step, time.perf_counter())
    times = collections.defaultdict(list)
    for repeat in range(repeats + 1):  # the first round writes the checkpoints that later rounds replace
        order = [("new", ckpt), ("baseline", implementation)]
        for name, module in order if repeat % 2 else order[::-1]:
            for merged in (False, True):
                kind = "merged" if merged else "split"
                target = os.path.join(root, f"{kind}-{name}")
                hashing[0], steps = 0.0, {}
                ckpt._publish_hook = lambda step, steps=steps: steps.setdefault(step, time.perf_counter())
                dist.barrier(group=group)
                begin = time.perf_counter()
                if merged:
                    module.save_merged(model, target, True, 5 * 10**9, True, None)
                else:
                    module.save_split(model, target, True, True, None)
                dist.barrier(group=group)
                if repeat:
                    times[(kind, name)].append(time.perf_counter() - begin)
                    if name == "new" and rank == 0:
                        times[(kind, "hash+fsync")].append(hashing[0])
                        times[(kind, "link+swap+cleanup")].append(steps["cleanup"] - steps["index"])
    return dict(times)


def overhead(repeats: int, revision: str) -> None:
    implementation = _load_implementation(revision)
    with tempfile.TemporaryDirectory(prefix="publish-overhead-") as root:
        times = _run(_timer, TP, root, implementation, repeats, timeout=1800)[0]
    print(f"save of a 124 M-parameter GPT2 (498 MB float32) at tp=2, over an existing checkpoint; medians of "
          f"{repeats} (rank 0):")
    for kind in ("split", "merged"):
        new, old = (statistics.median(times[(kind, name)]) for name in ("new", "baseline"))
        parts = ", ".join(f"{part} {statistics.median(times[(kind, part)]):.3f} s"
                          for part in ("hash+fsync", "link+swap+cleanup"))
        print(f"  {kind:6s}: new {new:.3f} s, baseline ({revision}) {old:.3f} s, overhead {new - old:+.3f} s "
              f"({new / old:.2f}x); new save's {parts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementation", choices=["new", "baseline"], default="new")
    parser.add_argument("--baseline", default="f781e09", help="git revision of the baseline oslo/checkpoint.py")
    parser.add_argument("--overhead", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.overhead:
        overhead(args.repeats, args.baseline)
        return 0
    implementation = _load_implementation(args.baseline) if args.implementation == "baseline" else None
    begin = time.monotonic()
    counts = run(args.runs, args.seed, implementation=implementation, verbose=args.verbose)
    print(f"{args.runs} saves killed at random instants ({args.implementation} implementation), "
          f"{time.monotonic() - begin:.0f} s:")
    print("  where the kills landed: " + ", ".join(f"{k} {v}" for k, v in sorted(counts["phases"].items())))
    for reader in ("oslo", "transformers"):
        print(f"  {reader:12s}: " + ", ".join(f"{k} {counts[reader].get(k, 0)}"
                                             for k in ("old", "new", "error", "MIX", "LOST")))
    for variant, found in counts["variants"].items():
        print(f"    {variant:22s}: " + ", ".join(f"{k} {v}" for k, v in sorted(found.items())))
    for message, number in counts["errors"].items():
        print(f"  error x{number}: {message}")
    clean = all(outcome == "new" and not leftovers for outcome, leftovers in counts["final"].values())
    print(f"  next save after the loop: {counts['final']}")
    bad = sum(counts[r].get("MIX", 0) + counts[r].get("LOST", 0) for r in ("oslo", "transformers"))
    print(f"{'PASS' if bad == 0 and clean else 'FAIL'}: {bad} runs gave MIX or LOST; final saves "
          f"{'clean' if clean else 'NOT clean'}")
    return 0 if bad == 0 and clean else 1


if __name__ == "__main__":
    sys.exit(main())
