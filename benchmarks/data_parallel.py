"""Data-parallel replicas against one engine, offline and serving, on the built-in pair.

``generate``: the same prompts file (windows of the pair's held-out stdlib files, as token ids)
through ``specbatch generate`` with one engine and with ``--data-parallel-size N``, in turns,
round by round; each run's tokens/s is the command's own figure (generation only, start-up
excluded). Greedy: the outputs of every index must be identical.

``serve``: ``specbatch serve`` with one engine and with N replicas, in turns, each loaded by
``specbatch bench serve`` at every request rate given; throughput and time per output token.

One torch thread per engine or replica: the single engine runs with ``OMP_NUM_THREADS=1``, the
replicas get one each (the node's CPUs shared out). The load generator, the server's front end
and Ray's own processes share the same machine.

    python benchmarks/data_parallel.py generate [--prompts 512 --max-tokens 64 --rounds 2]
    python benchmarks/data_parallel.py serve [--rates 1,inf --num-prompts 256 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json

CLI = [sys.executable, "-m", "specbatch.entrypoints.cli"]
RATE = re.compile(r"output tokens in ([0-9.]+) s \(([0-9.]+) tokens/s\)")


def env(dp: int) -> dict[str, str]:
    e = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    e.setdefault("RAY_AUTH_MODE", "disabled")
    if dp == 1:
        e["OMP_NUM_THREADS"] = "1"
    return e


def write_prompts(path: Path, n: int, input_len: int, seed: int) -> Path:
    import random

    from specbatch.bench.workload import heldout_token_stream
    from specbatch.model.model_pair import default_model_path
    from specbatch.tokenizer import load_tokenizer

    stream, _ = heldout_token_stream(load_tokenizer(default_model_path("target")))
    rng = random.Random(seed)
    starts = [rng.randrange(len(stream) - input_len) for _ in range(n)]
    lines = [json.dumps({"prompt_token_ids": stream[s : s + input_len]}) for s in starts]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_generate(prompts: Path, out: Path, dp: int, max_tokens: int) -> dict[str, Any]:
    cmd = [*CLI, "generate", "--prompts", str(prompts), "--output", str(out)]
    cmd += ["--temperature", "0", "--max-tokens", str(max_tokens), "--ignore-eos"]
    cmd += ["--no-progress", "--data-parallel-size", str(dp)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(dp), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"generate (dp={dp}) failed:\n{proc.stderr[-3000:]}")
    m = RATE.search(proc.stderr)
    assert m, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = {r["index"]: r["token_ids"] for r in rows}
    return {
        "dp": dp,
        "tok_s": float(m.group(2)),
        "gen_s": float(m.group(1)),
        "wall_s": time.perf_counter() - t0,
        "tokens": tokens,
    }


def generate(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dp_bench_"))
    prompts = write_prompts(work / "prompts.jsonl", args.prompts, args.input_len, args.seed)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [1, args.dp] if r % 2 == 0 else [args.dp, 1]
        for dp in order:
            run = run_generate(prompts, work / f"out_{dp}_{r}.jsonl", dp, args.max_tokens)
            print(f"round {r + 1} dp={dp}: {run['tok_s']:.1f} tok/s", flush=True)
            runs.append({**run, "round": r})
    ones = [x for x in runs if x["dp"] == 1]
    same = all(x["tokens"] == ones[0]["tokens"] for x in runs)
    ratios = []
    for r in range(args.rounds):
        a, b = (next(x for x in runs if x["round"] == r and x["dp"] == d) for d in (1, args.dp))
        ratios.append(b["tok_s"] / a["tok_s"])
    rows = [[x["round"] + 1, x["dp"], x["tok_s"], x["gen_s"], x["wall_s"]] for x in runs]
    print(format_table(["round", "dp", "tok/s", "generation s", "wall s"], rows))
    print(f"dp={args.dp} / dp=1 per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"identical outputs at every index in every run: {same}")
    for x in runs:
        del x["tokens"]
    return {"runs": runs, "ratios": ratios, "identical_outputs": same}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_serve(dp: int, rates: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    port = free_port()
    log = open(work / f"serve_{dp}.log", "w")  # noqa: SIM115 (held while the server runs)
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--port",
            str(port),
            "--data-parallel-size",
            str(dp),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env(dp),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve (dp={dp}) did not start; see {log.name}")
            time.sleep(0.5)
        out = work / f"bench_{dp}.json"
        cmd = [*CLI, "bench", "serve", "--base-url", url, "--request-rate", rates]
        cmd += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
        cmd += ["--ignore-eos", "--output-json", str(out), "--output-png", str(work / "x.png")]
        cmd += ["--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(1), timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"bench serve failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["runs"]
    finally:
        server.terminate()
        server.wait(120)
        log.close()


def serve(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="dp_serve_"))
    runs = []
    for r in range(args.rounds):
        order = [1, args.dp] if r % 2 == 0 else [args.dp, 1]
        for dp in order:
            for res in bench_serve(dp, args.rates, args, work):
                runs.append({"round": r, "dp": dp, **res})
                print(
                    f"round {r + 1} dp={dp} rate={res.get('request_rate')}: "
                    f"{res.get('output_throughput', 0):.1f} tok/s, "
                    f"TPOT {res.get('tpot_ms', {}).get('mean', float('nan')):.1f} ms",
                    flush=True,
                )
    rows = [
        [
            x["round"] + 1,
            x["dp"],
            x.get("request_rate"),
            x.get("output_throughput"),
            x.get("tpot_ms", {}).get("mean"),
            x.get("ttft_ms", {}).get("mean"),
        ]
        for x in runs
    ]
    print(format_table(["round", "dp", "rate", "out tok/s", "TPOT ms", "TTFT ms"], rows))
    summary = {}
    for rate in {str(x.get("request_rate")) for x in runs}:
        one = [x for x in runs if x["dp"] == 1 and str(x.get("request_rate")) == rate]
        many = [x for x in runs if x["dp"] == args.dp and str(x.get("request_rate")) == rate]
        summary[rate] = {
            "throughput_ratio": statistics.median(
                b["output_throughput"] / a["output_throughput"] for a, b in zip(one, many)
            ),
            "tpot_ratio": statistics.median(
                b["tpot_ms"]["mean"] / a["tpot_ms"]["mean"] for a, b in zip(one, many)
            ),
        }
        print(f"rate {rate}: dp={args.dp} / dp=1 (median over rounds) {summary[rate]}")
    return {"runs": runs, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("generate", "serve"))
    p.add_argument("--dp", type=int, default=2, help="replicas against one engine (default 2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=512, help="generate: prompts (default 512)")
    p.add_argument("--input-len", type=int, default=64, help="generate: prompt tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rates", default="1,inf", help="serve: request rates (default 1,inf)")
    p.add_argument("--num-prompts", type=int, default=256, help="serve: requests per rate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    result = generate(args) if args.mode == "generate" else serve(args)
    path = RESULTS_DIR / f"data_parallel_{args.mode}.json"
    write_json(path, {"args": vars(args), "machine": machine_info(), **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
