"""``specbatch bench``: end to end on a tiny random pair (draft lengths and a draft tree), files
read back and checked."""

from __future__ import annotations

import csv
import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from specbatch.bench.cells import CellResult, compare_with_plain, crossover
from specbatch.bench.drafts import Draft
from specbatch.draft_shape import DraftShape
from specbatch.entrypoints.cli import main
from specbatch.model.model_pair import default_model_path
from specbatch.stats import percentile
from specbatch.theory import expected_tokens_per_round, predicted_speedup

BATCH_SIZES = (1, 3)
DRAFT_LENGTHS = (0, 2)
TREE = "2x2/5"  # depth 2, 2 children per node, 5 nodes verified
# trees need a backend that takes tree masks; the torch reference does on every device
BACKEND = ("--attention-backend", "torch")
NUM_REQUESTS = 4
INPUT_LEN = 8
OUTPUT_LEN = 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def bench_run(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[str]]:
    target = make_checkpoint("llama", num_layers=2, seed=0)
    draft = make_checkpoint("llama", num_layers=1, seed=1)
    out = tmp_path_factory.mktemp("bench") / "run"
    argv = [
        "bench",
        "--model",
        str(target),
        "--draft-model",
        str(draft),
        "--batch-sizes",
        *map(str, BATCH_SIZES),
        "--draft-lengths",
        *map(str, DRAFT_LENGTHS),
        "--trees",
        TREE,
        *BACKEND,
        "--num-requests",
        str(NUM_REQUESTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--output-len-spread",  # every request exactly OUTPUT_LEN tokens, checked below
        "0",
        "--temperature",
        "1.0",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(out),
    ]
    return out, argv


def test_bench_end_to_end(
    bench_run: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    out, argv = bench_run
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "predicted" in printed and f"trees     {TREE}" in printed
    assert sum(line.split()[1:2] == [TREE] for line in printed.splitlines()) == len(BATCH_SIZES)

    data = json.loads(out.with_suffix(".json").read_text())
    assert data["config"]["trees"] == [TREE] and data["config"]["tree_children"] == "sampled"
    cells = data["cells"]
    drafts = [*map(str, DRAFT_LENGTHS), TREE]
    assert [(c["batch_size"], c["draft"]) for c in cells] == [
        (b, d) for b in BATCH_SIZES for d in drafts
    ]
    by = {(c["batch_size"], c["draft"]): c for c in cells}
    for c in cells:
        # Tokens counted equal tokens generated: every request ran to exactly OUTPUT_LEN tokens,
        # and the engine's own count over the cell's steps agrees.
        assert c["num_requests"] == NUM_REQUESTS
        assert c["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN == c["engine_generated_tokens"]
        for name in ("wall_s", "output_tok_s", "tpot_mean", "ttft_mean", "e2e_mean", "step_s"):
            assert c[name] > 0, name
        assert c["output_tok_s"] == pytest.approx(c["output_tokens"] / c["wall_s"])
        # more requests than the batch: the window before the last admission was measured
        assert c["full_batch_tok_s"] > 0 and len(c["runs_full_batch_tok_s"]) == 1
        assert c["tpot_p50"] <= c["tpot_p99"]
        assert c["ttft_p50"] <= c["ttft_p99"] and c["e2e_p50"] <= c["e2e_p99"]
        assert c["ttft_mean"] < c["e2e_mean"]
        assert c["measured_speedup"] > 0 and c["predicted_speedup"] > 0
        assert c["target_rows_per_step"] > 0
        plain = by[(c["batch_size"], "0")]
        if c["draft"] == "0":
            assert (c["depth"], c["topk"], c["nodes"]) == (0, 1, 0)
            assert c["spec_rounds"] == 0 and c["alpha"] is None
            assert c["measured_speedup"] == pytest.approx(1.0)
            assert c["draft_passes_per_step"] == 0
            continue
        tree = c["draft"] == TREE
        assert (c["depth"], c["topk"], c["nodes"]) == ((2, 2, 5) if tree else (2, 1, 2))
        rounds, proposed = c["spec_rounds"], c["draft_tokens_proposed"]
        accepted = c["draft_tokens_accepted"]
        assert rounds > 0 and 0 <= accepted <= proposed <= rounds * c["nodes"]
        assert accepted <= rounds * c["depth"]
        assert c["acceptance_rate"] == pytest.approx(accepted / proposed)
        assert c["mean_draft_length"] == pytest.approx(proposed / rounds)
        assert c["mean_tokens_per_round"] == pytest.approx((accepted + rounds) / rounds)
        # alpha = accepted / (accepted + rejections): the rejections it implies are a whole
        # number, at most one a round (a chain's first miss, a tree's walk stopping early)
        if accepted:
            rejections = accepted / c["alpha"] - accepted
            assert rejections == pytest.approx(round(rejections), abs=1e-6)
            assert round(rejections) <= min(rounds, proposed - accepted)
        else:
            assert c["alpha"] == 0.0
        if c["batch_size"] == 1:  # a pass per depth of every round (and the catch-ups)
            assert c["draft_passes_per_step"] >= c["depth"] * c["spec_rounds"] / c["steps"]
        # what the target verified: a tree's nodes, more than a chain's drafts
        assert c["target_rows_per_step"] > plain["target_rows_per_step"] + 1
        assert c["cost_ratio"] == pytest.approx(
            c["draft_s_per_step"] / c["depth"] / plain["target_s_per_step"]
        )
        assert c["verify_ratio"] == pytest.approx(
            c["target_s_per_step"] / plain["target_s_per_step"]
        )
        # THEORY's gamma: a chain's drafts a round, a tree's depth
        g = c["depth"] if tree else c["mean_draft_length"]
        assert c["predicted_tokens_per_round"] == pytest.approx(
            expected_tokens_per_round(c["alpha"], g)
        )
        assert c["predicted_speedup"] == pytest.approx(
            predicted_speedup(c["alpha"], g, c["cost_ratio"])
        )
        assert c["predicted_speedup_with_verify"] == pytest.approx(
            predicted_speedup(c["alpha"], g, c["cost_ratio"], c["verify_ratio"])
        )
    for b in BATCH_SIZES:
        chain, tree = by[(b, "2")], by[(b, TREE)]
        assert tree["target_rows_per_step"] > chain["target_rows_per_step"]
        assert tree["mean_draft_length"] > chain["mean_draft_length"]  # nodes, not a chain

    with out.with_suffix(".csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(cells)
    for row, c in zip(rows, cells, strict=True):
        assert int(row["batch_size"]) == c["batch_size"] and row["draft"] == c["draft"]
        assert int(row["nodes"]) == c["nodes"]
        assert float(row["target_rows_per_step"]) == pytest.approx(c["target_rows_per_step"])
        assert int(row["output_tokens"]) == c["output_tokens"]
        assert float(row["output_tok_s"]) == pytest.approx(c["output_tok_s"])

    for suffix in ("_throughput_latency.png", "_speedup.png"):
        w, h = _png_size(out.with_name(out.name + suffix))
        assert w > 100 and h > 100


def test_bench_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--batch-sizes", "0", "--no-progress"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main(["bench", "--repeats", "0", "--no-progress"]) == 2
    assert "repeats must be >= 1" in capsys.readouterr().err


def test_bench_parses_trees_beside_draft_lengths() -> None:
    from specbatch.entrypoints.bench import config_from
    from specbatch.entrypoints.cli import build_parser

    argv = ["bench", "--draft-lengths", "auto", "4", "0", "2", "--trees", "5x8/32", "4x4/16"]
    ns = build_parser().parse_args([*argv, "--tree-children", "top"])
    cfg = config_from(ns)
    assert cfg.draft_lengths == ["auto", 4, 0, 2] and cfg.tree_children == "top"
    assert cfg.trees == [DraftShape(5, 8, 32), DraftShape(4, 4, 16)]
    # the cells at each batch size: plain and chains, trees, auto
    assert [str(d) for d in cfg.drafts] == ["0", "2", "4", "4x4/16", "5x8/32", "auto"]
    # auto drafts as deep as the deepest cell, with the trees' largest topk and nodes
    assert cfg.auto_shape == DraftShape(5, 8, 32) and cfg.lookahead == 32
    assert config_from(build_parser().parse_args(["bench"])).tree_children == "sampled"
    assert config_from(build_parser().parse_args(["bench"])).trees == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trees", "3x2x6"], "argument --trees: '3x2x6': expected DEPTHxTOPK/NODES, for "
         "example 4x4/16 (write 3x2/6)"),
        (["--trees", "4x4"], "argument --trees: '4x4': expected DEPTHxTOPK/NODES"),
        (["--trees", "3x1/3"], "argument --trees: 3x1/3: a tree has >= 2 children per node"),
        (["--trees", "0x2/1"], "argument --trees: 0x2/1: the depth must be >= 1"),
        (["--trees", "2x2/7"], "argument --trees: 2x2/7: the nodes must be >= the depth (2) "
         "and <= the 6 candidates"),
        (["--trees", "3x2/2"], "3x2/2: the nodes must be >= the depth (3)"),
        (["--tree-children", "wide"], "argument --tree-children: invalid choice: 'wide'"),
        (["--draft-lengths", "-1"], "argument --draft-lengths: expected an integer >= 0 or "
         "'auto', got -1"),
        (["--draft-lengths", "two"], "argument --draft-lengths: expected an integer or 'auto'"),
        (["--speculative-config", '{"method": "ngram", "topk": 2}'],
         "error: speculative_config.topk: bench takes the grid's trees from --trees"),
        (["--speculative-config", '{"method": "ngram", "tree_children": "top"}'],
         "error: speculative_config.tree_children: bench takes the grid's trees from "
         "--tree-children"),
    ],
)  # fmt: skip
def test_bench_rejects_bad_trees(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_bench_config_checks_its_trees() -> None:
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="trees 2x1/2: a tree has >= 2 children"):
        BenchConfig(trees=[DraftShape(2, 1, 2)]).check()
    with pytest.raises(InvalidInputError, match="tree_children must be one of sampled, top"):
        BenchConfig(trees=[DraftShape(2, 2, 4)], tree_children="best").check()
    with pytest.raises(InvalidInputError, match="draft_lengths must be integers >= 0"):
        BenchConfig(draft_lengths=[0, -1]).check()


@pytest.mark.parametrize(
    ("tree", "limit"),
    [
        ("5x4/64", "--trees 5x4/64: speculative_config.num_draft_tokens must be in [1, 63]"),
        ("9x9/40", "--trees 9x9/40: speculative_config.topk x (num_speculative_tokens - 1) "
         "must be at most 64"),
    ],
)  # fmt: skip
def test_a_tree_past_the_engines_limits_is_named(
    make_checkpoint: Callable[..., Path],
    capsys: pytest.CaptureFixture[str],
    tree: str,
    limit: str,
) -> None:
    target = str(make_checkpoint("llama", num_layers=2, seed=0))
    argv = ["bench", "--model", target, "--draft-model", target, "--draft-lengths", "0"]
    assert main([*argv, "--trees", tree, "--device", "cpu", "--no-progress"]) == 2
    assert limit in capsys.readouterr().err


def test_repeats_pool_every_run() -> None:
    from specbatch.bench.cells import pool_runs
    from specbatch.request import SpecStats

    runs = [_cell(1, 2, tok_s) for tok_s in (120.0, 100.0, 140.0)]
    figures = ((1.0, 120, 40, 90.0), (2.0, 200, 60, 150.0), (1.0, 140, 100, 110.0))
    for run, (wall, tokens, steps, full) in zip(runs, figures):
        run.wall_s, run.output_tokens, run.steps = wall, tokens, steps
        run.step_s = wall / steps
        run.full_batch_tok_s = full
        run.spec = SpecStats()
    runs[0].spec.record(2, 2)  # 3 tokens, no rejection
    runs[1].spec.record(2, 0)  # 1 token, a rejection at the first draft
    runs[2].spec.record(2, 1)  # 2 tokens, a rejection at the second
    cell = pool_runs(runs)
    # tokens over time, both summed: the 2-second run weighs twice
    assert cell.output_tok_s == pytest.approx(460 / 4.0)
    assert cell.wall_s == 4.0 and cell.output_tokens == 460 and cell.steps == 200
    assert cell.num_requests == 3 and cell.runs_tok_s == [120.0, 100.0, 140.0]
    assert cell.step_s == pytest.approx(4.0 / 200)  # weighted by steps
    assert cell.spec_rounds == 3 and cell.draft_tokens_proposed == 6
    assert cell.alpha == pytest.approx(3 / 5) and cell.acceptance_rate == pytest.approx(0.5)
    assert cell.mean_tokens_per_round == pytest.approx(2.0)
    # the full-batch figure is the median of the runs' own
    assert cell.full_batch_tok_s == 110.0
    # latencies are over every run's requests: the repeats ran different prompts
    for run, tpots in zip(runs, ([0.010, 0.012], [0.020], [0.030, 0.040, 0.050])):
        run.latencies = {"tpot": tpots, "ttft": [0.1] * len(tpots)}
        run.tpot_mean = sum(tpots) / len(tpots)
    cell = pool_runs(runs)
    assert cell.tpot_mean == pytest.approx(0.162 / 6)
    assert cell.runs_tpot_mean == pytest.approx([0.011, 0.020, 0.040])  # each run's own
    assert cell.tpot_p99 == pytest.approx(0.0495) and cell.ttft_mean == pytest.approx(0.1)
    d = cell.to_dict()
    assert cell.e2e_mean is None and "latencies" not in d and "spec" not in d
    assert pool_runs(runs[:1]).output_tok_s == 120.0


def test_auto_is_set_beside_the_best_fixed_cell_round_by_round() -> None:
    from specbatch.bench.auto_vs_fixed import auto_vs_fixed, format_auto_vs_fixed

    def cell(d: Draft | int, runs_tok_s: list[float], runs_tpot: list[float]) -> CellResult:
        c = _cell(4, d, sorted(runs_tok_s)[1])
        c.runs_tok_s, c.runs_tpot_mean = runs_tok_s, runs_tpot
        c.tpot_mean = sum(runs_tpot) / 3  # equal request counts per run
        return c

    cells = [
        cell(0, [80.0, 90.0, 85.0], [0.030, 0.028, 0.029]),
        cell(2, [100.0, 120.0, 110.0], [0.020, 0.018, 0.019]),  # the best fixed length
        cell(1, [95.0, 118.0, 105.0], [0.021, 0.018, 0.020]),
        # one slow round (the machine's hiccup) weighs on the pooled TPOT, not per round
        cell("auto", [70.0, 121.0, 112.0], [0.030, 0.018, 0.019]),
    ]
    row = auto_vs_fixed(cells)["4"]
    assert row["best_fixed"] == "2"
    assert row["tok_ratio"] == pytest.approx(112 / 110)
    assert row["tpot_ratio"] == pytest.approx(0.067 / 0.057)
    assert not row["meets_bar"]  # TPOT 1.18x
    assert row["round_tok_ratios"] == pytest.approx([0.7, 121 / 120, 112 / 110])
    assert row["median_round_tok_ratio"] == pytest.approx(121 / 120)
    assert row["median_round_tpot_ratio"] == pytest.approx(1.0)
    text = "\n".join(format_auto_vs_fixed({"4": row}))
    assert "B=4: best 2," in text and "MISSES" in text
    assert auto_vs_fixed(cells[:3]) == {}  # no auto cell
    # a tree is a fixed cell too: the best of them all is auto's bar
    cells.append(cell(DraftShape(3, 2, 6), [110.0, 125.0, 120.0], [0.019, 0.017, 0.018]))
    row = auto_vs_fixed(cells)["4"]
    assert row["best_fixed"] == "3x2/6" and row["tok_ratio"] == pytest.approx(112 / 120)
    assert "B=4: best 3x2/6," in "\n".join(format_auto_vs_fixed({"4": row}))


@pytest.mark.parametrize("interleave", ["steps", "cells"])
def test_each_repeat_runs_prompts_of_its_own(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, interleave: str
) -> None:
    from specbatch.bench import cell_run, offline
    from specbatch.bench.bench_config import BenchConfig

    measured: list[tuple[int, int, int, tuple[tuple[int, ...], ...]]] = []

    class Recording(cell_run.CellRun):
        def __init__(self, engine, workload, batch_size, num_requests, params, **kw):
            first = kw.get("first_prompt", 0)
            if num_requests == 3:  # a measured run, not a warm-up
                prompts = tuple(tuple(workload.prompt(first + i)) for i in range(num_requests))
                depth = engine.config.speculative_config.depth
                measured.append((batch_size, depth, first, prompts))
            super().__init__(engine, workload, batch_size, num_requests, params, **kw)

    monkeypatch.setattr(offline, "CellRun", Recording)  # side by side
    monkeypatch.setattr(cell_run, "CellRun", Recording)  # alone (run_cell)
    cfg = BenchConfig(
        model=str(make_checkpoint("llama", num_layers=1, seed=0)),
        draft_model=str(make_checkpoint("llama", num_layers=1, seed=1)),
        batch_sizes=[1, 2],
        draft_lengths=[0, 2],
        num_requests=3,
        input_len=4,
        output_len=3,
        repeats=2,
        interleave=interleave,
        engine_kwargs={"device": "cpu"},
    )
    offline.run_bench(cfg, progress=False)
    assert len(measured) == 2 * 2 * 2  # batch sizes x repeats x draft lengths
    for b in (1, 2):
        runs = [(first, prompts) for bb, _, first, prompts in measured if bb == b]
        # the draft lengths of a repeat share its prompts; the next repeat takes the next ones
        assert [first for first, _ in runs] == [4, 4, 7, 7]
        # the second round runs the draft lengths in the other order
        assert [k for bb, k, _, _ in measured if bb == b] == [0, 2, 2, 0]
        assert runs[0][1] == runs[1][1] and runs[2][1] == runs[3][1]
        assert not set(runs[0][1]) & set(runs[2][1])


def _cell(b: int, d: Draft | int, tok_s: float, alpha: float | None = None) -> CellResult:
    draft = DraftShape.chain(d) if isinstance(d, int) else d
    depth = draft.depth if isinstance(draft, DraftShape) else 2
    return CellResult(
        batch_size=b,
        draft=draft,
        num_requests=1,
        input_len=1,
        output_len=2,
        wall_s=1.0,
        output_tokens=2,
        engine_generated_tokens=2,
        steps=2,
        output_tok_s=tok_s,
        tpot_mean=None,
        tpot_p50=None,
        tpot_p99=None,
        ttft_mean=None,
        ttft_p50=None,
        ttft_p99=None,
        e2e_mean=None,
        e2e_p50=None,
        e2e_p99=None,
        step_s=0.01,
        target_s_per_step=0.01,
        draft_s_per_step=0.002 * depth,
        draft_passes_per_step=float(depth),
        alpha=alpha,
        mean_draft_length=float(draft.nodes) if draft != "auto" and draft.nodes else None,
    )


def test_speedup_and_crossover() -> None:
    cells = [
        _cell(1, 0, 100.0),
        _cell(1, 2, 150.0, 0.5),
        _cell(8, 0, 400.0),
        _cell(8, 2, 300.0, 0.5),
        _cell(16, 0, 500.0),
        _cell(16, 2, 400.0, 0.5),
    ]
    compare_with_plain(cells)
    assert cells[1].measured_speedup == pytest.approx(1.5)
    assert cells[1].cost_ratio == pytest.approx(0.2)
    # (1 - 0.5^3) / (0.5 * (2 * 0.2 + 1)) = 1.75 / 1.4
    assert cells[1].predicted_speedup == pytest.approx(1.25)
    assert crossover(cells)["crossover"] == 8
    assert crossover(cells)["crossover_by_draft"] == {"2": 8}
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    tree, auto = _cell(1, DraftShape(3, 2, 6), 180.0, 0.5), _cell(1, "auto", 170.0, 0.5)
    auto.draft_s_per_step, auto.draft_passes_per_step = 0.003, 1.5  # what its steps ran
    compare_with_plain([*cells, tree, auto])
    # a tree's draft pass: the draft time over its depth (3 passes), not its nodes (6)
    assert tree.cost_ratio == pytest.approx(0.006 / 3 / 0.01)
    # a chain as deep as the tree: (1 - 0.5^4) / (0.5 * (3 * 0.2 + 1))
    assert tree.predicted_speedup == pytest.approx(1.875 / 1.6)
    assert tree.measured_speedup == pytest.approx(1.8)
    assert auto.cost_ratio == pytest.approx(0.003 / 1.5 / 0.01) and auto.verify_ratio == 1.0
    assert auto.predicted_speedup is None  # its shapes vary from step to step
    assert crossover([*cells, tree, auto])["crossover_by_draft"] == {
        "2": 8,
        "3x2/6": None,
        "auto": None,
    }
    assert percentile([1.0, 2.0], 100) == 2.0


def test_bench_offline_form_parses_like_bench() -> None:
    from specbatch.entrypoints.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "offline", "--batch-sizes", "2", "5", "--draft-lengths", "0"])
    b = p.parse_args(["bench", "--batch-sizes", "2", "5", "--draft-lengths", "0"])
    assert a.batch_sizes == b.batch_sizes == [2, 5] and a.draft_lengths == b.draft_lengths == [0]
    assert a.func is b.func
    assert p.parse_args(["bench"]).batch_sizes == [1, 2, 4, 8, 16, 32, 64]


def test_mixed_workload_alternates_easy_and_hard_requests() -> None:
    from specbatch.bench.workload import EASY_CODE, Workload, mixed
    from specbatch.sampling_params import SamplingParams
    from specbatch.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path("target"))
    base = Workload([list(range(i + 5, i + 25)) for i in range(4)], 20, 8, "test")
    mix = mixed(base, tok, hard_temperature=1.5)
    greedy = SamplingParams(temperature=0.7, max_tokens=8)
    for i in range(4):
        prompt, params = mix.prompt(i), mix.params(i, greedy)
        assert len(prompt) == 20 and params.max_tokens == 8
        if i % 2 == 0:  # easy: repetitive code, greedy
            assert tok.decode(prompt) in EASY_CODE[i // 2] and params.temperature == 0.0
        else:  # hard: the prompt as it was, sampled hot
            assert prompt == base.prompt(i) and params.temperature == 1.5
    assert base.params(1, greedy) is greedy
    assert "mixed" in mix.source
    assert mixed(base, None, 1.0).prompt(0) == [5] * 20  # no tokenizer: one id repeated


def test_output_lengths_spread_alike_for_every_draft_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specbatch.bench.workload import Workload, spread_output_lengths
    from specbatch.entrypoints.bench import config_from
    from specbatch.entrypoints.cli import build_parser
    from specbatch.sampling_params import SamplingParams

    base = Workload([[i + 3] * 4 for i in range(200)], 4, 64, "test")
    spread = spread_output_lengths(base, 0.5, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    lengths = [spread.params(i, params).max_tokens for i in range(200)]
    assert min(lengths) >= 32 and max(lengths) <= 96
    assert min(lengths) < 40 and max(lengths) > 88  # uniform over the range, not bunched
    assert abs(sum(lengths) / len(lengths) - 64) < 4
    # a function of the prompt's index alone: every draft length's cell gets the same lengths
    again = spread_output_lengths(base, 0.5, seed=3)
    assert [again.params(i, params).max_tokens for i in range(200)] == lengths
    # a shorter request (the warm-up's) is scaled by the same factor
    short = [spread.params(i, SamplingParams(max_tokens=8)).max_tokens for i in range(200)]
    assert all(abs(s - n / 8) <= 0.6 for s, n in zip(short, lengths))
    assert spread_output_lengths(base, 0.0) is base
    ns = build_parser().parse_args(["bench", "--output-len-spread", "0.25"])
    assert config_from(ns).output_len_spread == 0.25
    assert main(["bench", "--output-len-spread", "1", "--no-progress"]) == 2
    assert "--output-len-spread must be in [0, 1)" in capsys.readouterr().err


def test_bench_mixed_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from specbatch.entrypoints.bench import config_from
    from specbatch.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "--mixed", "1.5", "--batch-sizes", "1"])
    assert config_from(ns).mixed == 1.5
    assert main(["bench", "--mixed", "-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--mixed" in err and "temperature" in err


@pytest.mark.parametrize(
    ("cfg", "label"),
    [
        ({"model": None, "draft_model": None, "speculative_config": None}, "built-in EAGLE head"),
        ({"model": None, "draft_model": None, "speculative_config": {"method": "draft_model"}},
         "built-in draft model"),
        ({"model": "/t", "draft_model": None, "speculative_config": {"method": "ngram"}},
         "ngram (prompt lookup)"),
        ({"model": "/t", "draft_model": "/d", "speculative_config": None}, "draft_model /d"),
        ({"model": "/t", "draft_model": None,
          "speculative_config": {"method": "eagle3", "model": "/h"}}, "eagle3 /h"),
        ({"model": "/t", "draft_model": None, "speculative_config": None}, "-"),
    ],
)  # fmt: skip
def test_report_names_the_drafter(cfg: dict, label: str) -> None:
    from specbatch.bench.report import drafter_label

    assert drafter_label(cfg) == label


def test_tree_cells_run_the_mixed_workload(make_checkpoint: Callable[..., Path]) -> None:
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.bench.offline import run_bench

    cfg = BenchConfig(
        model=str(make_checkpoint("llama", num_layers=2, seed=0)),
        draft_model=str(make_checkpoint("llama", num_layers=1, seed=1)),
        batch_sizes=[2],
        draft_lengths=[0, 2],
        trees=[DraftShape(2, 2, 5)],
        tree_children="top",
        mixed=1.0,
        input_len=8,
        output_len=6,
        output_len_spread=0.0,
        num_requests=4,
        engine_kwargs={"device": "cpu", "attention_backend": "torch"},
    )
    result = run_bench(cfg, progress=False)
    assert [str(c.draft) for c in result.cells] == ["0", "2", "2x2/5"]
    assert "mixed" in result.workload_source
    for c in result.cells:
        assert c.output_tokens == 4 * 6 == c.engine_generated_tokens
    tree = result.cells[2]
    assert tree.spec_rounds > 0 and tree.mean_draft_length is not None
    assert 2 < tree.mean_draft_length <= 5 and tree.predicted_speedup is not None
    assert "auto_vs_fixed" not in result.summary and result.config["auto_shape"] is None


def test_tree_cells_run_the_grounded_workload() -> None:
    from specbatch.bench.bench_config import BenchConfig
    from specbatch.bench.offline import run_bench

    cfg = BenchConfig(  # the built-in pair, drafting with its EAGLE head
        batch_sizes=[1],
        draft_lengths=[0, "auto"],
        trees=[DraftShape(3, 2, 6)],
        workload="grounded",
        input_len=48,
        output_len=8,
        output_len_spread=0.0,
        num_requests=2,
        engine_kwargs={"device": "cpu", "attention_backend": "torch"},
    )
    result = run_bench(cfg, progress=False)
    assert result.workload_source.startswith("grounded")
    plain, tree, auto = result.cells
    assert tree.draft == DraftShape(3, 2, 6) and tree.output_tokens == 2 * 8
    assert tree.spec_rounds > 0 and tree.alpha is not None and tree.cost_ratio is not None
    assert tree.target_rows_per_step > plain.target_rows_per_step
    # auto, with the tree's children per node in its ladder, set against plain and the tree
    assert auto.draft == "auto" and auto.output_tokens == 2 * 8
    assert result.config["auto_shape"] == "3x2/6"
    assert result.summary["auto_vs_fixed"]["1"]["best_fixed"] in ("0", "3x2/6")
