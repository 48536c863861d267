"""Structured outputs are exact under speculation: the law of the output is the law of sampling
the target masked by the grammar at every token.

Each drafter (a draft model, an EAGLE-3 head, n-gram lookup; chains of 3 and a tree) samples N
outputs of a ``choice`` and N of a small regex, each at T = 1 and T = 0.7, all four groups mixed
in one batch; each group's outputs (whole token sequences, EOS included) are compared with the
masked target's law, enumerated with transformers' logits and xgrammar's own matcher
(tests/grammar_helpers.py), by a chi-square goodness-of-fit test (tests/test_exactness.py's
``assert_matches``: cells expected fewer than 5 times pooled).

False alarms: each test rejects at p < ALPHA = 1e-3 (4 groups a drafter: 4e-3 a test at most);
seeds are fixed. Power: the choice has 4 outcomes and the regex 13; with N = 4,000 a group, any
error of total variation 0.06 over a group's cells is caught with probability >= 0.9 (checked
for each group from its degrees of freedom and pooled mass, as in tests/test_exactness.py).
``test_forgetting_the_rollback_is_caught`` plants a matcher that never rolls back past rejected
drafts and checks that these tests fail.
"""

from __future__ import annotations

import pytest

from specbatch import LLM, SamplingParams
from specbatch.structured_outputs import StructuredOutputsParams
from specbatch.testing.eagle_heads import make_eagle_head
from specbatch.worker.grammar_masks import RequestGrammar
from tests.grammar_helpers import compile_reference, masked_law
from tests.helpers import make_perturbed_draft
from tests.test_exactness import assert_matches

N = 4_000
TV = 0.06
EOS = 2  # the tiny tokenizer's </s>
CHOICE = ["yes", "no", "maybe"]
REGEX = "x[abc]{1,2}y"
GROUPS = [("choice", CHOICE, 1.0), ("choice", CHOICE, 0.7), ("regex", REGEX, 1.0),
          ("regex", REGEX, 0.7)]  # fmt: skip
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 5}


@pytest.fixture(scope="module")
def pair(make_checkpoint, tmp_path_factory):
    target = make_checkpoint(
        "llama",
        vocab_size=256,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        seed=7,
        max_position_embeddings=64,
        with_tokenizer=True,
    )
    root = tmp_path_factory.mktemp("structured_pair")
    draft = make_perturbed_draft(target, root / "draft", noise=0.25, seed=1)
    head = make_eagle_head(root / "head", target, "eagle3", seed=2, scale=0.5)
    return target, draft, head


@pytest.fixture(scope="module")
def laws(pair):
    """Each group's exact law, and the prompt (it holds the grammars' strings, so that n-gram
    lookup proposes drafts, some of them outside the grammar)."""
    from transformers import AutoTokenizer

    target = pair[0]
    prompt = AutoTokenizer.from_pretrained(str(target)).encode("yes no maybe xay xbcy abc")
    out = []
    for kind, value, temperature in GROUPS:
        compiled = compile_reference(target, kind, value, EOS)
        out.append(masked_law(target, prompt, compiled, temperature))
    return prompt, out


def drafters(pair) -> dict[str, dict]:
    _, draft, head = pair
    return {
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
        "eagle3_tree": {"method": "eagle3", "model": str(head), **TREE},
    }


def sample_groups(pair, laws, method: str, seed: int) -> list[list[tuple[int, ...]]]:
    prompt, _ = laws
    llm = LLM(
        str(pair[0]),
        speculative_config=drafters(pair)[method],
        max_num_seqs=256,
        num_kv_blocks=1024,
        block_size=4,
        seed=seed,
        max_model_len=64,
    )
    params = []
    for i in range(len(GROUPS) * N):
        kind, value, temperature = GROUPS[i % len(GROUPS)]
        spec = StructuredOutputsParams(**{kind: value})
        params.append(
            SamplingParams(temperature=temperature, max_tokens=8, structured_outputs=spec)
        )
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
    spec_stats = llm.engine.metrics.spec
    assert spec_stats.proposed > 0 and spec_stats.accepted > 0
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    groups: list[list[tuple[int, ...]]] = [[] for _ in GROUPS]
    for i, o in enumerate(outs):
        groups[i % len(GROUPS)].append(tuple(o.outputs[0].token_ids))
    return groups


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "ngram", "eagle3_tree"])
def test_structured_output_law_is_the_masked_targets(pair, laws, method):
    groups = sample_groups(pair, laws, method, seed=17)
    for samples, exact in zip(groups, laws[1], strict=True):
        assert_matches(samples, exact, tv=TV)


def test_forgetting_the_rollback_is_caught(pair, laws, monkeypatch):
    """A matcher that stays on the rejected drafts (no rollback) fails the test above. The
    engine's own check would stop it first (an emitted token outside the grammar the matcher
    is in); with that check gone too, the chi-square test rejects."""
    monkeypatch.setattr(RequestGrammar, "_rollback", lambda self, n: None)

    def unchecked_commit(self: RequestGrammar, tokens: list[int]) -> int | None:
        self.goto(tokens)
        taken, self.path = len(self.path), []
        return taken if self.ended else None

    monkeypatch.setattr(RequestGrammar, "commit", unchecked_commit)
    groups = sample_groups(pair, laws, "draft_model", seed=17)
    with pytest.raises(AssertionError, match="p="):  # the p-value, not the power check
        for samples, exact in zip(groups, laws[1], strict=True):
            assert_matches(samples, exact, tv=TV)
