"""Structured outputs through the engine: greedy output equal to the grammar-masked greedy
reference built with transformers' logits, for every drafter (chains and trees), in batches
that mix requests with and without grammars; drafts outside the grammar never verified; the
grammar's end ending the output; requests waiting while their grammar compiles; bad input
refused naming the field; every KV block back in the pool."""

from __future__ import annotations

import json
import pickle
from concurrent.futures import Future

import pytest

from specbatch import LLM, InvalidInputError, SamplingParams
from specbatch.grammar.backend import parse
from specbatch.grammar.compiler import GrammarCompilerPool
from specbatch.structured_outputs import StructuredOutputsParams
from specbatch.testing.eagle_heads import make_eagle_head
from specbatch.worker.round_layout import RoundLayout
from tests.grammar_helpers import compile_reference, masked_greedy
from tests.helpers import hf_greedy, make_perturbed_draft

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
}
SPECS = [  # (kind, value, JSON's optional whitespace allowed)
    ("json", SCHEMA, False),
    ("json", SCHEMA, True),
    ("regex", "x[abc]{1,2}y", True),
    ("choice", ["yes", "no", "maybe"], True),
    ("regex", "(the|a) (quick|lazy) (fox|dog)", True),
]
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    target = make_checkpoint("llama", with_tokenizer=True, seed=5)
    root = tmp_path_factory.mktemp("structured")
    draft = make_perturbed_draft(target, root / "draft", noise=0.2, seed=1)
    head = make_eagle_head(root / "head", target, "eagle3", seed=2, scale=0.5)
    return target, draft, head


def speculative_configs(pair) -> dict[str, dict | None]:
    _, draft, head = pair
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {
        "none": None,
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
        "ngram": {**ngram, "num_speculative_tokens": 4},
        "draft_model_tree": {"method": "draft_model", "model": str(draft), **TREE},
        "ngram_tree": {**ngram, **TREE},
    }


def engine(pair, name: str, **kw) -> LLM:
    args = dict(num_kv_blocks=256, block_size=4, max_model_len=128, max_num_seqs=16, seed=0)
    args.update(kw)
    return LLM(str(pair[0]), speculative_config=speculative_configs(pair)[name], **args)


def prompts(tokenizer) -> list[list[int]]:
    texts = ["The quick brown fox", "yes no maybe xay xbcy", '{"name": "ab", "n": 12}']
    return [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize(
    "name", ["none", "draft_model", "eagle3", "ngram", "draft_model_tree", "ngram_tree"]
)
def test_greedy_equals_the_masked_greedy_reference_in_a_mixed_batch(pair, name):
    """Every (prompt, grammar) request and every prompt without one, in one batch."""
    target = pair[0]
    llm = engine(pair, name)
    ids = prompts(llm.get_tokenizer())
    requests, params, refs = [], [], []
    for p in ids:
        for kind, value, spaces in SPECS:
            spec = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=not spaces)
            requests.append({"prompt_token_ids": p})
            params.append(SamplingParams(temperature=0, max_tokens=32, structured_outputs=spec))
            compiled = compile_reference(target, kind, value, EOS, spaces)
            refs.append(masked_greedy(target, p, compiled, 32))
    plain = hf_greedy(target, ids, 12)
    for p, ref in zip(ids, plain, strict=True):
        requests.append({"prompt_token_ids": p})
        params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        refs.append(ref)
    outs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    for o, ref in zip(outs[: len(ids) * len(SPECS)], refs, strict=False):
        assert o.outputs[0].finish_reason == ("stop" if ref[-1] == EOS else "length")
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    if name != "none":
        assert llm.engine.metrics.spec.accepted > 0


def test_drafts_outside_the_grammar_are_never_verified(pair, monkeypatch):
    """n-gram lookup proposes what followed in the prompt, much of it outside the grammar:
    every node the target verifies is inside it (an independent matcher walks each one from
    the request's output), while the lookup did propose nodes outside it."""
    import xgrammar as xgr

    llm = engine(pair, "ngram")
    tok = llm.get_tokenizer()
    prompt = tok.encode("xay xbcy xcay xqqy xbbz xa")
    compiled = compile_reference(pair[0], "regex", "x[abc]{1,2}y", EOS)
    counts = {"proposed": 0, "outside": 0, "verified": 0, "verified_outside": 0}
    scheduler = llm.engine.scheduler

    def outside(rid: str, path: list[int]) -> bool:
        m = xgr.GrammarMatcher(compiled)
        for t in scheduler.requests[rid].output_token_ids:
            assert m.accept_token(t)
        return not all(not m.is_terminated() and m.accept_token(t) for t in path)

    drafter = llm.engine.executor.worker.drafter
    propose = drafter.propose

    def spy_propose(step):
        proposal = propose(step)
        for r, n, row in zip(step.sampling, proposal.counts, proposal.tokens.tolist(), strict=True):
            counts["proposed"] += n
            counts["outside"] += sum(outside(r.request_id, row[:j]) for j in range(1, n + 1))
        return proposal

    build = RoundLayout.build

    def spy_build(requests, sampling, proposal, block_size, device):
        for r, n, row in zip(sampling, proposal.counts, proposal.tokens.tolist(), strict=True):
            counts["verified"] += n
            bad = sum(outside(r.request_id, row[:j]) for j in range(1, n + 1))
            counts["verified_outside"] += bad
        return build(requests, sampling, proposal, block_size, device)

    monkeypatch.setattr(drafter, "propose", spy_propose)
    monkeypatch.setattr(RoundLayout, "build", staticmethod(spy_build))
    spec = StructuredOutputsParams(regex="x[abc]{1,2}y")
    params = [SamplingParams(temperature=t, max_tokens=8, structured_outputs=spec, seed=i)
              for i, t in enumerate([0.0, 1.0] * 20)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    assert counts["outside"] > 0 and counts["verified"] > 0, counts
    assert counts["verified_outside"] == 0, counts
    assert counts["verified"] == llm.engine.metrics.spec.proposed
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_preempted_structured_requests_keep_their_grammar_state(pair):
    """Preempted (recomputed) requests resume with their matchers where they were: greedy
    outputs still equal the masked greedy reference."""
    target = pair[0]
    llm = engine(pair, "draft_model", num_kv_blocks=24, max_model_len=64, max_num_seqs=8)
    p = llm.get_tokenizer().encode("yes no maybe xay xbcy")
    kind, value, spaces = SPECS[0]
    spec = StructuredOutputsParams(json=value, disable_any_whitespace=True)
    ref = masked_greedy(target, p, compile_reference(target, kind, value, EOS, spaces), 40)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    outs = llm.generate([{"prompt_token_ids": p}] * 8, params, use_tqdm=False)
    assert llm.engine.metrics.num_preemptions > 0
    assert all(o.outputs[0].token_ids == ref for o in outs)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_the_grammars_end_ends_the_output_even_with_ignore_eos(pair):
    llm = engine(pair, "draft_model")
    spec = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate(
        ["Say yes or no:"] * 4,
        [SamplingParams(temperature=t, max_tokens=20, ignore_eos=True, structured_outputs=spec,
                        seed=1) for t in (0.0, 1.0, 0.0, 1.0)],
        use_tqdm=False,
    )  # fmt: skip
    several = llm.generate(["Say yes or no:"], SamplingParams(n=3, max_tokens=20, seed=2,
                           structured_outputs=spec), use_tqdm=False)[0]  # fmt: skip
    for c in [o.outputs[0] for o in outs] + several.outputs:
        assert c.text in ("yes", "no") and c.finish_reason == "stop" and c.token_ids[-1] == EOS
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_by_length(pair):
    llm = engine(pair, "eagle3")
    spec = StructuredOutputsParams(regex="[a-z]{30}")
    out = llm.generate(["abc"], SamplingParams(max_tokens=5, structured_outputs=spec),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.isalpha() and out.text.islower()


def test_requests_wait_for_their_grammar_and_others_run_meanwhile(pair, monkeypatch):
    """A grammar still compiling keeps its request waiting (no slot, no block) while a request
    without one runs; once compiled it runs; a grammar that fails to compile aborts its
    request."""
    llm = engine(pair, "draft_model")
    e = llm.engine
    compiled, held = [], []

    def held_compile(spec):
        compiled.append(e.grammars.check(spec) and GrammarCompilerPool.compile(e.grammars, spec))
        held.append(Future())
        return held[-1]

    monkeypatch.setattr(e.grammars, "compile", held_compile)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    e.add_request("a", SamplingParams(max_tokens=4, structured_outputs=spec), request_id="g")
    e.add_request("a", SamplingParams(max_tokens=4, structured_outputs=spec), request_id="bad")
    e.add_request("b", SamplingParams(max_tokens=4, ignore_eos=True), request_id="plain")
    finished = {}
    for _ in range(8):
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
    assert "plain" in finished and "g" not in finished
    assert {r.request_id for r in e.scheduler.running}.isdisjoint({"g", "bad"})
    held[0].set_result(compiled[0].result())
    held[1].set_exception(RuntimeError("planted compile failure"))
    while e.has_unfinished_requests():
        for out in e.step():
            finished[out.request_id] = out
    assert finished["g"].outputs[0].text in ("yes", "no")
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert e.num_free_kv_blocks == e.num_kv_blocks


def test_a_grammar_that_compiles_while_the_engine_looks_is_not_a_failure(pair, monkeypatch):
    """A grammar that finishes compiling between two of the engine's looks at it runs its
    request: only a compile that raised aborts one."""
    llm = engine(pair, "none")
    e = llm.engine

    class CompilesWhenAsked(Future):
        def __init__(self, ready) -> None:
            super().__init__()
            self.ready = ready

        def done(self) -> bool:
            was = super().done()
            if not was:
                self.set_result(self.ready)
            return was

    real = e.grammars.compile
    monkeypatch.setattr(e.grammars, "compile", lambda s: CompilesWhenAsked(real(s).result()))
    spec = StructuredOutputsParams(choice=["yes", "no"])
    e.add_request("a", SamplingParams(max_tokens=4, structured_outputs=spec), request_id="g")
    finished = {}
    while e.has_unfinished_requests():
        for out in e.step():
            finished[out.request_id] = out
    assert finished["g"].outputs[0].finish_reason == "stop"
    assert finished["g"].outputs[0].text in ("yes", "no")


def test_each_distinct_grammar_is_compiled_once(pair):
    pool = engine(pair, "none").engine.grammars
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA)),
             StructuredOutputsParams(regex="a+")]  # fmt: skip
    futures = [pool.compile(s) for s in specs]
    assert futures[0] is futures[1] and futures[0] is not futures[2]
    assert futures[0].result().compiled is not None


def test_a_compiled_grammar_survives_the_trip_to_a_ray_rank(pair):
    """Pickled (as for a Ray rank), a compiled grammar is rebuilt from its JSON with the rank's
    own tokenizer info and gives the same masks."""
    import torch
    import xgrammar as xgr

    from specbatch.grammar.backend import worker_tokenizer_info

    llm = engine(pair, "none")
    spec = StructuredOutputsParams(json=SCHEMA)
    ref = llm.engine.grammars.compile(spec).result()
    copy = pickle.loads(pickle.dumps(ref))
    assert copy.compiled is None
    rebuilt = copy.resolve(worker_tokenizer_info(llm.engine.config))
    masks = []
    for compiled in (ref.compiled, rebuilt):
        m = xgr.GrammarMatcher(compiled)
        bits = xgr.allocate_token_bitmask(3, 256)
        for i, t in enumerate(llm.get_tokenizer().encode('{"name"')[:3]):
            m.fill_next_token_bitmask(bits, i)
            assert m.accept_token(t)
        masks.append(bits)
    assert torch.equal(*masks)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "give exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"json": [1]}, "structured_outputs.json must be a JSON schema"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"schema": {}}, "structured_outputs: unknown field 'schema'"),
    ],
)
def test_bad_structured_outputs_name_the_field(value, message):
    with pytest.raises(InvalidInputError, match=message):
        SamplingParams(structured_outputs=value)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(InvalidInputError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"regex": "[a-"}, r"structured_outputs.regex: invalid regex: Regex parsing error"),
        ({"json": {"type": 5}}, "structured_outputs.json: invalid JSON schema: Type should be"),
        ({"grammar": "root ::= foo"}, "structured_outputs.grammar: invalid grammar: .*foo"),
        ({"grammar": "start: foo"}, "structured_outputs.grammar: invalid grammar: .*foo"),
    ],
)
def test_invalid_grammars_are_refused_before_they_are_queued(pair, value, message):
    llm = engine(pair, "none")
    with pytest.raises(InvalidInputError, match=message):
        llm.engine.add_request("a", SamplingParams(structured_outputs=value))
    assert not llm.engine.has_unfinished_requests()


def test_grammars_in_both_syntaxes_and_json_object_parse(pair):
    info = engine(pair, "none").engine.grammars.info()
    for value in ({"grammar": 'root ::= "a" | "b"'}, {"grammar": 'start: "a" | "b"'},
                  {"json_object": True}, {"choice": ['say "hi"', "a\\b", "é"]}):  # fmt: skip
        assert parse(StructuredOutputsParams(**value), info) is not None
