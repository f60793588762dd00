"""Run a worker function on gloo ranks in fresh processes, with a deadline (not a test module).

Each rank runs `main(rank, world_size, port, out_dir, *args)` and writes `out_dir/rank{r}.json`.
A rank still running at the deadline is killed and the calling test fails, so a hung collective
fails the run instead of hanging it (each worker also gives its process group a timeout).
"""

from __future__ import annotations

import json
import pathlib
import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(main, world_size: int, out_dir, timeout_s: float, *args) -> dict:
    """`{rank: the rank's JSON}` after running `main` on `world_size` spawned ranks."""
    context = mp.start_processes(
        main,
        args=(world_size, free_port(), str(out_dir), *args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    out_dir = pathlib.Path(out_dir)
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)}
