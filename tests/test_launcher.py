"""Real ranks: forked processes in a gloo process group, and nothing left behind.

Every test here starts processes, so the whole file is in the slow tier. Ranks
that must outlive the launch sleep "forever" (10**6 s), so the outcome does not
depend on how fast this machine is; timeouts are hang protection, except in
the test of the timeout itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from _processes import gone
from nbmem.whatif import launch_folders, launcher
from nbmem.whatif.launcher import RankError, run_ranks

pytestmark = pytest.mark.slow

FOREVER = 10**6  # seconds: longer than any launch waits


def test_every_rank_runs_in_one_process_group():
    def target(rank, world_size):
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        return rank, world_size, dist.get_rank(), value.item(), os.getpid()

    answers = run_ranks(target, 3, timeout=600)
    assert [answer[:4] for answer in answers] == [(rank, 3, rank, 6.0) for rank in range(3)]
    assert len({answer[4] for answer in answers} | {os.getpid()}) == 4  # three processes, none of them this one
    assert not dist.is_initialized()  # the caller's process never joined


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failing_rank_stops_the_launch_with_its_error_and_leaves_no_process(tmp_path):
    def target(rank, world_size):
        (tmp_path / f"pid{rank}.tmp").write_text(str(os.getpid()))
        os.replace(tmp_path / f"pid{rank}.tmp", tmp_path / f"pid{rank}")  # whole, whenever rank 1 sees it
        print(f"rank {rank} says hello")
        if rank == 1:
            # not before rank 0 has written its pid: a rank that fails leaves at once, and its peer may be
            # killed (or fail on the lost connection) before it got that far
            for _ in range(6000):
                if (tmp_path / "pid0").exists():
                    break
                time.sleep(0.01)
            raise ValueError("boom on rank 1")
        time.sleep(FOREVER)  # would outlive the launch if nbmem did not kill it

    # RankError, not TimeoutError: the failure itself stopped the launch (rank 0 never returns)
    with pytest.raises(RankError, match="rank 1 of 2 failed") as raised:
        run_ranks(target, 2, timeout=600)
    assert raised.value.rank == 1
    assert "ValueError: boom on rank 1" in str(raised.value)
    assert "in target" in str(raised.value)  # the rank's traceback, with the user's frame
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert not any(_alive(pid) for pid in pids)


def test_a_rank_that_dies_without_a_python_error_is_reported(tmp_path):
    def target(rank, world_size):
        if rank == 0:
            os.kill(os.getpid(), 9)
        time.sleep(FOREVER)

    with pytest.raises(RankError, match="(?s)rank 0 of 2 failed.*signal 9"):
        run_ranks(target, 2, timeout=600)


@pytest.mark.heavy  # waits out a deadline (20 s or more): CI runs it, a laptop's test command skips it
def test_timeout_kills_every_rank(tmp_path):
    def target(rank, world_size):
        (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
        time.sleep(FOREVER)

    # The ranks never finish, so any timeout ends in TimeoutError; 20 s leaves
    # a busy machine time to start both ranks (their pid files are read below).
    with pytest.raises(TimeoutError, match=r"longer than 20 s: rank\(s\) \[0, 1\]") as raised:
        run_ranks(target, 2, timeout=20)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert not any(_alive(pid) for pid in pids)
    # where each rank was stuck: the stack it wrote on the launch's SIGUSR1, the user's frame in it
    message = str(raised.value)
    for rank in range(2):
        stack = message.split(f"where rank {rank} was stuck")[1].split("where rank")[0]
        assert "most recent call first" in stack and "in target" in stack


@pytest.fixture
def report_then_hang(monkeypatch):
    """Each rank reports its error, then hangs (e.g. a teardown stuck on a peer): the forked ranks have
    the launcher module as patched here."""
    reported = launcher._report

    def report_then_hang(folder, rank):
        reported(folder, rank)
        time.sleep(FOREVER)

    monkeypatch.setattr(launcher, "_report", report_then_hang)


def _boom_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(FOREVER)


@pytest.mark.heavy  # waits out a deadline (20 s or more): CI runs it, a laptop's test command skips it
def test_a_rank_that_reported_its_error_but_does_not_exit_still_ends_the_launch(report_then_hang):
    # RankError soon after the report, not TimeoutError after 600 s; with where the rank hung since
    with pytest.raises(RankError, match="rank 1 of 2 failed") as raised:
        run_ranks(_boom_on_rank_1, 2, timeout=600)
    message = str(raised.value)
    assert raised.value.exitcode is None and raised.value.kind == "ValueError"
    assert "ValueError: boom on rank 1" in message and "then had not exited" in message
    stack = message.split("where rank 1 was stuck")[1]
    assert "in report_then_hang" in stack and "in _rank_main" in stack
    assert "in run_ranks" not in stack  # the parent's frames, which the fork copied, are left out


@pytest.mark.heavy  # waits out a deadline (20 s or more): CI runs it, a laptop's test command skips it
def test_a_reported_error_not_a_timeout_ends_a_launch_whose_deadline_comes_first(report_then_hang, monkeypatch):
    monkeypatch.setattr(launcher, "_REPORTED_EXIT_GRACE", FOREVER)  # the deadline comes first
    # 20 s leaves a busy machine time to start the ranks and report (as test_timeout_kills_every_rank)
    with pytest.raises(RankError, match="rank 1 of 2 failed") as raised:
        run_ranks(_boom_on_rank_1, 2, timeout=20)
    assert "ValueError: boom on rank 1" in str(raised.value)


def _die(how: str) -> None:
    if how == "exit":
        os._exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer sends
    ctypes.string_at(0)  # reads address 0: SIGSEGV


@pytest.mark.parametrize(
    "how, exitcode, says",
    [
        ("exit", 3, "it ended with exit code 3"),
        ("sigkill", -signal.SIGKILL, "it was killed by SIGKILL"),
        ("segfault", -signal.SIGSEGV, "it was killed by SIGSEGV"),
    ],
)
def test_a_rank_that_dies_hard_is_named_not_the_healthy_peer_that_lost_it(how, exitcode, says):
    def target(rank, world_size):
        if rank == 1:
            _die(how)
        # rank 0 waits for rank 1 in a collective and fails with gloo's "Connection reset/closed by peer"
        dist.all_reduce(torch.ones(1))
        time.sleep(120)

    with pytest.raises(RankError) as raised:
        run_ranks(target, 2, timeout=100)
    message = str(raised.value)
    assert raised.value.rank == 1 and raised.value.exitcode == exitcode
    assert raised.value.kind == ""  # no exception type: not read off the last line of its log
    assert message.startswith("rank 1 of 2 failed") and says in message
    assert "rank 0" not in message and "by peer" not in message  # nothing of the healthy rank's error


@pytest.mark.slow
def test_sigterm_to_the_parent_removes_the_launch_folder_and_every_rank(tmp_path):
    temporary = tmp_path / "tmp"  # the launch folder goes to TMPDIR: this one is the test's own
    temporary.mkdir()
    script = (
        "import os, time\n"
        "from nbmem.whatif.launcher import run_ranks\n"
        "def target(rank, world_size):\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'pid{{rank}}'), 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
        "run_ranks(target, 2, timeout=600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(temporary)})
    try:
        for _ in range(1200):  # both ranks started (a wait, not a timing assertion)
            if all((tmp_path / f"pid{rank}").exists() for rank in range(2)) or parent.poll() is not None:
                break
            time.sleep(0.1)
        assert parent.poll() is None and list(temporary.glob("nbmem-launch-*")), "the launch never started"
        time.sleep(0.2)  # both pid files written in full
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == -signal.SIGTERM  # it still dies of the signal, as without nbmem
    assert not list(temporary.glob("nbmem-launch-*"))
    assert all(gone(int((tmp_path / f"pid{rank}").read_text())) for rank in range(2))


@pytest.mark.interrupts  # real SIGINTs: under coverage one landed in the tracer holding its lock, and the run hung
@pytest.mark.parametrize("also_while_reaping", [False, True])
def test_ctrl_c_from_every_rank_stops_the_launch_once_and_reaps_every_rank(
    default_sigint, monkeypatch, also_while_reaping
):
    """Each rank sends the parent a Ctrl-C, so two arrive; one more while the ranks are killed and reaped.

    Before the launch held back a Ctrl-C during its cleanup, the second one
    could land inside the loop that kills and reaps the ranks, and they were
    left running (or as zombies). The third, sent from inside that loop,
    makes the test deterministic.
    """
    from nbmem.whatif import launcher
    from test_parallel import _children

    stop = launcher._stop

    def stop_with_ctrl_c(processes):
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once: Python runs the handler at the next check
        stop(processes)

    if also_while_reaping:
        monkeypatch.setattr(launcher, "_stop", stop_with_ctrl_c)

    def target(rank, world_size):
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(FOREVER)

    before = _children()
    with pytest.raises(KeyboardInterrupt):
        run_ranks(target, 2, timeout=600)
    assert _children() == before  # no rank left running, none left a zombie
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the launch's handler is gone


@pytest.mark.interrupts  # a real SIGINT (see above)
def test_a_ctrl_c_while_ranks_are_reaped_after_a_good_launch_is_raised_after(default_sigint, monkeypatch):
    from nbmem.whatif import launcher
    from test_parallel import _children

    stop = launcher._stop

    def stop_with_ctrl_c(processes):
        os.kill(os.getpid(), signal.SIGINT)
        stop(processes)

    monkeypatch.setattr(launcher, "_stop", stop_with_ctrl_c)
    before = _children()
    with pytest.raises(KeyboardInterrupt):  # the user's Ctrl-C is not lost, only held until the reaping is done
        run_ranks(lambda rank, world_size: rank, 2, timeout=600)
    assert _children() == before


def test_a_rank_gets_pythons_own_ctrl_c_not_the_launchs(default_sigint):
    """The launch holds a Ctrl-C while it forks; a rank must not inherit that handler (it would ignore Ctrl-C)."""
    answers = run_ranks(lambda rank, world_size: signal.getsignal(signal.SIGINT) is signal.default_int_handler, 2,
                        timeout=600)
    assert answers == [True, True]


def _start_launch_in_a_process(tmp_path, temporary):
    """A process running a 2-rank launch whose ranks sleep, in TMPDIR ``temporary``; returned once both ranks run."""
    script = (
        "import os, time\n"
        "from nbmem.whatif.launcher import run_ranks\n"
        "def target(rank, world_size):\n"
        f"    open(os.path.join({str(tmp_path)!r}, f'pid{{rank}}.tmp'), 'w').write(str(os.getpid()))\n"
        f"    os.replace(os.path.join({str(tmp_path)!r}, f'pid{{rank}}.tmp'), os.path.join({str(tmp_path)!r}, f'pid{{rank}}'))\n"
        "    time.sleep(300)\n"
        "run_ranks(target, 2, timeout=600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TMPDIR": str(temporary)})
    for _ in range(1200):  # both ranks started (a wait, not a timing assertion)
        if all((tmp_path / f"pid{rank}").exists() for rank in range(2)) or parent.poll() is not None:
            break
        time.sleep(0.1)
    if parent.poll() is not None:
        pytest.fail(f"the launch ended early, with exit code {parent.returncode}")
    return parent, [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]


def _every_thread_gone(pid: int) -> bool:
    """No thread of the process runs any more: its open files are closed (and its locks released).

    ``gone`` reads the main thread's state, which turns zombie while other threads (gloo's, in a rank)
    may still be exiting, holding the files they share: a lock checked then was still held.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return all(_gone_thread(pid, thread) for thread in threads)


def _gone_thread(pid: int, thread: str) -> bool:
    try:
        with open(f"/proc/{pid}/task/{thread}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_until_gone(pids):
    for _ in range(600):  # the ranks die of their parent's death; a wait for it, not a timing assertion
        if all(_every_thread_gone(pid) for pid in pids):
            return
        time.sleep(0.1)
    pytest.fail(f"ranks {pids} outlived their parent")


@pytest.mark.slow  # starts processes
def test_the_folder_of_a_launch_killed_with_sigkill_is_removed_by_the_next_launch(tmp_path, monkeypatch):
    """SIGKILL runs no cleanup in the parent and kills its ranks (PR_SET_PDEATHSIG): the folder stayed in /tmp for good."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    parent, ranks = _start_launch_in_a_process(tmp_path, temporary)
    try:
        [killed] = temporary.glob("nbmem-launch-*")
        parent.kill()
        parent.wait(timeout=60)
        _wait_until_gone(ranks)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert killed.exists()  # nothing removed it yet: what follows is the next launch's doing
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # this process's launches go there too
    assert run_ranks(lambda rank, world_size: rank, 1, timeout=600) == [0]
    assert not killed.exists()
    assert list(temporary.iterdir()) == []  # the next launch's own folder went as usual


@pytest.mark.slow  # starts processes
def test_a_live_launchs_folder_is_never_removed(tmp_path, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    parent, ranks = _start_launch_in_a_process(tmp_path, temporary)  # another process's launch
    try:
        [other] = temporary.glob("nbmem-launch-*")
        monkeypatch.setattr(tempfile, "tempdir", str(temporary))

        def target(rank, world_size):
            # from inside this process's own launch too: both launch folders are in use
            return launch_folders.remove_stale_folders(str(temporary)), sorted(temporary.glob("nbmem-launch-*"))

        [(removed, folders)] = run_ranks(target, 1, timeout=600)
        assert removed == [] and other in folders and len(folders) == 2
        assert other.exists() and not any(gone(pid) for pid in ranks)  # the other launch still runs, in its folder
    finally:
        parent.terminate()  # SIGTERM: the launch removes its folder and ranks (see the test above)
        parent.wait(timeout=60)
    assert parent.returncode == -signal.SIGTERM and list(temporary.iterdir()) == []


@pytest.mark.slow  # starts a process (for a pid that is not running)
def test_a_folder_without_its_lock_is_removed_only_when_its_pid_is_dead_and_it_is_this_users(tmp_path):
    """A launch killed between creating its folder and locking it leaves a folder with no lock file: the pid decides."""
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid runs nothing now (reused by another process within this test: improbable)
    dead = tmp_path / f"nbmem-launch-{finished.pid}-a"
    alive = tmp_path / f"nbmem-launch-{os.getpid()}-b"
    unnamed = tmp_path / "nbmem-launch-c1d2e3f4"  # an older launch's name: no pid in it, so left alone
    folders = [dead, alive, unnamed]
    if os.getuid() == 0:  # only root can make a folder another user's: elsewhere that case is not checked
        others = tmp_path / f"nbmem-launch-{finished.pid}-d"
        others.mkdir()
        os.chown(others, 65534, 65534)
        folders.append(others)
    for folder in (dead, alive, unnamed):
        folder.mkdir()
    assert launch_folders.remove_stale_folders(str(tmp_path)) == [str(dead)]
    assert sorted(tmp_path.iterdir()) == sorted(set(folders) - {dead})
