"""One engine (vLLM or specbatch) held in a process of its own, answering generate calls.

``compare_vllm.py`` starts one per engine and configuration, in each engine's own virtual
environment, and sends JSON lines on stdin; every answer is one stdout line starting with
``@@`` (engines log to stdout too). Runs under vLLM's venv: imports nothing of specbatch there.

    {"cmd": "generate", "prompts": [[ids...], ...], "max_tokens": 64}
        -> {"seconds": ..., "outputs": [[ids...], ...], "drafts": [proposed, accepted]}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def reply(obj: Any) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def spec_config(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.method == "plain":
        return None
    cfg: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method in ("draft_model", "eagle3"):
        cfg["model"] = args.draft
    else:
        cfg["prompt_lookup_max"] = args.lookup_max
        cfg["prompt_lookup_min"] = args.lookup_min
    return cfg


class VllmEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=args.target,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=0,
            enable_prefix_caching=False,
            disable_log_stats=False,
            speculative_config=spec_config(args),
        )
        self.params = SamplingParams

    def drafts(self) -> list[int]:
        proposed = accepted = 0
        for m in self.llm.get_metrics():
            if m.name == "vllm:spec_decode_num_draft_tokens":
                proposed = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens":
                accepted = int(m.value)
        return [proposed, accepted]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


class SpecbatchEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        from specbatch import LLM

        cfg = spec_config(args)
        kwargs: dict[str, Any] = {"speculative_config": cfg}
        if cfg is None:
            kwargs = {"num_speculative_tokens": 0}
        self.llm = LLM(
            model=args.target,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=256,
            seed=0,
            **kwargs,
        )

    def drafts(self) -> list[int]:
        s = self.llm.engine.metrics.spec
        return [s.proposed, s.accepted]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from specbatch import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "specbatch"], required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="float32")
    methods = ["plain", "draft_model", "eagle3", "ngram"]
    ap.add_argument("--method", default="plain", choices=methods)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    engine = VllmEngine(args) if args.engine == "vllm" else SpecbatchEngine(args)
    reply({"ready": True, "startup_seconds": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        before = engine.drafts()
        t = time.perf_counter()
        outputs = engine.generate(cmd["prompts"], cmd["max_tokens"])
        seconds = time.perf_counter() - t
        after = engine.drafts()
        reply(
            {
                "seconds": seconds,
                "outputs": outputs,
                "drafts": [a - b for a, b in zip(after, before)],
            }
        )


if __name__ == "__main__":
    main()
