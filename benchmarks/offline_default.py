"""The offline job as a new user runs it: ``specbatch generate`` over a prompts file with the
defaults, against the same job with speculation off (``--num-speculative-tokens 0``).

The prompts are windows of 40-400 characters of the standard library's sources (one JSON line
each). The two settings run as whole commands, one after the other in alternating order for
``--rounds`` rounds, each on one thread pinned to CPU 0 where ``taskset`` exists; each run's
tokens/s is the one its closing summary prints. Prints a table, writes JSON.

    python benchmarks/offline_default.py [--lines 5000] [--max-num-seqs 256] [--rounds 2] \
        [--max-tokens 32] [--out bench_results/offline_default.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json

SETTINGS = {"default": [], "plain": ["--num-speculative-tokens", "0"]}
SUMMARY = re.compile(r"\(([\d.]+) tokens/s\)(.*)$", re.MULTILINE)


def stdlib_windows(lines: int, seed: int) -> list[str]:
    """``lines`` windows of 40-400 characters of the standard library's Python sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < lines:
        text = rng.choice(files).read_text(errors="ignore")
        if len(text) < 400:
            continue
        start = rng.randrange(len(text) - 400)
        window = text[start : start + rng.randint(40, 400)]
        if window.strip():
            out.append(window)
    return out


def run(setting: str, prompts: Path, args: argparse.Namespace, workdir: Path) -> dict:
    cmd = [
        "specbatch", "generate", "--prompts", str(prompts), "--output",
        str(workdir / f"{setting}.jsonl"), "--max-tokens", str(args.max_tokens),
        "--max-num-seqs", str(args.max_num_seqs), "--no-progress", *SETTINGS[setting],
    ]  # fmt: skip
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    found = SUMMARY.search(done.stdout + done.stderr)
    if found is None:
        raise SystemExit(f"no closing summary in the output of {' '.join(cmd)}")
    return {"tokens_per_s": float(found.group(1)), "summary": found.group(2).strip(" ;")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=5000)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS_DIR / "offline_default.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompts = workdir / "prompts.jsonl"
        with prompts.open("w") as f:
            for text in stdlib_windows(args.lines, args.seed):
                f.write(json.dumps({"prompt": text}) + "\n")
        runs = []
        for i in range(args.rounds):
            order = ["default", "plain"] if i % 2 == 0 else ["plain", "default"]
            for setting in order:
                got = run(setting, prompts, args, workdir)
                runs.append({"round": i, "setting": setting, **got})
                print(f"round {i} {setting}: {runs[-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    rows = []
    for i in range(args.rounds):
        got = {r["setting"]: r for r in runs if r["round"] == i}
        ratio = got["default"]["tokens_per_s"] / got["plain"]["tokens_per_s"]
        rows.append([i, got["default"]["tokens_per_s"], got["plain"]["tokens_per_s"], ratio,
                     got["default"]["summary"]])  # fmt: skip
    print(format_table(["round", "default tok/s", "plain tok/s", "default / plain", "summary"],
                       rows))  # fmt: skip
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
