"""Smoke test of scripts/train_pair.py: every phase end to end with --tiny, then resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_pair.py"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--threads", "1", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _evaluate_export(out: Path) -> dict:
    """The export's held-out evaluation run again on the exported models (--tiny's 4 windows of
    32 tokens, batches of 4, float32)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_pair_data
        import train_pair_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    _, heldout, _ = train_pair_data.load(out)
    windows = train_pair_train.eval_windows(heldout, 32, 4)
    models = [
        AutoModelForCausalLM.from_pretrained(str(out / "export" / who), dtype=torch.float32).eval()
        for who in ("target", "draft")
    ]
    return train_pair_train.evaluate(*models, windows, 4, torch.device("cpu"), amp=False)


def test_train_pair_tiny_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    run("--out", str(out), "--phase", "all", cwd=tmp_path)
    exp = out / "export"
    log = (out / "train.log").read_text()
    assert "[target] step 1 " in log and "[draft] step 1 " in log

    info = json.loads((exp / "training.json").read_text())
    for key in ("command", "seed", "seeds", "data", "tokenizer", "models", "training", "eval"):
        assert key in info, key
    data = info["data"]
    assert data["train_files"]["count"] > 0 and data["heldout_files"]["count"] > 0
    assert not set(data["train_files"]["paths"]) & set(data["heldout_files"]["paths"])
    assert len(data["train_files"]["paths_sha256"]) == 64
    for key in ("target_loss", "draft_loss", "alpha", "greedy", "positions"):
        assert key in info["eval"], key
    # the held-out figures are those of the exported models on the held-out windows
    again = _evaluate_export(out)
    assert {k: info["eval"][k] for k in again} == again and again["positions"] == 4 * 32
    for who in ("target", "draft"):
        assert info["training"][who]["steps"] == 3 and info["training"][who]["finished"]
        assert info["models"][who]["params"] > 0
    assert info["models"]["draft"]["params"] < info["models"]["target"]["params"]
    assert "c" in info["cost_ratio"]

    src = (Path(SCRIPT)).read_text()[:2000]
    for who in ("target", "draft"):
        path = exp / who
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            assert (path / name).is_file(), name
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = tok(src, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == src  # byte-level BPE round-trips source exactly
        assert tok.eos_token == "<|endoftext|>"
        model = AutoModelForCausalLM.from_pretrained(str(path))
        assert model.config.architectures == ["LlamaForCausalLM"]
        assert model.config.vocab_size == len(tok)
        assert next(model.parameters()).dtype == torch.bfloat16
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:16]])).logits
        assert logits.shape == (1, 16, model.config.vocab_size)

    # Resume: a larger step budget continues the finished phase from its checkpoint.
    proc = run(
        "--out", str(out), "--phase", "target", "--resume", "--target-steps", "5", cwd=tmp_path
    )
    assert "resumed at step 3" in proc.stdout
    ck = torch.load(out / "target.pt", weights_only=True)
    assert ck["step"] == 5 and ck["done"]
