"""What a new user meets through the command line: a damaged checkpoint, a config that lacks a
field, a Ray address where nothing listens, SIGTERM, an empty prompts file, an unwritable output.

Each ends with ``error: <field and limit>`` and exit status 2 (SIGTERM: what was kept, 143),
never a traceback. A few run the command as a user does, in its own process.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specbatch import LLM
from specbatch.entrypoints.cli import main
from specbatch.errors import InvalidInputError
from specbatch.testing.checkpoints import make_random_checkpoint
from tests import test_cli

SMALL = {**test_cli.SMALL, "num_kv_heads": 2}  # two KV heads: tensor-parallel size 2 divides
ENGINE = test_cli.ENGINE
CLI = [sys.executable, "-m", "specbatch.entrypoints.cli"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli_errors")
    return {
        "target": make_random_checkpoint(root / "target", with_tokenizer=True, seed=0, **SMALL),
        "draft": make_random_checkpoint(root / "draft", with_tokenizer=True, seed=1, **SMALL),
    }


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    return path


def copy_of(model: Path, dst: Path) -> Path:
    shutil.copytree(model, dst)
    return dst


def truncated(model: Path, dst: Path, size: str) -> Path:
    out = copy_of(model, dst)
    weights = out / "model.safetensors"
    n = {"1000 bytes": 1000, "half": weights.stat().st_size // 2, "0 bytes": 0}[size]
    with weights.open("r+b") as f:
        f.truncate(n)
    return out


def with_config(model: Path, dst: Path, **changes: object) -> Path:
    out = copy_of(model, dst)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def one_error(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [row for row in err.splitlines() if row.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return one_error(capsys.readouterr().err)


@pytest.mark.parametrize("size", ["1000 bytes", "half", "0 bytes"])
@pytest.mark.parametrize("which", ["target", "draft"])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_damaged_checkpoint_is_named(
    models: dict[str, Path],
    prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    size: str,
    which: str,
    command: str,
) -> None:
    paths = {"target": models["target"], "draft": models["draft"]}
    paths[which] = truncated(paths[which], tmp_path / which, size)
    argv = [command, "--model", str(paths["target"]), "--draft-model", str(paths["draft"])]
    if command == "generate":
        argv += ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"), *ENGINE]
    else:
        argv += ["--port", "0", "--num-kv-blocks", "16"]
    line = run_main(argv, capsys)
    flag = "--model" if which == "target" else "--draft-model"
    assert line.startswith(f"error: {flag}: '{paths[which] / 'model.safetensors'}'"), line
    expected = {"1000 bytes": "header length says", "half": "cut short", "0 bytes": "0 bytes"}
    assert expected[size] in line, line


def test_llm_names_a_damaged_draft(models: dict[str, Path], tmp_path: Path) -> None:
    draft = truncated(models["draft"], tmp_path / "draft", "half")
    with pytest.raises(
        InvalidInputError, match=r"^draft_model: .*model\.safetensors' is cut short"
    ):
        LLM(str(models["target"]), draft_model=str(draft), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "has no 'hidden_size' (required: an integer >= 1)"),
        ({"num_hidden_layers": None}, "has no 'num_hidden_layers'"),
        ({"hidden_size": "32"}, "'hidden_size' must be an integer >= 1, got \"32\""),
        ({"vocab_size": 128.0}, "'vocab_size' must be an integer >= 1, got 128.0"),
        ({"num_attention_heads": 0}, "'num_attention_heads' must be an integer >= 1, got 0"),
        ({"rms_norm_eps": "small"}, "'rms_norm_eps' must be a positive number"),
        ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4}, "is not a multiple of"),
        (
            {"intermediate_size": 48},
            "weight 'model.layers.0.mlp.down_proj.weight' has shape [32, 64] in the checkpoint, "
            "but the config implies [32, 48]",
        ),
    ],
)
def test_a_config_field_missing_or_wrong_is_named(
    models: dict[str, Path],
    prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    changes: dict[str, object],
    message: str,
) -> None:
    model = with_config(models["target"], tmp_path / "m", **changes)
    argv = ["generate", "--model", str(model), "--prompts", str(prompts)]
    line = run_main([*argv, "--output", str(tmp_path / "o.jsonl"), *ENGINE], capsys)
    assert line.startswith("error: --model: ") and message in line, line


def test_a_truncated_checkpoint_as_a_user_runs_it(models: dict[str, Path], tmp_path: Path) -> None:
    model = truncated(models["target"], tmp_path / "t", "1000 bytes")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    cmd = [*CLI, "generate", "--model", str(model), "--prompts", str(prompts)]
    proc = subprocess.run(
        [*cmd, "--output", str(tmp_path / "o"), *ENGINE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert one_error(proc.stderr).startswith("error: --model: ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# with the Ray tests (pytest-xdist): none of their clusters runs meanwhile on the port it picks
@pytest.mark.xdist_group("ray")
def test_a_ray_address_where_nothing_listens_fails_fast(
    models: dict[str, Path], tmp_path: Path
) -> None:
    address = f"127.0.0.1:{_free_port()}"
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    cmd = [*CLI, "generate", "--model", str(models["target"]), "--prompts", str(prompts)]
    cmd += ["--output", str(tmp_path / "o"), *ENGINE, "--tensor-parallel-size", "2"]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, "--ray-address", address], capture_output=True, text=True, timeout=120
    )
    assert time.monotonic() - start < 30
    assert proc.returncode == 2, proc.stderr
    line = one_error(proc.stderr)
    assert line.startswith(f"error: --ray-address: no Ray cluster answers at {address}"), line


def test_sigterm_stops_generate_like_ctrl_c(models: dict[str, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(400)))
    out = tmp_path / "out.jsonl"
    cmd = [*CLI, "generate", "--model", str(models["target"]), "--prompts", str(prompts)]
    cmd += ["--output", str(out), "--num-kv-blocks", "16", "--max-model-len", "64"]
    cmd += ["--max-tokens", "48", "--ignore-eos", "--max-num-seqs", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no result was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "terminated" in err and "--resume" in err, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(records) < 400 and all(len(r["token_ids"]) == 48 for r in records)


def test_sigterm_is_told_apart_from_ctrl_c_when_ray_replaces_the_exception() -> None:
    """Ray turns an exception raised by a signal handler during ``ray.get`` into a fresh
    ``KeyboardInterrupt``; the exit status must still say SIGTERM."""
    import os

    from specbatch.entrypoints.signals import exit_status, sigterm_as_interrupt, what_happened

    def as_ray_raises(signum: int) -> KeyboardInterrupt:
        with sigterm_as_interrupt():
            try:
                try:
                    os.kill(os.getpid(), signum)
                    time.sleep(5)
                except KeyboardInterrupt:
                    raise KeyboardInterrupt() from None
            except KeyboardInterrupt as e:
                return e
        raise AssertionError("no signal arrived")

    # Ctrl-C's handler, as an interactive shell starts Python with it: a shell starts a
    # background job (``pytest &``, ``nohup``, some CI runners) with SIGINT ignored, and then
    # ``os.kill(pid, SIGINT)`` raises nothing unless an earlier test happened to install one.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        terminated = as_ray_raises(signal.SIGTERM)
        assert (exit_status(terminated), what_happened(terminated)) == (143, "terminated (SIGTERM)")
        interrupted = as_ray_raises(signal.SIGINT)
        assert (exit_status(interrupted), what_happened(interrupted)) == (130, "interrupted")
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_too_long_prompt_gets_our_error_alone(models: dict[str, Path], tmp_path: Path) -> None:
    model = copy_of(models["target"], tmp_path / "m")  # a tokenizer that knows its limit
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    prompts = tmp_path / "p.txt"
    prompts.write_text(
        "x! " * 100 + "\nhello\n"
    )  # line 1: 300 tokens, under the 315-character bound
    cmd = [*CLI, "generate", "--model", str(model), "--prompts", str(prompts)]
    proc = subprocess.run(
        [*cmd, "--output", str(tmp_path / "o.jsonl"), *ENGINE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # one line rejected, the other done
    assert "Token indices sequence length" not in proc.stderr, proc.stderr
    assert f"{prompts}:1: prompt: " in proc.stderr and "more than the limit of 63" in proc.stderr


def test_empty_prompts_file_and_unwritable_output(
    models: dict[str, Path], prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    base = ["generate", "--model", str(models["target"]), *ENGINE]
    line = run_main([*base, "--prompts", str(empty), "--output", str(tmp_path / "o")], capsys)
    assert line.startswith("error: --prompts: ") and "holds no prompts" in line, line
    if Path("/dev/full").exists():
        line = run_main([*base, "--prompts", str(prompts), "--output", "/dev/full"], capsys)
        assert line == "error: --output: cannot write '/dev/full': No space left on device"


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_temperature_flag(
    models: dict[str, Path],
    prompts: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    argv = ["generate", "--model", str(models["target"]), "--prompts", str(prompts)]
    argv += ["--output", str(tmp_path / "o"), *ENGINE, f"--temperature={value}"]
    line = run_main(argv, capsys)
    assert line.startswith("error: --temperature must be a finite number"), line


def with_nans(model: Path, dst: Path, name: str, count: int) -> Path:
    from safetensors.torch import load_file, save_file

    out = copy_of(model, dst)
    weights = load_file(out / "model.safetensors")
    flat = weights[name].view(-1)
    flat[:count] = float("nan")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_non_finite_weights_are_named_at_load(
    models: dict[str, Path], prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "model.layers.0.self_attn.v_proj.weight"
    model = with_nans(models["target"], tmp_path / "nan", name, 100)
    argv = ["generate", "--model", str(model), "--prompts", str(prompts)]
    line = run_main([*argv, "--output", str(tmp_path / "o.jsonl"), *ENGINE], capsys)
    assert line.startswith(f"error: --model: weight '{name}' holds 100 non-finite"), line
    with pytest.raises(InvalidInputError, match=f"^draft_model: weight '{name}' holds 100"):
        LLM(str(models["target"]), draft_model=str(model), num_kv_blocks=16)


def test_a_nan_distribution_still_samples_inside_the_vocabulary() -> None:
    import torch

    from specbatch.worker.sampler import sample

    probs = torch.full((3, 8), float("nan"))
    assert int(sample(probs, torch.tensor([0.0, 0.5, 0.999])).max()) < 8
