"""scripts/eagle_generated.py: the target's own continuations that its EAGLE head trains on are
drawn from the target's distribution, after the prompts they keep."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from specbatch.stats import chi_square_gof
from tests.helpers import hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eagle_generated import sample_continuations

ROWS = 20_000  # ~78 draws a category of the 256: a few-percent error in p is caught
FALSE_ALARM = 1e-3


def test_continuations_keep_the_prompt_and_draw_from_the_target(tiny_llama_checkpoint) -> None:
    model = hf_model(tiny_llama_checkpoint)
    prompt = torch.tensor([5, 6, 7, 8])
    windows = torch.cat([prompt, torch.zeros(2, dtype=torch.int64)]).repeat(ROWS, 1)
    out = sample_continuations(model, windows, seed=3, batch=ROWS, min_prompt=4, max_prompt=4)
    assert out.shape == windows.shape and torch.equal(out[:, :4], windows[:, :4])
    with torch.inference_mode():
        p = torch.softmax(model(input_ids=prompt[None]).logits[0, -1].double(), -1).numpy()
    counts = np.bincount(out[:, 4].numpy(), minlength=len(p))
    result = chi_square_gof(counts, p)
    assert result.p_value > FALSE_ALARM, result
    again = sample_continuations(model, windows, seed=3, batch=ROWS, min_prompt=4, max_prompt=4)
    assert torch.equal(out, again), "a seed gives the same text"


def test_a_continuation_that_ignores_the_target_is_caught(tiny_llama_checkpoint) -> None:
    """The test above can fail: uniform draws in place of the target's are rejected."""
    model = hf_model(tiny_llama_checkpoint)
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        p = torch.softmax(model(input_ids=prompt).logits[0, -1].double(), -1).numpy()
    gen = torch.Generator().manual_seed(3)
    uniform = torch.randint(0, len(p), (ROWS,), generator=gen).numpy()
    assert chi_square_gof(np.bincount(uniform, minlength=len(p)), p).p_value < FALSE_ALARM
