"""oslo.launch: the one local launcher (run once on every rank, or a group of long-lived ranks)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oslo import launch
from oslo.parallel.errors import PeerLostError

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent


def _environment(rank, world_size):
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    return {key: os.environ.get(key) for key in keys}, os.environ["MASTER_PORT"], os.getpid()


def test_results_come_back_in_rank_order_with_the_launchers_variables():
    results = launch.run(_environment, 3, timeout=30)
    assert [environment for environment, _, _ in results] == [
        {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
        for r in range(3)]
    assert len({port for _, port, _ in results}) == 1  # one rendezvous
    assert len({pid for _, _, pid in results} | {os.getpid()}) == 4  # a process per rank


def _all_reduce(rank, world_size, scale, offset=0):
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return value * scale + offset


def test_ranks_form_a_process_group_and_get_their_arguments():
    results = launch.run(_all_reduce, 2, (10,), {"offset": 1}, timeout=30)
    assert [value.item() for value in results] == [31.0, 31.0]


def _plain(rank, world_size):
    return [name for name in launch.LAUNCHER_VARIABLES if name in os.environ]


def test_plain_processes_have_no_launcher_variables(monkeypatch):
    monkeypatch.setenv("RANK", "5")  # this process's own: never a plain rank's
    assert launch.run(_plain, 1, launcher_variables=False, timeout=30) == [[]]


def _one_rank_raises(rank, world_size):
    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # waits for rank 1 forever: the launcher must end it
    return rank


def test_an_error_names_the_rank_and_the_others_are_not_left_waiting():
    start = time.monotonic()
    with pytest.raises(launch.RankFailedError, match=r"^rank 1 failed") as raised:
        launch.run(_one_rank_raises, 3, timeout=50, grace=2)
    assert time.monotonic() - start < 30
    assert raised.value.rank == 1
    assert "ValueError: rank one cannot go on" in raised.value.text and "Traceback" in raised.value.text


def _sleeps(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_a_timeout_names_the_ranks_that_did_not_finish():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 2 s"):
        launch.run(_sleeps, 2, timeout=2)
    assert time.monotonic() - start < 15


def _dies(rank, world_size, code):
    if rank == 0:
        os._exit(code)
    return rank


def _returns(rank, world_size):
    return rank


def test_lost_ranks_and_a_rank_that_exits_without_a_result():
    assert launch.run(_dies, 2, (launch.LOST_EXIT,), lost={0}, timeout=30) == [None, 1]
    with pytest.raises(launch.RankFailedError, match=r"rank 0 failed:\nexited without a result \(exit code 3\)"):
        launch.run(_dies, 2, (3,), timeout=30)
    with pytest.raises(launch.RankFailedError, match=r"rank 1 failed:\nwas to end its process"):
        launch.run(_returns, 2, lost={1}, timeout=30)  # no other rank fails first


def _aborts_inside(rank, world_size):
    if rank == 1:
        _a_frame_named_in_the_dump()
    return rank


def _a_frame_named_in_the_dump():
    os.abort()  # as a C++ std::terminate would: no Python exception, no result


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_a_rank_killed_by_a_signal_names_the_signal_and_where_its_python_code_was(tmp_path, monkeypatch,
                                                                                  start_method):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launcher makes the ranks' dump files
    with pytest.raises(launch.RankFailedError, match=r"rank 1 failed:\nexited without a result \(was killed by "
                                                     r"signal SIGABRT\)") as raised:
        launch.run(_aborts_inside, 2, timeout=60, start_method=start_method)
    assert "_a_frame_named_in_the_dump" in raised.value.text and "_aborts_inside" in raised.value.text
    assert launch.run(_returns, 2, timeout=60, start_method=start_method) == [0, 1]
    # no dump file is left after a failed run or one that ended well (pymp-*: multiprocessing's directory for
    # the forkserver's socket, removed when this process exits)
    assert [name for name in os.listdir(tmp_path) if not name.startswith("pymp-")] == []


def _group_of_sleepers(parent_pid_file):
    group = launch.RankGroup(_sleeps_on_command, 2, die_with_parent=True, timeout=60)
    with open(parent_pid_file, "w") as file:
        file.write(" ".join(map(str, group.pids)))
    time.sleep(600)


def _sleeps_on_command(rank, world_size):
    return lambda command: time.sleep(command)


def test_a_launcher_killed_with_its_ranks_leaves_no_file(tmp_path):
    # The launcher cannot clean up after SIGKILL: its ranks' dump files must have no name to leave behind.
    pids_file = tmp_path / "pids"
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    code = (f"import tempfile, sys; sys.path.insert(0, {str(ROOT)!r}); tempfile.tempdir = {str(temporary)!r}\n"
            f"from tests.test_launch import _group_of_sleepers; _group_of_sleepers({str(pids_file)!r})")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not (pids_file.exists() and pids_file.read_text()):
            assert parent.poll() is None and time.monotonic() < deadline, "the launcher did not start its ranks"
            time.sleep(0.1)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        parent.kill()
    assert os.listdir(temporary) == []


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie (its parent is gone, init reaps it) counts as ended
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def test_a_group_rank_killed_by_a_signal_names_where_it_was():
    with launch.RankGroup(_aborts_on_command, 2, timeout=30) as group:
        with pytest.raises(RuntimeError, match="rank 0 .* was killed by signal SIGABRT") as raised:
            group.call("abort")
    assert "_a_frame_named_in_the_dump" in str(raised.value)


def _aborts_on_command(rank, world_size):
    def handle(command):
        if rank == 0:
            _a_frame_named_in_the_dump()
        time.sleep(5)
        return rank
    return handle


def _killed_while_the_peer_reports_losing_it(rank, world_size, error):
    if rank == 0:
        time.sleep(1.0)  # the peer's error reaches the launcher first
        os._exit(3)
    raise error


@pytest.mark.parametrize("error", [PeerLostError("rank 1 lost its connection to global rank 0"),
                                   RuntimeError("rank 1 failed on its own")], ids=["passed-on", "its-own"])
def test_the_cause_is_the_rank_that_failed_not_the_peer_that_lost_it(error):
    """A rank killed mid-collective: its peer's ``PeerLostError`` (an error that passes on another rank's failure)
    arrives first, yet the killed rank is named the cause. An error of the peer's own stays the cause."""
    with pytest.raises(launch.RankFailedError) as raised:
        launch.run(_killed_while_the_peer_reports_losing_it, 2, (error,), timeout=30)
    if isinstance(error, PeerLostError):
        assert (raised.value.rank, raised.value.others) == (0, [1])
        assert str(raised.value).startswith("rank 0 failed (then ranks [1] failed too):\nexited without a result")
    else:
        assert (raised.value.rank, raised.value.others) == (1, [0])


def _reports(rank, world_size):
    launch.report(f"hello from {rank}")
    return rank


def test_ranks_report_to_the_launcher_before_their_result():
    messages = []
    assert launch.run(_reports, 2, timeout=30, on_message=lambda rank, value: messages.append((rank, value))) == [0, 1]
    assert sorted(messages) == [(0, "hello from 0"), (1, "hello from 1")]


def _counter(rank, world_size, start):
    dist.init_process_group("gloo")
    state = {"count": start}

    def handle(command):
        if command == "fail":
            if rank == 1:
                raise KeyError("no such thing")
            return "fine"
        if command == "exit" and rank == 1:
            os._exit(0)
        state["count"] += 1
        value = torch.tensor([float(state["count"])])
        dist.all_reduce(value)
        return rank, value.item()

    return handle


def test_a_group_keeps_its_state_and_survives_an_error_every_rank_answered():
    with launch.RankGroup(_counter, 2, 10, timeout=30) as group:
        assert group.call("step") == [(0, 22.0), (1, 22.0)]
        with pytest.raises(KeyError) as raised:
            group.call("fail")  # rank 0 answers (its step), rank 1 raises: in step, still usable
        assert "raised in rank 1" in "".join(raised.value.__notes__)
        assert group.call("step") == [(0, 24.0), (1, 24.0)]
        processes = list(group._processes)
    assert group.closed and not any(process.is_alive() for process in processes)


def test_a_rank_that_dies_shuts_the_group_down():
    group = launch.RankGroup(_counter, 2, 0, timeout=30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code 0; the others were shut down"):
        group.call("exit")  # rank 0 waits in its all-reduce for rank 1, which is gone
    assert time.monotonic() - start < 15
    assert group.closed
    with pytest.raises(RuntimeError, match="closed"):
        group.call("step")


def _fails_to_start(rank, world_size):
    raise OSError(f"rank {rank} has no checkpoint")


def test_a_start_error_is_raised_as_its_own_type():
    with pytest.raises(OSError, match="has no checkpoint"):
        launch.RankGroup(_fails_to_start, 2, timeout=30)


def test_free_port_is_a_port():
    assert 0 < launch.free_port() < 65536


_AFTER_A_COMPILED_BACKWARD = """
import sys, warnings
import torch
from oslo import launch
from tests.test_launch import _gradient_of_a_square

if sys.argv[1] == "primed":
    launch.prime_autograd_for_fork()
step = torch.compile(lambda x: (x.sin() * 2).sum())
x = torch.ones(3, requires_grad=True)
step(x).backward()  # the process's first backward, unless primed
with warnings.catch_warnings(record=True) as caught, torch.no_grad():  # the launch's grad mode is not the ranks'
    warnings.simplefilter("always")
    results = launch.run(_gradient_of_a_square, 2, timeout=60)
print(results, launch.forked_ranks_can_run_autograd(),
      any("forkserver" in str(warning.message) for warning in caught))
"""


def _gradient_of_a_square(rank, world_size):
    with torch.enable_grad():  # a forked rank starts in the launching thread's grad mode
        x = torch.tensor([float(rank + 1)], requires_grad=True)
        (x * x).sum().backward()
    return x.grad.item()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("primed", [False, True])
def test_ranks_run_a_backward_after_this_process_ran_a_compiled_one(primed):
    """torch 2.14 refuses autograd in children forked from a process whose first backward was compiled: the
    launcher then starts the ranks with forkserver (and warns) instead of handing them that error; a process
    primed with one plain backward keeps fork. Under torch 2.13 fork works either way."""
    done = subprocess.run([sys.executable, "-c", _AFTER_A_COMPILED_BACKWARD, "primed" if primed else "compiled"],
                          cwd=ROOT, capture_output=True, text=True, timeout=230,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results, fork_works, warned = done.stdout.strip().splitlines()[-1].rsplit(" ", 2)
    assert results == "[2.0, 4.0]"
    assert warned == str(fork_works == "False")  # a warning exactly when the ranks could not be forked
    if primed:
        assert fork_works == "True"
