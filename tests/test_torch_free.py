"""The scheduler, the draft-length policies and the KV cache are plain Python: importing them
loads no torch (a fresh interpreter, so that no other test's imports count)."""

import subprocess
import sys

MODULES = [
    "specbatch.scheduler.scheduler",
    "specbatch.scheduler.draft_controller",
    "specbatch.scheduler.row_costs",
    "specbatch.scheduler.prefix_sharing",
    "specbatch.kv_cache.kv_cache_manager",
    "specbatch.kv_cache.block_keys",
]


def test_the_scheduler_and_the_kv_cache_load_no_torch():
    code = "; ".join(
        [
            "import sys",
            *(f"import {m}" for m in MODULES),
            "assert all(m in sys.modules for m in sys.argv[1:])",
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *MODULES], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
