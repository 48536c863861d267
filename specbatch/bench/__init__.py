"""Load tests of the engine: ``offline`` (closed loop over batch sizes x draft lengths) and the
report writers. The command line is ``specbatch bench`` (``specbatch.entrypoints.bench``)."""

from specbatch.bench.bench_config import BenchConfig
from specbatch.bench.cells import CellResult
from specbatch.bench.offline import BenchResult, run_bench

__all__ = ["BenchConfig", "BenchResult", "CellResult", "run_bench"]
