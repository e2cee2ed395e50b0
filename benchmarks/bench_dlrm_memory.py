"""Peak RSS per rank of a 2-rank DLRM run with one large table (issue 29, item 1).

    python benchmarks/bench_dlrm_memory.py [ROWS]          # default 25,000,000 rows in t0

Runs ``examples/dlrm/train.py`` under torchrun (2 ranks, 20 steps) with each rank reporting
its peak RSS (``resource.getrusage``) and prints them beside the plan's bytes for the table
(weights + row-wise Adagrad state). Run it from two checkouts to compare builds side by side.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(argv: list[str]) -> int:
    """One rank: the training script, then its peak RSS on stderr."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "dlrm"))
    import train

    try:
        return train.main(argv)
    finally:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        sys.stderr.write(f"PEAK_RSS rank {os.environ.get('RANK')} {peak_mib:.0f} MiB\n")


def main() -> int:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 25_000_000
    with tempfile.TemporaryDirectory() as out:
        args = [
            f"embedding.tables.0.num_embeddings={rows}",
            "training.steps=20",
            f"training.output_dir={out}",
            "training.plot=false",
            "checkpoint.every=0",
            "data.val_batches=1",
        ]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", __file__, "--worker"]
        command += [a for item in args for a in ("--set", item)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    peaks = sorted(line for line in done.stderr.splitlines() if line.startswith("PEAK_RSS"))
    table_mib = rows * 16 * 4 / 2**20 + rows * 4 / 2**20
    print(
        f"t0: {rows} rows x 16, weights + row-wise state {table_mib:.0f} MiB; rc {done.returncode}"
    )
    print("\n".join(peaks) or done.stderr[-3000:])
    return done.returncode


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
