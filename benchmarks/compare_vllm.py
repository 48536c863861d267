"""specbatch against vLLM's CPU build on the same machine, the same token-id prompts, greedy.

For each dtype and speculation method, one process per engine holds it loaded (vLLM in its own
venv: ``scripts/build_vllm_cpu_venv.sh``); for every round and batch size B the two engines take
turns (the order alternating from round to round), each generating --max-tokens tokens for B
prompts submitted at once (64-token windows of the held-out stdlib files, in the model's own
tokens). Both
processes are pinned to the same CPU (--cpu) and run one torch thread; vLLM's engine core runs
in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so an idle engine takes no CPU. A cell's tok/s is
its output tokens over its time, both summed over the rounds; greedy agreement counts the
sequences whose tokens are identical in the two engines.

    python benchmarks/compare_vllm.py [--model FILE.gguf|DIR] [--dtypes float32 bfloat16] \
        [--methods plain k2 k4] [--batch-sizes 1 8 32 64] [--rounds 3] \
        [--out bench_results/compare_vllm.json]

--model: a Hugging Face checkpoint folder, or a GGUF file (or a folder holding one), which is
converted once to a float32 Hugging Face checkpoint beside it (``gguf_to_hf.py``) that both
engines then load, so that they run the same weights. Without it, the built-in pair.
Methods: plain, ngramN (prompt lookup), and on the built-in pair kN (its draft model drafting N
tokens) and eagleN (its EAGLE-3 head).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json

WORKER = Path(__file__).resolve().parent / "engine_worker.py"
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "vllm-cpu-venv" / "bin" / "python"


def method_args(method: str) -> list[str]:
    """plain, kN (draft model, N tokens), eagleN (the built-in EAGLE-3 head, N tokens) or
    ngramN (prompt lookup, N tokens)."""
    if method == "plain":
        return ["--method", "plain"]
    if method.startswith("ngram"):
        return ["--method", "ngram", "--k", method[5:] or "2"]
    if method.startswith("eagle"):
        return ["--method", "eagle3", "--k", method[5:] or "2"]
    if method.startswith("k"):
        return ["--method", "draft_model", "--k", method[1:]]
    raise SystemExit(f"--methods: unknown method {method!r} (plain, k2, ngram2, ...)")


class Worker:
    def __init__(self, python: str, engine: str, args: list[str], cpu: int) -> None:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            VLLM_CPU_OMP_THREADS_BIND="0"
            if engine == "vllm"
            else env.get("VLLM_CPU_OMP_THREADS_BIND", ""),
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TOKENIZERS_PARALLELISM="false",
        )
        cmd = ["taskset", "-c", str(cpu), python, str(WORKER), "--engine", engine, *args]
        self.engine = engine
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, cwd=str(Path(__file__).resolve().parent.parent),
        )  # fmt: skip
        self.startup = self._read()["startup_seconds"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"the {self.engine} worker exited (status {self.proc.wait()})")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens}) + "\n"
        )
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def resolve_model(model: str | None) -> str:
    """The checkpoint folder both engines load: the built-in target, a Hugging Face folder, or
    the float32 conversion of a GGUF file (or of the one GGUF file in a folder)."""
    from benchmarks.gguf_to_hf import gguf_to_hf
    from specbatch.model.model_pair import default_model_path

    if model is None:
        return default_model_path("target")
    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(f"--model {model}: no config.json and not one .gguf file")
        path = found[0]
    if path.is_file() and path.suffix == ".gguf":
        return str(gguf_to_hf(path))
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: not a GGUF file or a checkpoint folder")
    return str(path)


def heldout_prompts(tokenizer_path: str, n: int, length: int, seed: int) -> list[list[int]]:
    from specbatch.bench.workload import heldout_token_stream
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(tokenizer_path))
    rng = random.Random(seed)
    return [stream[s : s + length] for s in (rng.randrange(len(stream) - length) for _ in range(n))]


def run_config(
    args: argparse.Namespace, target: str, dtype: str, method: str, prompts: list[list[int]]
) -> list[dict]:
    from specbatch.model.model_pair import default_model_path

    draft = default_model_path("eagle" if method.startswith("eagle") else "draft")
    common = ["--target", target, "--draft", draft,
              "--dtype", dtype, "--max-model-len", "512", *method_args(method)]  # fmt: skip
    workers = {
        "vllm": Worker(args.vllm_python, "vllm", common, args.cpu),
        "specbatch": Worker(sys.executable, "specbatch", common, args.cpu),
    }
    try:
        cells: dict[int, dict[str, Any]] = {}
        for b in args.batch_sizes:  # warm-up: every shape once, not counted
            for w in workers.values():
                w.generate(prompts[:b], args.max_tokens)
            cells[b] = {
                name: {"seconds": 0.0, "tokens": 0, "drafts": [0, 0], "outputs": None}
                for name in workers
            }
        for r in range(args.rounds):
            for b in args.batch_sizes:
                order = list(workers) if (r + b) % 2 == 0 else list(reversed(workers))
                for name in order:
                    out = workers[name].generate(prompts[:b], args.max_tokens)
                    c = cells[b][name]
                    c["seconds"] += out["seconds"]
                    c["tokens"] += sum(len(o) for o in out["outputs"])
                    c["drafts"] = [x + y for x, y in zip(c["drafts"], out["drafts"])]
                    c["outputs"] = out["outputs"]
            print(f"  {dtype} {method}: round {r + 1}/{args.rounds} done", flush=True)
        results = []
        for b, c in cells.items():
            v, s = c["vllm"], c["specbatch"]
            same = sum(x == y for x, y in zip(v["outputs"], s["outputs"]))
            row = {
                "dtype": dtype,
                "method": method,
                "batch": b,
                "greedy_identical": same,
                "sequences": b,
            }
            for name, cell in (("vllm", v), ("specbatch", s)):
                row[f"{name}_tok_s"] = cell["tokens"] / cell["seconds"]
                prop, acc = cell["drafts"]
                row[f"{name}_acceptance"] = acc / prop if prop else None
                row[f"{name}_startup_s"] = workers[name].startup
            row["ratio"] = row["specbatch_tok_s"] / row["vllm_tok_s"]
            results.append(row)
        return results
    finally:
        for w in workers.values():
            w.close()


def table_row(r: dict[str, Any]) -> list[str]:
    acceptance = "-"
    if r["vllm_acceptance"] is not None:
        acceptance = f"{r['vllm_acceptance']:.2f} / {r['specbatch_acceptance']:.2f}"
    return [
        r["dtype"],
        r["method"],
        str(r["batch"]),
        f"{r['vllm_tok_s']:.0f}",
        f"{r['specbatch_tok_s']:.0f}",
        f"{r['ratio']:.2f}x",
        f"{r['greedy_identical']}/{r['sequences']}",
        acceptance,
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="FILE.gguf or a checkpoint folder")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=None, help="default: plain k2 k4 (plain)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU both engines are pinned to")
    ap.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    ap.add_argument("--out", default=str(RESULTS_DIR / "compare_vllm.json"))
    args = ap.parse_args(argv)
    if args.methods is None:
        args.methods = ["plain", "k2", "k4"] if args.model is None else ["plain"]
    for m in args.methods:
        method_args(m)
        if args.model is not None and m != "plain" and not m.startswith("ngram"):
            ap.error(f"--methods {m}: only plain and ngramN run with --model")
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: run scripts/build_vllm_cpu_venv.sh")
    try:
        target = resolve_model(args.model)
    except ValueError as e:
        ap.error(str(e))
    print(f"both engines load {target}", flush=True)
    prompts = heldout_prompts(target, max(args.batch_sizes), args.prompt_len, seed=0)
    rows: list[dict] = []
    for dtype in args.dtypes:
        for method in args.methods:
            rows += run_config(args, target, dtype, method, prompts)
    headers = ["dtype", "method", "batch", "vLLM tok/s", "specbatch tok/s", "specbatch/vLLM",
               "greedy identical", "acceptance vLLM / specbatch"]  # fmt: skip
    table = format_table(headers, [table_row(r) for r in rows])
    print(table)
    startups = {
        f"{r['dtype']} {r['method']}": (r["vllm_startup_s"], r["specbatch_startup_s"]) for r in rows
    }
    for key, (v, s) in startups.items():
        print(f"start-up {key}: vLLM {v:.1f} s, specbatch {s:.1f} s")
    print(f"both engines loaded {target}")
    info = {"machine": machine_info(), "args": vars(args), "checkpoint": target, "cells": rows}
    write_json(args.out, info)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
