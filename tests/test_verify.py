"""``specbatch verify`` / ``verify_exactness``: passes on an exact engine, fails on a planted bug
or when the plain run samples another distribution, and says so when it cannot tell."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy import stats as sps

from specbatch.entrypoints.cli import main
from specbatch.errors import InvalidInputError
from specbatch.exactness import format_report, verify_exactness
from specbatch.exactness_report import TARGET_TV, USEFUL_TV
from specbatch.model.model_pair import default_model_path
from specbatch.sequence_stats import MAX_CELLS, samples_for
from specbatch.testing.checkpoints import make_random_checkpoint
from specbatch.worker import rejection_sampler

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
)
ENGINE = dict(num_kv_blocks=1024, max_model_len=16, max_num_seqs=512)
ENGINE_FLAGS = ["--num-kv-blocks", "1024", "--max-model-len", "16", "--max-num-seqs", "512"]
# The built-in pair: enough samples for a verdict other than INCONCLUSIVE and to catch the
# planted residual bug (its head drafts so well that the bug's residual is rarely drawn), few
# for speed.
BUILTIN_SAMPLES = 1600


def _perturbed_copy(src: Path, dst: Path, scale: float, seed: int) -> Path:
    """A draft close to the target: its weights plus ``scale`` standard deviations of noise."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    noisy = {
        k: w + scale * w.std() * torch.randn(w.shape, generator=gen) for k, w in weights.items()
    }
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("verify_models")
    target = make_random_checkpoint(root / "target", seed=0, **SMALL)
    draft = _perturbed_copy(target, root / "draft", scale=0.2, seed=1)
    return str(target), str(draft)


def _tiny(pair: tuple[str, str], **kwargs: object):
    target, draft = pair
    args = dict(
        num_speculative_tokens=2,
        num_samples=1000,
        temperature=0.8,
        top_k=8,
        prompt_token_ids=[1, 2, 3],
        engine_kwargs=ENGINE,
    )
    args.update(kwargs)
    return verify_exactness(target, draft, **args)  # type: ignore[arg-type]


def test_passes_on_a_tiny_pair_with_the_power_it_states(pair: tuple[str, str]) -> None:
    report = _tiny(pair)
    text = format_report(report)
    assert report.verdict == "PASS" and report.passed, text
    c = report.comparison
    assert c is not None and report.p_value is not None and report.p_value >= report.alpha
    assert report.num_tokens == 4 and len(c.positions) == 4  # k + 2 by default
    assert report.speculative.max_draft_len == 2  # every draft position was exercised
    assert report.speculative.acceptance_rate is not None
    assert 0.1 < report.speculative.acceptance_rate < 0.9
    # Each token's stated power, recomputed with scipy: two samples of 1000 act like one of
    # 500, each token tested at alpha / 4.
    for p in c.positions:
        assert p.detectable_tv is not None
        crit = sps.chi2.isf(report.alpha / 4, p.dof)
        assert sps.ncx2.sf(crit, p.dof, 4 * 500 * p.detectable_tv**2) == pytest.approx(0.9)
    tv = max(p.detectable_tv for p in c.positions if p.detectable_tv is not None)
    assert report.detectable_tv == tv < USEFUL_TV
    assert f"PASS (p-value {report.p_value:.3g} >= alpha 0.001): a total-variation " in text
    assert f"difference of {tv:.3f} or more at any token would have been caught" in text


def test_fails_when_the_plain_run_samples_the_draft(pair: tuple[str, str]) -> None:
    # As if the engine emitted the draft's tokens unverified: the test must notice.
    report = _tiny(pair, reference_model=pair[1])
    assert report.verdict == "FAIL" and not report.passed
    assert report.p_value is not None and report.p_value < 1e-6
    text = format_report(report)
    assert "FAIL (p-value" in text and f"(plain run: {pair[1]})" in text


def _residual_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # the token after a rejection drawn from p, as the bonus token is


def _residual_from_q(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return q


def test_fails_on_a_correction_token_drawn_from_p(
    pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _residual_from_p)
    monkeypatch.setattr(rejection_sampler, "cpu_kernels", lambda: None)  # the torch rule
    report = _tiny(pair, num_samples=2000)
    assert report.verdict == "FAIL", format_report(report)


def test_cli_with_no_arguments_checks_the_builtin_pair(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--num-samples", str(BUILTIN_SAMPLES), "--no-progress"]) == 0
    out = capsys.readouterr().out
    eagle = default_model_path("eagle")
    for expected in (
        f"target              {default_model_path('target')}\n",
        f"draft               eagle: {eagle} (k = 3)",  # the engine's default drafter
        "'import os\\nimport sys\\n'",
        "5 tokens each",  # k + 2
        f"samples             {BUILTIN_SAMPLES} speculative + {BUILTIN_SAMPLES} plain",
        "draft length up to 3",
        "token  cells  pooled  chi-square  p-value  catches TV",
        "PASS (p-value",
        "would have been caught with probability 0.9",
        "alpha = 0.001",
    ):
        assert expected in out, out


def test_cli_fails_on_the_builtin_pair_with_a_planted_bug(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rejection_sampler, "residual_distribution", _residual_from_q)
    monkeypatch.setattr(rejection_sampler, "cpu_kernels", lambda: None)  # the torch rule
    assert main(["verify", "--num-samples", str(BUILTIN_SAMPLES), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "FAIL (p-value" in out and "< alpha 0.001, at token" in out, out


def _power(n: int, tv: float, positions: int, alpha: float) -> float:
    """scipy's own power of one token's homogeneity test with ``n`` samples per side in at most
    ``MAX_CELLS`` cells (dof: cells - 1), at alpha / positions, against a total-variation
    difference ``tv``: two samples of n act like one of n / 2, noncentrality 4 (n / 2) tv^2."""
    dof = MAX_CELLS - 1
    return float(sps.ncx2.sf(sps.chi2.isf(alpha / positions, dof), dof, 2 * n * tv * tv))


def _fewest_samples(tv: float, positions: int, alpha: float, probability: float = 0.9) -> int:
    """The fewest samples per side whose ``_power`` reaches ``probability`` (bisection)."""
    low, high = 1, 1
    while _power(high, tv, positions, alpha) < probability:
        high *= 2
    while low < high:
        mid = (low + high) // 2
        if _power(mid, tv, positions, alpha) >= probability:
            high = mid
        else:
            low = mid + 1
    return low


@pytest.mark.parametrize(
    ("tv", "positions", "alpha"), [(TARGET_TV, 5, 1e-3), (0.1, 5, 1e-3), (0.05, 2, 0.05)]
)
def test_sample_size_is_the_fewest_that_catch_the_difference(
    tv: float, positions: int, alpha: float
) -> None:
    """Bounded on both sides: ``samples_for`` catches ``tv`` with probability 0.9 at every
    position, and one sample fewer would not (asking too many is a bug too: counting the
    degrees of freedom as the cells, not cells - 1, asks about 1.6% more)."""
    n = samples_for(tv, positions, alpha)
    assert _power(n, tv, positions, alpha) >= 0.9 - 1e-9
    assert _power(n - 1, tv, positions, alpha) < 0.9
    assert n == _fewest_samples(tv, positions, alpha)


def test_cli_inconclusive_when_the_test_has_no_power(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--num-samples", "100", "--no-progress"]) == 1
    out = capsys.readouterr().out
    needed = _fewest_samples(TARGET_TV, 5, 1e-3)  # computed here, not by the code under test
    assert "INCONCLUSIVE (p-value" in out and "PASS (" not in out, out
    assert f"use --num-samples {needed} (the default) to catch 0.05" in out


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (["--speculative-config", '{"method": "eagle"}'], "eagle: {eagle} (k = 3)"),
        (["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
         "eagle: {eagle} (k = 2)"),
        (["--speculative-config", '{"method": "draft_model"}'], "draft_model: {draft} (k = 3)"),
        (["--draft-model", "{draft}", "--num-speculative-tokens", "auto"],
         "draft_model: {draft} (k = auto, up to 4)"),
        (["--model", "{target}", "--speculative-config", '{"method": "ngram"}'],
         "ngram: prompt lookup (k = 3)"),
    ],
)  # fmt: skip
def test_cli_checks_every_drafter_with_and_without_a_model(
    capsys: pytest.CaptureFixture[str], flags: list[str], shown: str
) -> None:
    def paths(text: str) -> str:
        for which in ("target", "draft", "eagle"):
            text = text.replace(f"{{{which}}}", default_model_path(which))
        return text

    argv = ["verify", "--num-samples", "30", "--no-progress", *map(paths, flags)]
    assert main(argv) in (0, 1)
    out = capsys.readouterr().out
    assert paths(shown) in out, out
    assert any(line.startswith(("PASS", "FAIL", "INCONCLUSIVE")) for line in out.splitlines())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "1"], "error: --tokens must be an integer >= 2"),
        (["--alpha", "0"], "error: --alpha must be in (0, 1)"),
        (["--num-samples", "0"], "error: --num-samples must be an integer >= 1"),
        (["--top-p", "0"], "error: --top-p must be in (0, 1]"),
        (["--prompt", "x", "--prompt-token-ids", "1"], "not allowed with argument"),
        (["--prompt-token-ids", "1,x"], "expected comma-separated token ids"),
        (["--num-speculative-tokens", "0"], "error: --num-speculative-tokens: verify needs"),
        (["--speculative-config", "{}"], "error: --speculative-config and draft_model were both"),
    ],
)
def test_cli_usage_errors(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    target, draft = pair
    argv = ["verify", "--model", target, "--draft-model", draft, *flags, *ENGINE_FLAGS]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_model_without_draft_is_refused(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", pair[0], *ENGINE_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "error: --model: speculation is off" in err and "give its drafter too" in err
    assert "Traceback" not in err


def test_prompt_errors_name_the_flag(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    argv = ["verify", "--model", target, "--draft-model", draft, "--prompt-token-ids", "1,999",
            "--no-progress", *ENGINE_FLAGS]  # fmt: skip
    assert main(argv) == 2
    assert "error: --prompt-token-ids: token id 999 is outside" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="the model has no tokenizer"):
        verify_exactness(target, draft, num_samples=2, prompt="hello", engine_kwargs=ENGINE)


def test_greedy_compares_the_sequences(pair: tuple[str, str]) -> None:
    report = _tiny(pair, num_speculative_tokens=3, num_samples=6, temperature=0.0)
    assert report.comparison is None and report.greedy_mismatches == 0
    assert len(set(report.speculative.seqs) | set(report.plain.seqs)) == 1
    assert report.verdict == "PASS" and report.speculative.spec_rounds > 0
    wrong = _tiny(pair, num_samples=6, temperature=0.0, reference_model=pair[1])
    assert wrong.verdict == "FAIL" and wrong.greedy_mismatches == 12
    assert "FAIL: 12 of 12 greedy samples" in format_report(wrong)


def test_cli_checks_a_drafter_given_as_speculative_config(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    config = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": 1})
    argv = ["verify", "--model", target, "--speculative-config", config, "--num-samples",
            "1000", "--top-k", "8", "--prompt-token-ids", "1,2", "--presence-penalty", "0.5",
            "--repetition-penalty", "1.3", "--no-progress", *ENGINE_FLAGS]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"draft_model: {draft} (k = 1)" in out and "3 tokens each" in out, out
    assert "presence_penalty=0.5 repetition_penalty=1.3, 3 tokens" in out
    assert "PASS (p-value" in out
