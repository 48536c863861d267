"""SmolLM2-135M-Instruct from its Q4_1 GGUF: its matrices kept quantized against the same weights
dequantized to bfloat16 (SPECBATCH_GGUF_QUANTIZED=0), with and without n-gram speculation, and
llama-cpp-python on the same file where a Python with it is given: tokens/s at batch 1 (chat
prompts whose answers quote them, greedy, the engines taking turns prompt by prompt), tokens/s
at batch 64, and the resident size after loading (each in a fresh process).

    python scripts/fetch_smollm2.py      # once
    python benchmarks/quantized_gguf.py --threads 1 [--llama-cpp-python /path/to/venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, set_threads, write_json
from benchmarks.smollm2_ngram_chat import conversations
from scripts.fetch_smollm2 import fetch_smollm2
from specbatch import LLM, SamplingParams

_LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
model, threads, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts, eos = json.loads(sys.stdin.read())
no_eos = {int(t): -1e9 for t in eos}  # every answer max_tokens long, as ignore_eos
llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
            n_batch=512, verbose=False)
llm.create_completion(prompts[0], max_tokens=8, temperature=0.0)  # warm-up
out = []
for p in prompts:
    t, c = time.perf_counter(), time.process_time()
    r = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, top_k=1,
                              logit_bias=no_eos)
    n = r["usage"]["completion_tokens"]
    out.append((time.perf_counter() - t, time.process_time() - c, n))
print(json.dumps(out))
"""

_RSS = """
import os, sys
from specbatch import LLM
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=1024, num_kv_blocks=64)
rss = [ln for ln in open("/proc/self/status") if ln.startswith("VmRSS")][0].split()[1]
print(int(rss) // 1024)
"""


def engine(model: str, quantized: bool, **kw: Any) -> LLM:
    """An engine loading the file's matrices kept quantized, or dequantized to bfloat16."""
    os.environ["SPECBATCH_GGUF_QUANTIZED"] = "1" if quantized else "0"
    try:
        return LLM(model, dtype="bfloat16", max_model_len=1024, num_kv_blocks=2048, **kw)
    finally:
        del os.environ["SPECBATCH_GGUF_QUANTIZED"]


def rss_mb(model: str, quantized: bool) -> int:
    env = {**os.environ, "SPECBATCH_GGUF_QUANTIZED": "1" if quantized else "0"}
    out = subprocess.run([sys.executable, "-c", _RSS, model], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[-1])


def llama_cpp(
    python: str, model: str, threads: int, prompts: list[list[int]], eos: list[int], n: int
) -> Any:
    try:
        out = subprocess.run([python, "-c", _LLAMA_CPP, model, str(threads), str(n)],
                             input=json.dumps([prompts, eos]), capture_output=True, text=True,
                             check=True, timeout=3600)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"did not run: {e}"
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="n-gram draft tokens per round")
    ap.add_argument("--llama-cpp-python", default=None, help="a Python with llama_cpp installed")
    a = ap.parse_args()
    threads = set_threads(a.threads)
    model = str(fetch_smollm2())
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4}
    engines = {
        "bf16": engine(model, False),
        "quantized": engine(model, True),
        "quantized+ngram": engine(model, True, speculative_config=spec),
    }
    tok = engines["quantized"].get_tokenizer()
    convs = conversations()
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    workloads = {  # chat prompts (long, answers quoting them) and a short prompt (decoding)
        "chat": prompts,
        "short": [tok.encode("Once upon a time", add_special_tokens=False)] * 3,
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8),
                     use_tqdm=False)  # fmt: skip
    batch1: dict[str, dict[str, float]] = {}
    batch1_cpu: dict[str, dict[str, float]] = {}
    outputs: dict[str, list[list[int]]] = {n: [] for n in engines}
    for work, ps in workloads.items():
        seconds = dict.fromkeys(engines, 0.0)
        cpu = dict.fromkeys(engines, 0.0)  # the process's CPU time: the machine may be shared
        tokens = dict.fromkeys(engines, 0)
        for p in ps:  # batch 1, the engines in turn
            for name, llm in engines.items():
                t, c = time.perf_counter(), time.process_time()
                out = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
                seconds[name] += time.perf_counter() - t
                cpu[name] += time.process_time() - c
                tokens[name] += len(out[0].outputs[0].token_ids)
                outputs[name].append(out[0].outputs[0].token_ids)
        batch1[work] = {n: tokens[n] / seconds[n] for n in engines}
        batch1_cpu[work] = {n: tokens[n] / cpu[n] for n in engines}
    rows = [{"prompt_token_ids": prompts[i % len(prompts)][: 40 + i]} for i in range(a.batch)]
    short = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch_n, batch_n_cpu = {}, {}
    for name in ("bf16", "quantized"):
        t, c = time.perf_counter(), time.process_time()
        outs = engines[name].generate(rows, short, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        batch_n[name] = n / (time.perf_counter() - t)
        batch_n_cpu[name] = n / (time.process_time() - c)
    del engines
    rss = {"bf16": rss_mb(model, False), "quantized": rss_mb(model, True)}
    ref: dict[str, Any] = {}
    eos = sorted({t for t in (tok.eos_token_id, 0, 2) if t is not None})
    for work, ps in workloads.items():
        if a.llama_cpp_python:
            ref[work] = llama_cpp(a.llama_cpp_python, model, threads, ps, eos, a.max_tokens)
            if isinstance(ref[work], list):
                r = ref[work]
                batch1[work]["llama-cpp-python"] = sum(x[2] for x in r) / sum(x[0] for x in r)
                batch1_cpu[work]["llama-cpp-python"] = sum(x[2] for x in r) / sum(x[1] for x in r)
        print(f"batch 1, {work}: {len(ps)} prompts x {a.max_tokens} greedy tokens, "
              f"{threads} thread(s)")  # fmt: skip
        for label, rates in (("wall clock", batch1[work]), ("CPU time", batch1_cpu[work])):
            base = rates.get("llama-cpp-python")
            table = [[n, round(v, 1), "" if base is None else round(v / base, 2),
                      round(v / rates["bf16"], 2)] for n, v in rates.items()]  # fmt: skip
            print(format_table([f"engine ({label})", "tok/s", "x llama-cpp", "x bf16"], table))
    for label, rates in (("wall clock", batch_n), ("CPU time", batch_n_cpu)):
        text = ", ".join(f"{n} {v:.1f} tok/s" for n, v in rates.items())
        ratio = rates["quantized"] / rates["bf16"]
        print(f"batch {a.batch} x 64 tokens ({label}): {text} (quantized/bf16 {ratio:.2f})")
    print(f"RSS after loading: bf16 {rss['bf16']} MB, quantized {rss['quantized']} MB "
          f"({rss['bf16'] - rss['quantized']} MB less)")  # fmt: skip
    result = {
        "machine": machine_info(),
        "threads": threads,
        "max_tokens": a.max_tokens,
        "batch1_tok_s": batch1,
        "batch1_tok_per_cpu_s": batch1_cpu,
        f"batch{a.batch}_tok_s": batch_n,
        f"batch{a.batch}_tok_per_cpu_s": batch_n_cpu,
        "rss_mb": rss,
        "llama_cpp_python": ref,
        "greedy_quantized_equals_ngram": outputs["quantized"] == outputs["quantized+ngram"],
        "greedy_quantized_equals_bf16": outputs["quantized"] == outputs["bf16"],
    }
    RESULTS_DIR.mkdir(exist_ok=True)
    write_json(RESULTS_DIR / "quantized_gguf.json", result)


if __name__ == "__main__":
    main()
