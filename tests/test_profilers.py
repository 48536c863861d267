"""The profiling benchmarks wrap the engine's own functions by name; these tests fail when a
wrapped function is renamed or removed, instead of the script failing when next run."""

from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.kernels.cpu import cpu_kernels

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def benchmarks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))


@pytest.mark.usefixtures("benchmarks_importable")
def test_step_profile_wraps_functions_that_exist_and_puts_them_back() -> None:
    from benchmarks import step_profile
    from specbatch.model.cpu_forward import CpuDecoderPlan

    before = CpuDecoderPlan.forward
    with step_profile.instrumented(step_profile.Clock()):
        assert CpuDecoderPlan.forward is not before
    assert CpuDecoderPlan.forward is before


@pytest.mark.skipif(cpu_kernels() is None, reason="the flat forward needs the CPU kernels")
@pytest.mark.usefixtures("benchmarks_importable")
def test_verify_pass_times_a_round_of_the_built_in_pair() -> None:
    from benchmarks import verify_pass
    from specbatch.model.cpu_forward import CpuDecoderPlan

    before = CpuDecoderPlan.forward
    prompt = list(range(1, 65))
    cell = verify_pass.pass_times(2, steps=2, repeats=1, prompt=prompt, dtype="float32")
    assert cell["k"] == 2 and 1 <= cell["rows"] <= 3
    assert len(cell["ms"]) == 2 and all(ms > 0 for ms in cell["ms"])
    assert CpuDecoderPlan.forward is before


@pytest.mark.usefixtures("benchmarks_importable")
def test_round_cost_splits_the_steps_of_the_built_in_pair_and_puts_the_engine_back() -> None:
    import argparse

    from benchmarks import round_cost
    from specbatch.engine.llm_engine import LLMEngine
    from specbatch.worker.worker import Worker

    before = Worker.execute, LLMEngine.step
    args = argparse.Namespace(draft_lengths=[0, 2], chunks=1, max_tokens=8, temperature=1.0, seed=0)
    cells = {c["k"]: c for c in round_cost.run(args)["cells"]}
    assert (Worker.execute, LLMEngine.step) == before
    assert all(c["tokens"] > 0 and c["seconds"] > 0 for c in cells.values())
    assert list(cells[0]["rounds"]) == [0]  # plain decoding never drafts
    assert max(cells[2]["rounds"]) <= 2
    for rounds in (cells[0]["rounds"], cells[2]["rounds"]):
        for r in rounds.values():
            # medians of each part (no timing compared: a loaded machine moves them apart)
            assert all(r[p] >= 0 for p in round_cost.PARTS) and r["target pass"] > 0 < r["step"]
