"""The ``specbatch`` command line: generate, its prompt files, resume, Ctrl-C and user errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specbatch.config import EngineArgs
from specbatch.engine.llm_engine import LLMEngine
from specbatch.entrypoints import flags
from specbatch.entrypoints.cli import build_parser, main
from specbatch.errors import InvalidInputError
from specbatch.prompts_file import read_prompts
from specbatch.testing.checkpoints import make_random_checkpoint

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=256,
)
ENGINE = ["--num-kv-blocks", "16", "--max-model-len", "64", "--max-tokens", "4", "--no-progress"]
FIELDS = {
    "index",
    "id",
    "prompt",
    "text",
    "token_ids",
    "finish_reason",
    "num_prompt_tokens",
    "num_output_tokens",
    "ttft_s",
    "e2e_s",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_models")
    out = {
        "target": make_random_checkpoint(root / "target", with_tokenizer=True, seed=0, **SMALL),
        "draft": make_random_checkpoint(root / "draft", with_tokenizer=True, seed=1, **SMALL),
        "draft64": make_random_checkpoint(root / "draft64", **{**SMALL, "vocab_size": 64}, seed=2),
    }
    bad = make_random_checkpoint(root / "bad_arch", **{**SMALL, "vocab_size": 64}, seed=3)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    out["bad_arch"] = bad
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _generate(models: dict[str, Path], prompts: Path, out: Path, *extra: str) -> int:
    argv = [
        "generate",
        "--model",
        str(models["target"]),
        "--prompts",
        str(prompts),
        "--output",
        str(out),
        *ENGINE,
        *extra,
    ]
    return main(argv)


def test_every_engine_arg_has_a_flag_with_its_default() -> None:
    ns = build_parser().parse_args(["generate", "--prompts", "p.txt", "--output", "o.jsonl"])
    assert flags.engine_args_from(ns) == EngineArgs()
    assert ns.max_tokens == 16 and ns.temperature == 1.0 and ns.top_p == 1.0 and ns.top_k == 0


def test_flag_parsing_and_messages() -> None:
    ns = build_parser().parse_args(
        [
            "generate",
            "--prompts",
            "p.txt",
            "--output",
            "o",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-ids",
            "3, 4",
            "--stop-token-ids",
            "5",
            "--kv-cache-memory",
            "2GiB",
        ]
    )
    assert ns.stop == ["a", "b"] and ns.stop_token_ids == [3, 4, 5]
    assert flags.engine_args_from(ns).kv_cache_memory == "2GiB"
    for error, shown in [
        (InvalidInputError("top_p must be in (0, 1]", "top_p"), "--top-p must be in (0, 1]"),
        (InvalidInputError("model: path 'x'", "model"), "--model: path 'x'"),
        (InvalidInputError("speculative_config.topk: x", "speculative_config.topk"), None),
        (InvalidInputError("KV cache too small"), None),
    ]:
        rendered = error.named(flags.flag(error.field)) if error.field else str(error)
        assert rendered == (shown or str(error))


def test_generate_txt(models: dict[str, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello world\n\n   \nThe quick\\n brown fox\r\nOnce upon a time\n")
    out = tmp_path / "out.jsonl"
    assert _generate(models, prompts, out, "--seed", "3") == 0
    records = sorted(_records(out), key=lambda r: r["index"])
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["prompt"] for r in records] == [
        "Hello world",
        "The quick\\n brown fox",
        "Once upon a time",  # literal backslash-n
    ]
    for r in records:
        assert set(r) >= FIELDS
        assert r["num_output_tokens"] == len(r["token_ids"]) == 4
        assert r["finish_reason"] == "length" and isinstance(r["text"], str)
        # the first token, three gaps of tpot_s each, then the end (times rounded to 1e-6)
        assert r["ttft_s"] > 0 and r["ttft_s"] + 3 * r["tpot_s"] <= r["e2e_s"] + 4e-6
        assert "acceptance_rate" not in r  # no draft, no speculation statistics


def test_generate_jsonl_overrides_with_draft(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"prompt": "Hello", "id": "a", "max_tokens": 2},
        {"prompt_token_ids": [5, 6, 7], "temperature": 0, "id": 7},
        {"prompt": "world", "max_tokens": 6, "seed": 11, "top_k": 5, "note": "ignored"},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    rc = _generate(
        models, prompts, out, "--draft-model", str(models["draft"]), "--num-speculative-tokens", "2"
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert f"{prompts}:3: warning: ignoring unknown field 'note'" in err
    assert "acceptance rate" in err
    drafted = re.search(r"drafts in [\d.]+% of decoding steps \((\d+) of (\d+)\)", err)
    assert drafted is not None and 0 < int(drafted.group(1)) <= int(drafted.group(2))
    by_index = {r["index"]: r for r in _records(out)}
    assert set(by_index) == {0, 1, 2}
    assert by_index[0]["id"] == "a" and by_index[0]["num_output_tokens"] == 2
    assert by_index[1]["id"] == 7 and by_index[1]["prompt"] is None
    assert by_index[1]["prompt_token_ids"] == [5, 6, 7] and by_index[1]["num_output_tokens"] == 4
    assert by_index[2]["num_output_tokens"] == 6
    assert by_index[2]["spec_rounds"] >= 1 and "acceptance_rate" in by_index[2]


def test_generate_n_logprobs_and_penalties(models: dict[str, Path], tmp_path: Path) -> None:
    lines = [
        {"prompt": "Hello", "n": 3, "logprobs": 2, "presence_penalty": 0.5, "min_tokens": 2},
        {"prompt": "world", "repetition_penalty": 1.3, "temperature": 0},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert _generate(models, prompts, out, "--frequency-penalty", "0.2") == 0
    by_index = {r["index"]: r for r in _records(out)}
    first = by_index[0]
    assert len(first["completions"]) == 3 and first["num_output_tokens"] == 12
    assert first["completions"][0]["token_ids"] == first["token_ids"]
    for c in first["completions"]:
        assert len(c["token_logprobs"]) == len(c["top_logprobs"]) == 4
        assert all(2 <= len(top) <= 3 for top in c["top_logprobs"])
        assert c["cumulative_logprob"] == pytest.approx(sum(c["token_logprobs"]), abs=1e-4)
    assert "completions" not in by_index[1] and "token_logprobs" not in by_index[1]


def test_generate_structured_outputs_by_flag_and_by_line(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"prompt": "Hello"},
        {"prompt": "world", "structured_outputs": {"regex": "[0-9]{2}"}, "temperature": 0},
        {"prompt": "again", "structured_outputs": {"regex": "[0-9"}},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    flag = ["--structured-outputs", '{"choice": ["yes", "no"]}', "--max-tokens", "8"]
    assert _generate(models, prompts, out, *flag) == 1  # the third line is refused
    err = capsys.readouterr().err
    assert f"{prompts}:3: structured_outputs.regex: invalid regex" in err
    by_index = {r["index"]: r for r in _records(out)}
    assert set(by_index) == {0, 1}
    assert by_index[0]["text"] in ("yes", "no") and by_index[0]["finish_reason"] == "stop"
    assert len(by_index[1]["text"]) == 2 and by_index[1]["text"].isdigit()


def test_malformed_lines_are_reported_and_skipped(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    body = [
        b'{"prompt": "Hello"}',  # 1 ok
        b"{not json",  # 2
        b"",  # 3 blank: skipped, not an index
        b'{"prompt": "caf\xff"}',  # 4 non-UTF-8
        b'{"max_tokens": 3}',  # 5 missing prompt
        b'{"prompt": "x", "top_p": 2}',  # 6 bad sampling value
        b'{"prompt": ""}',  # 7 empty prompt
        b'{"prompt_token_ids": ' + json.dumps([3] * 100).encode() + b"}",  # 8 longer than 63
        b"[1, 2]",  # 9 not an object
        b'{"prompt_token_ids": [4, 5]}',  # 10 ok
        b'{"prompt": "x", "seed": 1180591620717411303424}',  # 11 seed past 2**64
    ]
    prompts.write_bytes(b"\n".join(body) + b"\n")
    out = tmp_path / "out.jsonl"
    assert _generate(models, prompts, out) == 1
    err = capsys.readouterr().err
    expected = {
        2: "invalid JSON",
        4: "not valid UTF-8",
        5: "missing 'prompt'",
        6: "top_p must be in (0, 1]",
        7: "prompt: the prompt is empty",
        8: "100 tokens, more than the limit of 63",
        9: "expected a JSON object",
        11: "seed must be in [0, 2**64)",
    }
    for line_no, message in expected.items():
        assert any(
            row.startswith(f"{prompts}:{line_no}: ") and message in row for row in err.splitlines()
        ), (line_no, err)
    assert "Traceback" not in err
    records = _records(out)
    assert sorted(r["index"] for r in records) == [0, 8]  # blank line 3 has no index
    assert "2 request(s) done" in err and "8 line(s) rejected" in err


def test_resume_runs_only_missing_indices(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    full = tmp_path / "full.jsonl"
    assert _generate(models, prompts, full) == 0
    by_index = {r["index"]: r for r in _records(full)}
    # An interrupted run: indices 2 and 0 complete, index 3 cut off in the middle of its line.
    partial = tmp_path / "partial.jsonl"
    kept = [json.dumps(by_index[2]), json.dumps(by_index[0])]
    partial.write_text("\n".join(kept) + "\n" + json.dumps(by_index[3])[:25])
    capsys.readouterr()
    assert _generate(models, prompts, partial, "--resume") == 0
    err = capsys.readouterr().err
    assert "2 request(s) done, 2 already in" in err
    records = _records(partial)
    assert [r["index"] for r in records[:2]] == [2, 0]
    assert sorted(r["index"] for r in records[2:]) == [1, 3]
    for r in records:  # per-index seeds: a resumed run reproduces the uninterrupted one
        assert r["token_ids"] == by_index[r["index"]]["token_ids"]
    # Resuming a complete file runs nothing.
    assert _generate(models, prompts, partial, "--resume") == 0
    assert len(_records(partial)) == 4


def test_resume_refuses_output_of_another_prompts_file(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\n")
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 1, "prompt": "something else"}) + "\n")
    assert _generate(models, prompts, out, "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume:") and "another prompts file" in err


def test_ctrl_c_aborts_keeps_results_and_exits_130(
    models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = tmp_path / "p.jsonl"
    lengths = [2, 8, 8, 8]
    prompts.write_text(
        "".join(json.dumps({"prompt": "abc", "max_tokens": n}) + "\n" for n in lengths)
    )
    out = tmp_path / "out.jsonl"
    seen: dict[str, object] = {}
    real_step = LLMEngine.step

    def step(self: LLMEngine) -> list:
        seen["engine"] = self
        if seen.get("finished"):  # Ctrl-C one step after the first result was written
            seen["running"] = self.scheduler.num_running
            seen["waiting"] = self.scheduler.num_waiting
            raise KeyboardInterrupt
        outputs = real_step(self)
        seen["finished"] = any(o.finished for o in outputs)
        return outputs

    monkeypatch.setattr(LLMEngine, "step", step)
    rc = _generate(models, prompts, out, "--max-num-seqs", "2")
    assert rc == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume" in err
    engine = seen["engine"]
    assert isinstance(engine, LLMEngine) and seen["running"] == 1 and seen["waiting"] == 2
    assert not engine.has_unfinished_requests()  # in-flight and waiting requests were aborted
    assert engine.num_free_kv_blocks == engine.num_kv_blocks
    assert [r["index"] for r in _records(out)] == [0]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_dir", "does not exist"),
        ("empty_dir", "no config.json"),
        ("bad_arch", "architecture 'GPT2LMHeadModel' is not supported"),
        ("kv_too_small", "KV cache too small"),
        ("vocab_mismatch", "--draft-model: vocab_size 64 differs"),
        ("missing_prompts", "--prompts: cannot read"),
        ("bad_flag_value", "--top-p must be in (0, 1]"),
        ("bad_flag_type", "argument --block-size: invalid int value"),
        ("bad_extension", "cannot tell the format"),
        ("bad_regex", "--structured-outputs.regex: invalid regex: Regex parsing error"),
        ("bad_structured_json", "--structured-outputs: not valid JSON"),
    ],
)
def test_user_errors_exit_2_without_traceback(
    models: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    message: str,
) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    model = str(models["target"])
    extra: list[str] = []
    if case == "missing_dir":
        model = str(tmp_path / "nope")
    elif case == "empty_dir":
        model = str(models["empty"])
    elif case == "bad_arch":
        model = str(models["bad_arch"])
    elif case == "kv_too_small":
        extra = ["--num-kv-blocks", "2"]
    elif case == "vocab_mismatch":
        extra = ["--draft-model", str(models["draft64"])]
    elif case == "missing_prompts":
        prompts = tmp_path / "missing.txt"
    elif case == "bad_flag_value":
        extra = ["--top-p", "2"]
    elif case == "bad_flag_type":
        extra = ["--block-size", "x"]
    elif case == "bad_extension":
        prompts = tmp_path / "p.csv"
        prompts.write_text("hello\n")
    elif case == "bad_regex":
        extra = ["--structured-outputs", '{"regex": "[a-"}']
    elif case == "bad_structured_json":
        extra = ["--structured-outputs", "{regex"]
    argv = [
        "generate",
        "--model",
        model,
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "o.jsonl"),
        *ENGINE,
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error_lines = [row for row in err.splitlines() if row.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], err


def test_console_entry_point_as_a_subprocess(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    cmd = [
        sys.executable,
        "-m",
        "specbatch.entrypoints.cli",
        "generate",
        "--model",
        str(tmp_path / "nope"),
        "--prompts",
        str(prompts),
        "--output",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --model: path") and "Traceback" not in proc.stderr


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "taken literally" in text and "--max-model-len" in text and "--resume" in text
    assert main(["verify", "--help"]) == 0
    assert "--num-samples" in capsys.readouterr().out
    assert main([]) == 2
    assert "error: the following arguments are required: COMMAND" in capsys.readouterr().err


def test_read_prompts_indices_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfalpha\r\n\r\nbeta \\t\n\xc3\n  gamma")
    parsed = read_prompts(path)
    assert [(p.index, p.line_no, p.prompt) for p in parsed.prompts] == [
        (0, 1, "alpha"),
        (1, 3, "beta \\t"),
        (3, 5, "  gamma"),
    ]
    assert [(e.index, e.line_no) for e in parsed.errors] == [(2, 4)]
