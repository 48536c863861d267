"""The target's own text for training its EAGLE head: continuations the target samples (at
temperature 1, its full distribution) of the starts of windows of its training files. A head
drafts inside the target's own samples, which read unlike the files the target learned from;
training on them too puts the head where it works."""

from __future__ import annotations

import inspect

import torch


@torch.inference_mode()
def sample_continuations(
    model, windows: torch.Tensor, seed: int, batch: int, min_prompt: int = 16, max_prompt: int = 128
) -> torch.Tensor:
    """``windows`` [N, L] with each row's tokens after a prompt of its first P (drawn per batch
    of rows, ``min_prompt`` to ``max_prompt``) replaced by the target's samples; on the model's
    device, int64."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out = windows.to(device=device, dtype=torch.int64).clone()
    length = out.shape[1]
    hi = min(max_prompt, length - 1)
    # transformers 5 names the cache ``cache`` (``past_key_values`` still works, with a warning)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for start in range(0, len(out), batch):
        rows = out[start : start + batch]
        prompt = int(torch.randint(min_prompt, hi + 1, (1,), generator=gen, device=device))
        step = model(input_ids=rows[:, :prompt], use_cache=True)
        for t in range(prompt, length):
            probs = torch.softmax(step.logits[:, -1].float(), dim=-1)
            rows[:, t] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            if t + 1 < length:
                step = model(
                    input_ids=rows[:, t : t + 1], use_cache=True, **{name: getattr(step, name)}
                )
    return out
