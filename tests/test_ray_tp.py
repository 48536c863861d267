"""Tensor parallelism over Ray, end to end on CPU: two gloo ranks as Ray actors.

One local Ray instance (2 logical CPUs) serves every test here (``ray_cluster``); each engine
puts its two actors (``num_cpus=0``) in a placement group of two tiny CPU bundles. The model
pair is a tiny target (vocab 32, 4 query / 2 KV heads, so TP=2 divides everything) and a
perturbed copy of it as the draft; the exactness machinery is ``test_exactness``'s.

What is checked: TP=2 outputs are token-identical to TP=1 (greedy and seeded sampling, with and
without speculation, the draft replicated or sharded, self_sparse on the target's shards); the
sampled joint is the target's (chi-square, one gamma and temperature); one Ray round per engine
step; bad sizes fail before anything loads; a killed or hung worker turns into ``EngineError``
within the bound; no KV block leaks; after shutdown (or a failure) the actors and the placement
group are gone; the CLI joins an existing cluster by address.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch import LLM, EngineError, InvalidInputError, SamplingParams
from specbatch.scheduler.draft_controller import DraftController
from tests.helpers import exact_joint, make_perturbed_draft
from tests.test_exactness import PROMPT, assert_matches, engine, sample_sequences

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    # one Ray on the machine at a time: pytest-xdist runs every test that starts Ray on one
    # worker (two clusters at once on 2 cores put each other's timeouts at risk)
    pytest.mark.xdist_group("ray"),
]

SEED = 3
GAMMA = 3
N_EXACT = 4000  # fewer samples than test_exactness (one configuration, TP=2 on 2 cores)
PROMPTS: list[Any] = [
    {"prompt_token_ids": PROMPT},
    {"prompt_token_ids": [7, 8, 9]},
    {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]},
    {"prompt_token_ids": [10]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
    for i in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray, started once for all the Ray tests (they all live in this module, so the
    instance goes away when they are done, not at the end of the run); yields its address.
    Move it to conftest.py with scope="session" when another module needs Ray."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # see RAY_NOTES.md
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 << 20,
            logging_level="WARNING",
            _node_ip_address="127.0.0.1",
        )
    yield ray.get_runtime_context().gcs_address
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """Target and a perturbed copy as draft: vocab 32, 4 query / 2 KV heads (TP=2 divides)."""
    target = make_checkpoint(
        "llama",
        vocab_size=32,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seed=3,
        max_position_embeddings=64,
    )
    draft = make_perturbed_draft(target, tmp_path_factory.mktemp("draft"), noise=0.25, seed=1)
    return target, draft


@pytest.fixture(scope="module")
def engines(pair, ray_cluster) -> Iterator[Any]:
    """``get(name, tp)``: one engine per (configuration, TP size), built on first use."""
    built: dict[tuple[str, int], LLM] = {}

    def get(name: str, tp: int) -> LLM:
        if (name, tp) not in built:
            if name == "eagle":
                from specbatch.testing.eagle_heads import make_eagle_head

                head = make_eagle_head(pair[0].parent / "eagle_head", pair[0], "eagle", seed=5,
                                       with_embedding=True)  # fmt: skip
                built[name, tp] = LLM(
                    str(pair[0]),
                    speculative_config={"method": "eagle", "model": str(head),
                                        "num_speculative_tokens": GAMMA},
                    seed=SEED, tensor_parallel_size=tp, max_num_seqs=256, num_kv_blocks=512,
                    block_size=4, max_model_len=64,
                )  # fmt: skip
            elif name in ("ngram", "self_sparse"):
                keys = {"prompt_lookup_min": 1} if name == "ngram" else {"window": 8, "sinks": 4}
                built[name, tp] = LLM(
                    str(pair[0]),
                    speculative_config={"method": name, "num_speculative_tokens": GAMMA, **keys},
                    seed=SEED, tensor_parallel_size=tp, max_num_seqs=256, num_kv_blocks=512,
                    block_size=4, max_model_len=64,
                )  # fmt: skip
            else:
                gamma = {"plain": 0, "spec": GAMMA, "auto": "auto"}[name]
                built[name, tp] = engine(pair, gamma, seed=SEED, tensor_parallel_size=tp)
        return built[name, tp]

    yield get
    for llm in built.values():
        llm.shutdown()


def token_ids(llm: LLM, params: Any) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks  # no block leaks
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_released(executor: Any) -> None:
    """The executor's actors are dead (their processes too) and its placement group removed."""
    handles = list(executor.workers)
    assert handles == [], "the executor still holds actor handles"
    pids = [pid for _, _, pid in executor.locations]
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _process_alive(pid)]
        time.sleep(0.2)
    assert not alive, f"actor processes still running: {alive}"
    assert not named_actors() & set(executor.actor_names)
    deadline = time.monotonic() + 20
    state = None
    while time.monotonic() < deadline:
        state = ray.util.placement_group_table(executor.placement_group)["state"]
        if state == "REMOVED":
            break
        time.sleep(0.2)
    assert state == "REMOVED"


def named_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# ---- outputs equal TP=1 --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["plain", "spec", "ngram", "eagle", "self_sparse"])
def test_greedy_tp2_equals_tp1(engines, name: str) -> None:
    assert token_ids(engines(name, 2), GREEDY) == token_ids(engines(name, 1), GREEDY)
    if name in ("ngram", "eagle", "self_sparse"):
        assert engines(name, 2).engine.metrics.spec.proposed > 0


@pytest.mark.parametrize("name", ["plain", "spec", "ngram", "eagle", "self_sparse"])
def test_seeded_sampling_tp2_equals_tp1(engines, name: str) -> None:
    assert token_ids(engines(name, 2), SEEDED) == token_ids(engines(name, 1), SEEDED)


@pytest.mark.parametrize("name", ["spec", "eagle"])
def test_penalties_logprobs_and_n_tp2_equal_tp1(engines, name: str) -> None:
    """Every rank keeps the same histories and forks: penalised, seeded n = 2 completions
    with their logprobs are those of TP=1 (logprobs to float rounding of the sharded sums)."""
    params = SamplingParams(
        temperature=0.8, max_tokens=10, ignore_eos=True, seed=3, n=2, logprobs=3,
        presence_penalty=0.5, repetition_penalty=1.2, min_tokens=2,
    )  # fmt: skip

    def run(tp: int) -> list[Any]:
        llm = engines(name, tp)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
        return [c for o in outs for c in o.outputs]

    one, two = run(1), run(2)
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    for a, b in zip(one, two):
        got = [e[t].logprob for e, t in zip(b.logprobs, b.token_ids)]
        want = [e[t].logprob for e, t in zip(a.logprobs, a.token_ids)]
        assert got == pytest.approx(want, abs=1e-4)


def test_auto_decodes_as_tp1(engines) -> None:
    llm = engines("auto", 2)
    assert isinstance(llm.engine.scheduler.policy, DraftController)
    assert token_ids(llm, GREEDY) == token_ids(engines("plain", 1), GREEDY)
    counts = llm.engine.metrics.draft_length_counts
    assert sum(n for g, n in counts.items() if g > 0) > 0  # it drafted


def test_one_ray_round_per_step_and_timings(engines) -> None:
    llm = engines("spec", 2)
    executor = llm.engine.executor
    rounds = []
    real = executor._call_ranks

    def counting(what: str, refs: list[Any], timeout: float) -> list[Any]:
        rounds.append((what, len(refs)))
        return real(what, refs, timeout)

    executor._call_ranks = counting
    try:
        steps = llm.engine.metrics.num_steps
        results = []
        real_execute = executor.execute

        def keep(plan: Any) -> Any:
            results.append(real_execute(plan))
            return results[-1]

        executor.execute = keep
        token_ids(llm, GREEDY)
    finally:
        del executor._call_ranks, executor.execute
    assert rounds == [("an engine step", 2)] * (llm.engine.metrics.num_steps - steps)
    for r in results:
        assert {"draft", "target", "worker", "collectives", "ray"} <= set(r.timings)
        assert 0 < r.timings["collectives"] < r.timings["worker"]


def test_exactness_at_tp2(engines, pair) -> None:
    llm = engines("spec", 2)
    spec = llm.engine.metrics.spec
    proposed, accepted = spec.proposed, spec.accepted
    params = [SamplingParams(temperature=1.0, max_tokens=GAMMA + 2, ignore_eos=True)] * N_EXACT
    samples = sample_sequences(llm, params)  # also asserts that every KV block came back
    rate = (spec.accepted - accepted) / max(1, spec.proposed - proposed)
    assert 0.05 < rate < 0.98  # rejections and acceptances both happen
    # 4,000 samples of a 32-token joint: gross errors only (test_exactness's tests are rated)
    assert_matches(samples, exact_joint(pair[0], PROMPT, 3, 1.0, 1.0), tv=None)


def test_sharded_draft_equals_tp1_and_shutdown_releases_everything(engines, pair) -> None:
    llm = engine(pair, GAMMA, seed=SEED, tensor_parallel_size=2, draft_tensor_parallel_size=2)
    try:
        assert llm.engine.executor.rendezvous.host == "127.0.0.1"  # one node: loopback
        assert token_ids(llm, GREEDY) == token_ids(engines("spec", 1), GREEDY)
        assert token_ids(llm, SEEDED) == token_ids(engines("spec", 1), SEEDED)
    finally:
        llm.shutdown()
    assert_released(llm.engine.executor)
    llm.shutdown()  # twice is fine
    assert ray.is_initialized()  # the executor did not start Ray, so it leaves it running


def test_structured_outputs_tp2_equal_tp1(ray_cluster, make_checkpoint) -> None:
    """Every rank keeps a matcher of the request's grammar (compiled by the engine, rebuilt
    from its JSON on each rank): seeded structured outputs at TP=2 are those of TP=1."""
    target = make_checkpoint("llama", with_tokenizer=True)  # 4 / 2 heads: TP=2 divides
    config = {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 1}
    prompts = ["yes or no? yes", "pick: abc abd", '{"n": 1, "n": 2}']
    specs = [{"choice": ["yes", "no"]}, {"regex": "ab[cd]{1,4}"},
             {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}]  # fmt: skip
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, structured_outputs=spec)
              for i, spec in enumerate(specs)]  # fmt: skip
    outs = []
    for tp in (1, 2):
        llm = LLM(str(target), speculative_config=config, tensor_parallel_size=tp,
                  num_kv_blocks=128, block_size=4, max_model_len=64)  # fmt: skip
        try:
            got = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


# ---- errors --------------------------------------------------------------------------------
def test_sizes_that_tp_does_not_divide_fail_before_loading(pair) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidInputError, match=r"tensor_parallel_size=3 does not divide"):
        LLM(str(pair[0]), tensor_parallel_size=3)
    with pytest.raises(InvalidInputError, match=r"draft_tensor_parallel_size must be 1"):
        LLM(
            str(pair[0]),
            draft_model=str(pair[1]),
            tensor_parallel_size=2,
            draft_tensor_parallel_size=3,
        )
    assert time.monotonic() - t0 < 20  # config checks only: no Ray, no actors


def test_dead_or_hung_worker_raises_engine_error(engines, pair) -> None:
    # 1) kill rank 1 while generate runs in another thread
    llm = engine(pair, GAMMA, seed=SEED, tensor_parallel_size=2)
    executor = llm.engine.executor
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            llm.generate(
                [{"prompt_token_ids": PROMPT}] * 128,
                [
                    SamplingParams(temperature=1.0, max_tokens=2 if i < 8 else 58, ignore_eos=True)
                    for i in range(128)
                ],
                use_tqdm=False,
            )
        except BaseException as e:
            box["error"], box["t"] = e, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while llm.engine.metrics.num_steps < 6 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert thread.is_alive(), f"generate ended before the kill: {box}"
    t_kill = time.monotonic()
    ray.kill(executor.workers[1])
    thread.join(90)
    assert not thread.is_alive(), "generate hung after a worker was killed"
    err = box.get("error")
    assert isinstance(err, EngineError), repr(err)
    assert box["t"] - t_kill < 60
    assert "rank 1" in str(err) and "died" in str(err), str(err)
    # what finished before the failure comes back with the error, in input order
    assert err.outputs is not None and len(err.outputs) == 128
    kept = [o for o in err.outputs[:8] if o is not None]
    assert kept and all(o.finished and len(o.outputs[0].token_ids) == 2 for o in kept)
    assert any(o is None for o in err.outputs[8:])
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    assert_released(executor)
    with pytest.raises(EngineError, match="workers are gone"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()

    # 2) a new engine works; then a rank that stops answering hits the step timeout
    llm = engine(pair, GAMMA, seed=SEED, tensor_parallel_size=2)
    try:
        assert token_ids(llm, GREEDY) == token_ids(engines("spec", 1), GREEDY)
        executor = llm.engine.executor
        executor.step_timeout_s = 3.0
        executor.workers[1].__ray_call__.remote(lambda _self: time.sleep(60))  # rank 1 is busy
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"no reply within 3 s") as info:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert "rank 1" in str(info.value)
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
        assert_released(executor)
    finally:
        llm.shutdown()


# ---- joining a running cluster ---------------------------------------------------------------
def test_cli_joins_an_existing_cluster(engines, pair, ray_cluster, tmp_path: Path) -> None:
    """``specbatch generate --tensor-parallel-size 2 --ray-address ADDR`` in another process
    joins this run's Ray, produces TP=1's tokens, and leaves no actor behind."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    target, draft = pair
    cmd = [
        sys.executable,
        "-m",
        "specbatch.entrypoints.cli",
        "generate",
        "--model",
        str(target),
        "--draft-model",
        str(draft),
        "--num-speculative-tokens",
        str(GAMMA),
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--no-progress",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "512",
        "--max-model-len",
        "64",
        "--seed",
        str(SEED),
        "--tensor-parallel-size",
        "2",
        "--ray-address",
        ray_cluster,
    ]
    before = named_actors()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(
        (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"]
    )
    assert [r["token_ids"] for r in rows] == token_ids(engines("spec", 1), GREEDY)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = named_actors() - before
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"actors the CLI's engine left behind: {left}"
    assert ray.is_initialized()  # the cluster outlives the engine that joined it
