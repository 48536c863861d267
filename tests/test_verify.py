"""``specbatch verify`` / ``verify_exactness``: passes on an exact engine, fails when the plain
run samples another distribution, and says so when it cannot tell."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy import stats as sps

from specbatch.entrypoints.cli import main
from specbatch.errors import InvalidInputError
from specbatch.exactness import format_report, verify_exactness
from specbatch.testing.checkpoints import make_random_checkpoint

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


def test_passes_on_a_tiny_pair(pair: tuple[str, str]) -> None:
    target, draft = pair
    report = verify_exactness(
        target,
        draft,
        num_speculative_tokens=2,
        num_samples=400,
        num_tokens=4,
        temperature=0.8,
        top_k=8,
        prompt_token_ids=[1, 2, 3],
        engine_kwargs=ENGINE,
    )
    assert report.verdict == "PASS" and report.passed, format_report(report)
    assert report.p_value >= report.alpha
    assert report.bins >= 4 and report.dof == report.bins - 1
    assert report.max_draft_len == 2  # every draft position was exercised
    assert report.acceptance_rate is not None and 0.1 < report.acceptance_rate < 0.9
    assert report.mean_tokens_per_round is not None and report.mean_tokens_per_round > 1.0
    # the stated power, recomputed with scipy: two samples of 400 act like one of 200
    d = report.detectable_tv - report.pooled_mass
    crit = sps.chi2.isf(report.alpha, report.dof)
    assert sps.ncx2.sf(crit, report.dof, 4 * 200 * d * d) == pytest.approx(0.9, abs=1e-4)
    assert f"{report.detectable_tv:.3f} between the two" in format_report(report)


def test_fails_when_the_plain_run_samples_the_draft(pair: tuple[str, str]) -> None:
    # As if the engine emitted the draft's tokens unverified: the test must notice.
    target, draft = pair
    report = verify_exactness(
        target,
        draft,
        num_speculative_tokens=2,
        num_samples=400,
        num_tokens=4,
        temperature=0.8,
        top_k=8,
        prompt_token_ids=[1, 2, 3],
        engine_kwargs=ENGINE,
        reference_model=draft,
    )
    assert report.verdict == "FAIL" and not report.passed
    assert report.p_value < 1e-6
    text = format_report(report)
    assert "FAIL (p-value" in text and f"(plain run: {draft})" in text


def test_cli_prints_the_report_and_exits_0_on_pass(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    argv = [
        "verify",
        "--model",
        target,
        "--draft-model",
        draft,
        "--num-speculative-tokens",
        "1",
        "--num-samples",
        "300",
        "--tokens",
        "3",
        "--top-k",
        "8",
        "--prompt-token-ids",
        "1,2",
        "--seed",
        "5",
        "--no-progress",
        *ENGINE_FLAGS,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for expected in (
        "samples             300 speculative + 300 plain",
        "distinct sequences",
        "bins after pooling",
        "p-value",
        "acceptance rate",
        "tokens per round",
        "PASS (p-value",
        "alpha = 0.001",
        "A FAIL is strong evidence",
    ):
        assert expected in out, out


def test_cli_inconclusive_when_every_sequence_is_rare(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    argv = [
        "verify",
        "--model",
        target,
        "--draft-model",
        draft,
        "--num-samples",
        "10",
        "--tokens",
        "6",
        "--prompt-token-ids",
        "1",
        "--no-progress",
        *ENGINE_FLAGS,
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "INCONCLUSIVE" in out and "no power" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens", "1"], "error: --tokens must be an integer >= 2"),
        (["--alpha", "0"], "error: --alpha must be in (0, 1)"),
        (["--num-samples", "0"], "error: --num-samples must be an integer >= 1"),
        (["--top-p", "0"], "error: --top-p must be in (0, 1]"),
        (["--prompt", "x", "--prompt-token-ids", "1"], "not allowed with argument"),
        (["--prompt-token-ids", "1,x"], "expected comma-separated token ids"),
    ],
)
def test_cli_usage_errors(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    target, draft = pair
    assert main(["verify", "--model", target, "--draft-model", draft, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_model_without_draft_is_refused(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--model", pair[0]]) == 2
    err = capsys.readouterr().err
    assert "give its drafter too" in err and "Traceback" not in err


def test_prompt_errors_name_the_flag(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    argv = [
        "verify",
        "--model",
        target,
        "--draft-model",
        draft,
        "--prompt-token-ids",
        "1,999",
        "--no-progress",
        *ENGINE_FLAGS,
    ]
    assert main(argv) == 2
    assert "error: --prompt-token-ids: token id 999 is outside" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="the model has no tokenizer"):
        verify_exactness(target, draft, num_samples=2, prompt="hello", engine_kwargs=ENGINE)


def test_greedy_agreement_passes(pair: tuple[str, str]) -> None:
    # Greedy: every sample is the same sequence, speculative or not; one bin, nothing to pool.
    target, draft = pair
    report = verify_exactness(
        target,
        draft,
        num_speculative_tokens=3,
        num_samples=6,
        num_tokens=5,
        temperature=0.0,
        prompt_token_ids=[1, 2, 3],
        engine_kwargs=ENGINE,
    )
    assert report.distinct_speculative == report.distinct_plain == report.distinct_total == 1
    assert report.verdict == "PASS" and report.spec_rounds > 0


def test_cli_checks_a_drafter_given_as_speculative_config(
    pair: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    config = f'{{"method": "draft_model", "model": "{draft}", "num_speculative_tokens": 1}}'
    argv = ["verify", "--model", target, "--speculative-config", config, "--num-samples",
            "300", "--tokens", "3", "--top-k", "8", "--prompt-token-ids", "1,2",
            "--no-progress", *ENGINE_FLAGS]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"draft_model: {draft} (k = 1)" in out and "PASS (p-value" in out, out
    both = ["verify", "--model", target, "--draft-model", draft, "--speculative-config", config]
    assert main(both) == 2
    assert "give one" in capsys.readouterr().err
