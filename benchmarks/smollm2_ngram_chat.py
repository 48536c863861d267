"""n-gram speculation on SmolLM2-135M-Instruct, on chat prompts whose answers quote the prompt
(edit this code, fix this text, extract these lines): tokens/s with and without it, greedy,
each prompt alone (batch 1) and all at once, the two engines taking turns prompt by prompt.

    python scripts/fetch_smollm2.py      # once
    python benchmarks/smollm2_ngram_chat.py --threads 1 [--dtype float32] [--k 3] [--max-tokens 192]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, machine_info, set_threads
from scripts.fetch_smollm2 import fetch_smollm2
from specbatch import LLM, SamplingParams


def _source(obj: Any) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def conversations() -> list[list[dict[str, str]]]:
    import colorsys
    import shlex
    import string

    text = (
        "Teh meeting is moved to thursday at 3pm in room 204. Please bring you laptop and "
        "the quarterly report. Lunch will be provided, but let us know if you have any "
        "alergies. The agenda is budget review, hiring plans and the office move."
    )
    asks = [
        f"Rename the function to `to_hls`; return the full code.\n\n{_source(colorsys.rgb_to_hls)}",
        f"Add a docstring to this function and return the full code.\n\n{_source(shlex.quote)}",
        f"Add type hints to this function. Reply with the code only.\n\n{_source(string.capwords)}",
        f"Fix the spelling mistakes in this text and return the corrected text.\n\n{text}",
        f"Copy the sentences of this text that mention a time or a place.\n\n{text}",
        f"Rewrite this text as a bulleted list, keeping its wording.\n\n{text}",
    ]
    return [[{"role": "user", "content": a}] for a in asks]


def run(llm: LLM, convs: list, params: SamplingParams) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    threads = set_threads(a.threads)
    model = str(fetch_smollm2())
    common = dict(dtype=a.dtype, max_model_len=1024, num_kv_blocks=1024)
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4}
    engines = {
        "plain": LLM(model, **common),
        "ngram": LLM(model, speculative_config=spec, **common),
    }
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    convs = conversations()
    for llm in engines.values():
        run(llm, convs[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    times = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for conv in convs:  # batch 1, the engines in turn
        for name, llm in engines.items():
            dt, out = run(llm, [conv], params)
            times[name] += dt
            tokens[name] += len(out[0])
            outputs[name] += out
    batch = {name: run(llm, convs, params) for name, llm in engines.items()}
    summary = engines["ngram"].engine.metrics.summary()
    result = {
        "machine": machine_info(),
        "threads": threads,
        "dtype": a.dtype,
        "k": a.k,
        "batch1_tok_s": {n: tokens[n] / times[n] for n in engines},
        "batch1_speedup": (tokens["ngram"] / times["ngram"]) / (tokens["plain"] / times["plain"]),
        f"batch{len(convs)}_tok_s": {n: sum(map(len, o)) / t for n, (t, o) in batch.items()},
        "acceptance_rate": summary["acceptance_rate"],
        "mean_tokens_per_round": summary["mean_tokens_per_round"],
        "greedy_outputs_equal": outputs["plain"] == outputs["ngram"],
        "output_tokens": tokens["plain"],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"smollm2_ngram_chat_{a.dtype}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
