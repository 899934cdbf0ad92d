"""Run functions in spawned gloo process groups (CPU) and collect what each rank reports.

    results = run_group(world=4, entry=my_cases.worker, args=(...), deadline_s=240)

`entry(rank, world, port, outdir, *args)` runs in each process (importable by reference: a
module-level function of a module on sys.path); it writes `result_<rank>.json` (a dict) to
outdir, typically through `write_result`. `run_group` waits for every process (killing them
all past the deadline: a hang fails the test instead of stalling the suite) and returns
{rank: that rank's dict}; a rank that wrote nothing maps to None.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["free_port", "init_gloo", "run_group", "write_result", "merge_cases"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float = 60.0) -> None:
    """This spawned process joins a gloo group on localhost (one thread: the cores are shared)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def write_result(outdir: str, rank: int, result: Dict[str, Any]) -> None:
    with open(os.path.join(outdir, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)


def run_group(world: int, entry: Callable, args: tuple, outdir: str,
              deadline_s: float = 240.0) -> Dict[int, Optional[Dict[str, Any]]]:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(entry, args=(world, free_port(), outdir) + tuple(args), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while True:
            try:
                if ctx.join(timeout=2):
                    break
            except mp.ProcessRaisedException:  # a rank's entry raised: its result file tells what happened
                pass
            except mp.ProcessExitedException:
                pass
            if all(not p.is_alive() for p in ctx.processes):
                break
            if time.monotonic() > end:
                raise TimeoutError(f"the {world}-process group did not finish in {deadline_s} s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out: Dict[int, Optional[Dict[str, Any]]] = {}
    for r in range(world):
        path = os.path.join(outdir, f"result_{r}.json")
        out[r] = json.load(open(path)) if os.path.exists(path) else None
    return out


def merge_cases(results: Dict[int, Optional[Dict[str, Any]]]) -> Dict[str, tuple]:
    """{case: (ok on every rank, the failing ranks' messages)} from per-rank {case: [ok, message]} dicts."""
    merged: Dict[str, tuple] = {}
    for rank, res in results.items():
        if res is None:
            merged.setdefault("<startup>", (False, ""))
            merged["<startup>"] = (False, merged["<startup>"][1] + f"rank {rank} reported nothing\n")
            continue
        for name, (ok, msg) in res.items():
            prev = merged.get(name, (True, ""))
            merged[name] = (prev[0] and ok, prev[1] + ("" if ok else msg + "\n"))
    return merged
