"""Data-parallel replicas, end to end on a two-node Ray cluster simulated on this machine.

One cluster serves every test here (``cluster``): ``ray start --head`` and a second ``ray start``
joining it, each node with one logical CPU, so two replicas land one per node (spread). The
model is test_ray_tp's tiny target (vocab 32) with a perturbed copy as its draft, speculating 3
tokens.

What is checked: DP=2 outputs are DP=1's, in input order (greedy and seeded), the replicas on
different nodes; aborted requests leave no KV block on any replica; ``generate`` with a replica
killed mid-run writes every index exactly once, with DP=1's tokens; ``generate`` stopped by
SIGTERM and resumed equals an uninterrupted run; requests moved off a killed replica are sent
out again before every request added after them, in the order they were added; an answer from
a replica already marked down is refused; the server, with a replica killed under it,
ends that replica's stream with an error, retries its request that had streamed nothing, and
keeps serving; a replica that cannot load, or a placement the cluster cannot hold, fails the
launch with the reason and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from specbatch import LLM, EngineError, InvalidInputError, SamplingParams
from specbatch.config import EngineArgs
from specbatch.draft_shape import DraftShape
from specbatch.engine.prometheus import parse_metrics
from tests.helpers import make_perturbed_draft
from tests.test_cli_errors import with_nans

ray = pytest.importorskip("ray")

# one Ray on the machine at a time: pytest-xdist runs every test that starts Ray on one worker
# (two clusters at once on 2 cores put each other's timeouts at risk)
pytestmark = pytest.mark.xdist_group("ray")

GAMMA = 3
ENGINE = dict(num_kv_blocks=512, block_size=4, max_model_len=64, seed=3)
PROMPTS: list[Any] = [{"prompt_token_ids": [1 + i % 29, 2 + i % 7, 3 + i % 5]} for i in range(24)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, however it dies (Linux), so that a
    killed test run leaves no Ray node behind."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ray_start(*args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args]
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=150000000"]
    return subprocess.Popen(
        cmd + common,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Two Ray nodes on this machine (a head and one more, one CPU each); yields the address.
    The ``ray start --block`` processes stop their nodes when terminated (never ``ray stop``:
    it stops every Ray instance on the machine)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # see RAY_NOTES.md
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    assert not ray.is_initialized()
    procs = []
    temp_dir = tempfile.mkdtemp(prefix="sbray", dir="/tmp")  # short: it holds unix sockets
    for _ in range(5):  # the port may be taken between choosing and binding it
        port = _free_port()
        # its own temp dir: the cluster's address is not written where ray.init() looks
        head = _ray_start(
            "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp_dir}"
        )
        deadline = time.monotonic() + 60
        while head.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        if head.poll() is None:
            procs.append(head)
            break
    assert procs, "ray start --head failed"
    address = f"127.0.0.1:{port}"
    try:
        procs.append(_ray_start(f"--address={address}"))
        ray.init(address=address, logging_level="WARNING")
        deadline = time.monotonic() + 120
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline, "the second node did not join"
            time.sleep(0.2)
        yield address
    finally:
        ray.shutdown()
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
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


def spec_llm(pair: tuple[Path, Path], **kw: Any) -> LLM:
    return LLM(str(pair[0]), draft_model=str(pair[1]), num_speculative_tokens=GAMMA, **ENGINE, **kw)


@pytest.fixture(scope="module")
def dp1(pair) -> Iterator[LLM]:
    llm = spec_llm(pair, max_num_seqs=8)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp2(pair, cluster) -> Iterator[LLM]:
    llm = spec_llm(pair, max_num_seqs=8, data_parallel_size=2)
    yield llm
    llm.shutdown()


def reference(dp1: LLM, n: int, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in dp1.generate(prompts(n), params, use_tqdm=False)]


def prompts(n: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [1 + i % 29, 2 + i % 7, 3 + i % 5, 1 + i % 3]} for i in range(n)]


def dp_actors() -> list[str]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n for n in names if n.startswith("specbatch-dp"))


def kv_clean(llm: LLM) -> None:
    """Every live replica holds no request and no KV block."""
    for state in llm.engine.replica_states():
        if state is not None:
            assert (state.kv_blocks_used, state.running, state.waiting) == (0, 0, 0)


# ---- outputs -------------------------------------------------------------------------------
def test_dp2_equals_dp1_in_order_with_the_replicas_on_both_nodes(dp1, dp2) -> None:
    nodes = {r.node_id for r in dp2.engine.replicas}
    assert len(nodes) == 2, "the replicas share a node"
    want = dp1.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = dp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    seeded = [
        SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    want = dp1.generate(PROMPTS, seeded, use_tqdm=False)
    got = dp2.generate(PROMPTS, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    m = dp2.engine.metrics  # both replicas worked, and speculated
    assert m.spec.proposed > 0 and m.num_generated_tokens >= 24 * 16 + 24 * 24
    kv_clean(dp2)


def test_structured_outputs_on_two_replicas_equal_one_engine(make_checkpoint, cluster) -> None:
    """A grammar is checked by the front (a bad one refused before any replica sees it) and
    compiled by each replica: seeded structured outputs equal one engine's."""
    target = make_checkpoint("llama", with_tokenizer=True)
    config = {"method": "ngram", "num_speculative_tokens": GAMMA, "prompt_lookup_min": 1}
    specs = [{"choice": ["yes", "no"]}, {"regex": "ab[cd]{1,4}"}] * 2
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=12, structured_outputs=spec)
        for i, spec in enumerate(specs)
    ]
    prompts = ["yes or no? yes", "pick: abc abd"] * 2
    outs = []
    for dp in (1, 2):
        llm = LLM(str(target), speculative_config=config, data_parallel_size=dp, **ENGINE)
        try:
            if dp == 2:
                with pytest.raises(InvalidInputError, match=r"structured_outputs\.regex: invalid"):
                    llm.generate(["x"], SamplingParams(structured_outputs={"regex": "[a-"}))
            got = llm.generate(prompts, params, use_tqdm=False)
            outs.append([o.outputs[0].token_ids for o in got])
            if dp == 2:
                kv_clean(llm)
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


def test_aborts_leave_no_kv_block_on_any_replica(dp2) -> None:
    engine = dp2.engine
    params = SamplingParams(temperature=0.0, max_tokens=56, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(64)]
    deadline = time.monotonic() + 60
    while True:  # until both replicas report requests holding blocks, with more queued here
        engine.step()
        if all(s.kv_blocks_used > 0 for s in engine._states):
            break
        assert engine._pending and time.monotonic() < deadline, engine._states
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    kv_clean(dp2)


# ---- generate ------------------------------------------------------------------------------
def generate_cmd(pair: tuple[Path, Path], address: str, src: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "specbatch.entrypoints.cli", "generate",
        "--model", str(pair[0]), "--draft-model", str(pair[1]),
        "--num-speculative-tokens", str(GAMMA), "--prompts", str(src), "--output", str(out),
        "--temperature", "0", "--max-tokens", "40", "--ignore-eos", "--no-progress",
        "--block-size", "4", "--num-kv-blocks", "512", "--max-model-len", "64",
        "--max-num-seqs", "2", "--seed", "3",
        "--data-parallel-size", "2", "--ray-address", address,
    ]  # fmt: skip


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts(n)))
    return path


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 180
    while True:
        have = len(path.read_text().splitlines()) if path.exists() else 0
        if have >= n:
            return have
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"only {have} lines"
        time.sleep(0.02)


N_CLI = 160


def test_generate_with_a_replica_killed_writes_each_index_once(
    dp1, pair, cluster, tmp_path: Path
) -> None:
    src, out = write_prompts(tmp_path / "p.jsonl", N_CLI), tmp_path / "out.jsonl"
    before = dp_actors()
    proc = subprocess.Popen(
        generate_cmd(pair, cluster, src, out), stderr=subprocess.PIPE, text=True
    )
    written = wait_for_lines(out, 10, proc)
    name = max(set(dp_actors()) - set(before))  # the run's second replica
    _, _, pid = ray.get(ray.get_actor(name, _namespace_of(name)).where.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert written < N_CLI, "the run ended before the kill"
    rows = rows_of(out)
    assert sorted(r["index"] for r in rows) == list(range(N_CLI))  # each exactly once
    by_index = {r["index"]: r["token_ids"] for r in rows}
    assert [by_index[i] for i in range(N_CLI)] == reference(dp1, N_CLI, 40)
    assert "is down: its process died" in err and f"{N_CLI} request(s) done" in err, err[-2000:]
    _wait_gone(before)


def test_generate_resumed_after_sigterm_equals_an_uninterrupted_run(
    dp1, pair, cluster, tmp_path: Path
) -> None:
    src, out = write_prompts(tmp_path / "p.jsonl", N_CLI), tmp_path / "out.jsonl"
    before = dp_actors()
    cmd = generate_cmd(pair, cluster, src, out)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    wait_for_lines(out, 30, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    first = rows_of(out)
    assert 30 <= len(first) < N_CLI
    _wait_gone(before)  # the interrupted run left no replica behind
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = rows_of(out)
    assert rows[: len(first)] == first  # kept as written
    assert sorted(r["index"] for r in rows) == list(range(N_CLI))
    by_index = {r["index"]: r["token_ids"] for r in rows}
    assert [by_index[i] for i in range(N_CLI)] == reference(dp1, N_CLI, 40)
    _wait_gone(before)


def _namespace_of(name: str) -> str:
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == name:
            return a["namespace"]
    raise LookupError(name)


def _wait_gone(before: list[str]) -> None:
    deadline = time.monotonic() + 30
    while set(dp_actors()) - set(before):
        assert time.monotonic() < deadline, f"replicas left behind: {dp_actors()}"
        time.sleep(0.2)


# ---- a replica lost: the queue's order, and late answers ------------------------------------
def test_requests_moved_off_a_dead_replica_keep_their_turn(dp1, pair, cluster) -> None:
    """Offline (pull), a replica's unfinished requests go back to the head of the queue here in
    the order they were added: from the loss on, requests are sent out in the order they were
    added, the moved ones before every request added after them; each finishes once, with
    DP=1's tokens."""
    n, max_tokens = 48, 40
    llm = spec_llm(pair, max_num_seqs=4, data_parallel_size=2)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts(n)]
        added = {rid: k for k, rid in enumerate(ids)}
        done: dict[str, list[int]] = {}

        def take(outputs: list[Any]) -> None:
            for o in outputs:
                assert o.finished and o.request_id not in done, o.request_id
                done[o.request_id] = list(o.outputs[0].token_ids)

        def on(i: int | None) -> list[str]:
            return [rid for rid, e in engine._requests.items() if e.replica == i]

        deadline = time.monotonic() + 60
        while not (len(on(1)) >= 3 and engine._pending):  # replica 1 busy, more queued here
            take(engine.step())
            assert time.monotonic() < deadline, "replica 1 never got requests"
        sent = {rid for rid, e in engine._requests.items() if e.replica is not None}
        victim = engine.replicas[1]
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while victim.alive:
            take(engine.step())
            assert time.monotonic() < deadline, "the dead replica was never marked down"
        assert "its process died" in str(victim.error)
        queued = [rid for rid in ids if rid in on(None)]  # in the order they were added
        moved = [rid for rid in queued if rid in sent]
        assert len(moved) >= 2 and len(moved) < len(queued), (moved, queued)  # both kinds queued
        # the order in which they leave the queue (those sent in one step sorted among themselves)
        order: list[str] = []
        deadline = time.monotonic() + 180
        while engine.has_unfinished_requests():
            take(engine.step())
            left = [
                rid
                for rid in queued
                if rid not in order
                and (rid not in engine._requests or engine._requests[rid].replica is not None)
            ]
            order += sorted(left, key=added.get)
            assert time.monotonic() < deadline, "the run did not finish"
        assert order == queued, f"moved {moved}, sent out as {order}"
        assert sorted(done, key=added.get) == ids  # each exactly once
        assert [done[rid] for rid in ids] == reference(dp1, n, max_tokens)
    finally:
        llm.shutdown()


def test_an_answer_from_a_replica_already_marked_down_is_refused(pair, cluster) -> None:
    """The server's path (route at once, streams): replica 1 answers a poll, then dies, and the
    engine marks it down (a stats call fails) and routes its requests, which had streamed
    nothing, to replica 0. The answer read after that is refused: no output delivered, no
    gauge of the dead replica back in the engine's state, no failure; every request then
    streams from replica 0 alone, finishing once."""
    from specbatch.engine.data_parallel import POLL_S, DataParallelEngine

    args = EngineArgs(
        model=str(pair[0]), draft_model=str(pair[1]), num_speculative_tokens=GAMMA,
        max_num_seqs=8, data_parallel_size=2, **ENGINE,
    )  # fmt: skip
    engine = DataParallelEngine(args.create_engine_config(), route_at_once=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for k, p in enumerate(prompts(4)):
            text, ids = engine.check_request(p, params)
            engine.add_checked_request(text, ids, params, f"r{k}", stream=True)
        on_1 = sorted(rid for rid, e in engine._requests.items() if e.replica == 1)
        assert len(on_1) == 2, {rid: e.replica for rid, e in engine._requests.items()}

        def poll(i: int) -> Any:  # as the server's pump polls a replica
            return engine.replicas[i].actor.poll.remote(None, -1, POLL_S)

        deadline = time.monotonic() + 60
        while True:  # replica 1 answers with outputs of its streams
            ref = poll(1)
            ready, _ = ray.wait([ref], timeout=30)
            assert ready and time.monotonic() < deadline, "replica 1 did not answer"
            if ray.get(ref).outputs:
                break
        os.kill(engine.replicas[1].pid, signal.SIGKILL)
        engine.replica_states()  # its stats call fails: marked down, its requests moved
        assert not engine.replicas[1].alive and "its process died" in str(engine.replicas[1].error)
        assert {rid: engine._requests[rid].replica for rid in on_1} == dict.fromkeys(on_1, 0)
        before = engine.state()
        late = ray.get(ref)  # the answer it gave before it died, read only now
        assert late.outputs and {o.request_id for o in late.outputs} <= set(on_1)
        assert late.state.running > 0 and late.state.kv_blocks_used > 0
        assert engine.absorb(1, late) == []
        assert engine.state() == before  # its gauges stay out of the sums
        assert engine.take_failures() == [] and len(engine._requests) == 4
        streamed: dict[str, list[list[int]]] = {}
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():  # now replica 0 alone answers
            for o in engine.absorb(0, ray.get(poll(0), timeout=60)):
                streamed.setdefault(o.request_id, []).append(list(o.outputs[0].token_ids))
                assert o.finished == (len(o.outputs[0].token_ids) == 40), o
            assert time.monotonic() < deadline, "the streams did not finish"
        assert sorted(streamed) == [f"r{k}" for k in range(4)] and not engine.take_failures()
        for seen in streamed.values():  # each stream grows from its start, once
            assert all(len(a) < len(b) and b[: len(a)] == a for a, b in pairwise(seen))
        for o in late.outputs:  # greedy: the run on replica 0 repeats what replica 1 had made
            final = streamed[o.request_id][-1]
            assert final[: len(o.outputs[0].token_ids)] == list(o.outputs[0].token_ids)
    finally:
        engine.shutdown()


# ---- serve ---------------------------------------------------------------------------------
def test_serve_with_a_replica_killed_fails_its_stream_retries_the_rest_and_keeps_serving(
    make_checkpoint, cluster
) -> None:
    from specbatch.entrypoints.openai_server import build_app
    from tests.test_server import ServerThread

    long_model = make_checkpoint("llama", with_tokenizer=True, max_position_embeddings=2048)
    args = EngineArgs(
        model=str(long_model), num_kv_blocks=1024, block_size=16, max_model_len=2048,
        max_num_seqs=8, data_parallel_size=2,
    )  # fmt: skip
    body = {"prompt": [1, 2, 3], "max_tokens": 1800, "ignore_eos": True, "temperature": 0}
    with ServerThread(build_app(args)) as server, httpx.Client(timeout=120) as client:
        dp = server.engine.engine
        url = f"{server.url}/v1/completions"
        streams = [client.stream("POST", url, json={**body, "stream": True}) for _ in range(2)]
        lines = []
        for s in streams:  # both streams under way, one on each replica
            lines.append(s.__enter__().iter_lines())
            assert next(line for line in lines[-1] if line).startswith("data: {")
        pids = [r.pid for r in dp.replicas]
        for pid in pids:  # freeze both replicas, their streams mid-way
            os.kill(pid, signal.SIGSTOP)
        assert sorted(e.replica for e in dp._requests.values()) == [0, 1]
        whole: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: whole.update(r=client.post(url, json=body)), daemon=True
        )
        thread.start()  # a whole-reply request, routed to a frozen replica
        deadline = time.monotonic() + 30
        while len(dp._requests) < 3:
            assert time.monotonic() < deadline, "the whole-reply request never arrived"
            time.sleep(0.005)
        victim = next(e.replica for e in dp._requests.values() if not e.req.stream)
        os.kill(pids[victim], signal.SIGKILL)
        os.kill(pids[1 - victim], signal.SIGCONT)
        ends = []
        for s, it in zip(streams, lines):
            events = [json.loads(x[6:]) for x in it if x.startswith("data: {")]
            ends.append(events[-1])
            s.__exit__(None, None, None)
        failed = [e for e in ends if "error" in e]
        assert len(failed) == 1, ends
        assert failed[0]["error"]["type"] == "server_error"
        assert f"replica {victim}" in failed[0]["error"]["message"]
        assert [e["choices"][0]["finish_reason"] for e in ends if "error" not in e] == ["length"]
        thread.join(120)
        reply = whole["r"]
        assert reply.status_code == 200, reply.text  # retried on the other replica
        assert reply.json()["usage"]["completion_tokens"] == 1800
        again = client.post(url, json={**body, "max_tokens": 8})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
        health = client.get(f"{server.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        status = {r["replica"]: r["status"] for r in health.json()["replicas"]}
        assert status == {victim: "down", 1 - victim: "ok"}
        metrics = client.get(f"{server.url}/metrics").text
        assert f'specbatch:replica_healthy{{model_name="{long_model}",replica="{victim}"}} 0.0' in (
            metrics
        )
        # a client that goes away: its request is aborted on its replica, not run to the end
        before = dp.replica_states()[1 - victim].metrics.num_generated_tokens  # type: ignore[union-attr]
        with client.stream("POST", url, json={**body, "stream": True}) as s:
            assert next(line for line in s.iter_lines() if line).startswith("data: {")
        deadline = time.monotonic() + 30
        while (state := dp.replica_states()[1 - victim]) is not None and state.running:
            assert time.monotonic() < deadline, "the disconnected request still runs"
            time.sleep(0.05)
        assert state is not None and state.kv_blocks_used == 0 and not dp._requests
        assert state.metrics.num_generated_tokens - before < 1800
        # /metrics: the survivor's gauges alone, and every replica's counters summed
        page = parse_metrics(client.get(f"{server.url}/metrics").text)
        assert page["specbatch:kv_blocks_total"] == dp.replicas[1 - victim].num_kv_blocks
        assert page["specbatch:num_requests_running"] == page["specbatch:kv_blocks_used"] == 0
        assert page['specbatch:request_success_total{finished_reason="abort"}'] == 1
        survivor = dp._states[1 - victim].metrics.num_generated_tokens
        assert page["specbatch:generation_tokens_total"] == sum(
            st.metrics.num_generated_tokens for st in dp._states
        )
        assert page["specbatch:generation_tokens_total"] > survivor  # the victim's count too


# ---- launch failures -----------------------------------------------------------------------
def test_a_replica_that_cannot_load_fails_the_launch_with_the_reason(
    pair, cluster, tmp_path: Path
) -> None:
    name = "model.layers.0.self_attn.v_proj.weight"
    bad = with_nans(pair[0], tmp_path / "nan", name, 100)
    before = dp_actors()
    groups = _placement_groups()
    with pytest.raises(InvalidInputError, match=f"weight '{name}' holds 100 non-finite"):
        LLM(str(bad), data_parallel_size=2, **ENGINE)
    _wait_gone(before)
    with pytest.raises(EngineError, match=r"needs 3 x .*STRICT_SPREAD.* hold 2"):
        os.environ["SPECBATCH_DP_PLACEMENT"] = "strict_spread"
        try:
            LLM(str(pair[0]), data_parallel_size=3, **ENGINE)
        finally:
            del os.environ["SPECBATCH_DP_PLACEMENT"]
    assert _placement_groups() == groups  # none left behind


def _placement_groups() -> set[str]:
    tables = ray.util.placement_group_table().values()
    return {t["placement_group_id"] for t in tables if t["state"] != "REMOVED"}


# ---- bench ---------------------------------------------------------------------------------
def test_bench_runs_each_cell_on_the_replicas_with_their_counters_reset(pair, cluster) -> None:
    from specbatch.bench.offline import BenchConfig, run_bench

    cfg = BenchConfig(
        model=str(pair[0]), draft_model=str(pair[1]), batch_sizes=[4], draft_lengths=[0, 2],
        trees=[DraftShape(2, 2, 4)], input_len=8, output_len=16, output_len_spread=0.0,
        num_requests=12,
        engine_kwargs={"data_parallel_size": 2, "num_kv_blocks": 256, "block_size": 4},
    )  # fmt: skip
    plain, chain, tree = run_bench(cfg, progress=False).cells
    assert [(str(c.draft), c.batch_size, c.num_requests) for c in (plain, chain, tree)] == [
        ("0", 4, 12),
        ("2", 4, 12),
        ("2x2/4", 4, 12),
    ]
    for c in (plain, chain, tree):  # the warm-up's tokens are not counted, on either replica
        assert c.output_tokens == c.engine_generated_tokens == 12 * 16
        assert c.target_rows_per_step > 0  # the pass counts come back from both replicas
    assert plain.draft_tokens_proposed == 0 and plain.draft_passes_per_step == 0
    for c in (chain, tree):
        assert c.draft_tokens_proposed > 0 and c.draft_passes_per_step > 0
    assert 2 < tree.mean_draft_length <= 4  # type: ignore[operator]


# ---- with tensor parallelism ---------------------------------------------------------------
def test_each_replica_has_its_own_tensor_parallel_group_on_its_node(dp1, pair, cluster) -> None:
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    llm = spec_llm(pair, max_num_seqs=8, data_parallel_size=2, tensor_parallel_size=2)
    try:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        want = dp1.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        ranks = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("specbatch-tp") and a["name"] not in before
        ]
        nodes = [
            ray.get(ray.get_actor(a["name"], a["namespace"]).where.remote(), timeout=30)[0]
            for a in ranks
        ]
        replicas = {r.node_id for r in llm.engine.replicas}
        assert len(ranks) == 4 and len(replicas) == 2
        assert sorted(nodes) == sorted([*replicas, *replicas])  # two ranks beside each replica
    finally:
        llm.shutdown()
