"""Real ranks: forked processes in a gloo process group, and nothing left behind.

Every test here starts processes, so the whole file is in the slow tier. Ranks
that must outlive the launch sleep "forever" (10**6 s), so the outcome does not
depend on how fast this machine is; timeouts are hang protection, except in
the test of the timeout itself.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from nbmem.launcher import RankError, run_ranks

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
        (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
        print(f"rank {rank} says hello")
        if rank == 1:
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


def test_timeout_kills_every_rank(tmp_path):
    def target(rank, world_size):
        (tmp_path / f"pid{rank}").write_text(str(os.getpid()))
        time.sleep(FOREVER)

    # The ranks never finish, so any timeout ends in TimeoutError; 20 s leaves
    # a busy machine time to start both ranks (their pid files are read below).
    with pytest.raises(TimeoutError, match=r"longer than 20 s: rank\(s\) \[0, 1\]"):
        run_ranks(target, 2, timeout=20)
    pids = [int((tmp_path / f"pid{rank}").read_text()) for rank in range(2)]
    assert not any(_alive(pid) for pid in pids)
