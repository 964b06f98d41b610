"""The fixed cost of a dist_convert launch, timed by ``bench`` as its own method: start the
interpreter, import the CLI with every format, join the process group, and leave it.

  python -m dist_convert.bench.startup --stats-json FILE [--nproc N]   (dist_convert's own launch)
  torchrun --nproc_per_node=N -m dist_convert.bench.startup --stats-json FILE
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m dist_convert.bench.startup", description=__doc__)
    p.add_argument("--stats-json", type=Path, required=True)
    p.add_argument("--nproc", type=int, default=None, help="start N local workers as `dist_convert --nproc` does")
    a = p.parse_args(argv)
    if a.nproc is not None:
        from ..launch import run_workers
        return run_workers(a.nproc, ["-m", "dist_convert.bench.startup", "--stats-json", str(a.stats_json)])
    from .. import cli  # noqa: F401 - the import is what is timed
    from ..runtime import init_runtime, peak_rss_bytes

    rt = init_runtime()
    try:
        rt.barrier()
        stats = rt.all_gather_object({"wall_s": time.perf_counter() - t0, "peak_rss": peak_rss_bytes()})
        if rt.rank == 0:
            a.stats_json.write_text(json.dumps(stats))
    finally:
        # leave the group together, as every dist_convert command does: a process that exits with its
        # gloo group alive aborts in the group's destructor ("terminate called without an active
        # exception", SIGABRT) when a peer's connection is still being torn down, as happens under load
        rt.close()
    return 0


if __name__ == "__main__":
    from ..cli import leave
    leave(main())
