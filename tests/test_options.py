"""Every option is declared once: the schema reaches the command line, ``LLM(...)`` (through
``EngineArgs``) and the server with the same default and limit, and an out-of-range value is
refused at each, naming the option as that user writes it. The drafter registry builds every
drafter from ``speculative_config``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specbatch.config import EngineArgs
from specbatch.drafters import DRAFTERS
from specbatch.engine.llm_engine import LLMEngine
from specbatch.entrypoints.cli import build_parser, main
from specbatch.entrypoints.flags import flag
from specbatch.entrypoints.openai_protocol import ChatRequest, CompletionRequest
from specbatch.errors import InvalidInputError
from specbatch.options import Option, options_of
from specbatch.sampling_params import SamplingParams
from specbatch.speculative_config import SHORTHANDS, SpeculativeConfig
from specbatch.testing.eagle_heads import make_eagle_head

OPTIONS = [(cls, *o) for cls in (EngineArgs, SamplingParams) for o in options_of(cls)]
IDS = [f"{cls.__name__}.{name}" for cls, name, _, _ in OPTIONS]
LIMITS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def out_of_range(opt: Option) -> Any:
    """A value of the option's type that breaks its limit (None: it has none)."""
    if opt.choices:
        return "nope"
    step = 1 if opt.type is int else 0.5
    value = None
    if opt.ge is not None:
        value = opt.ge - step
    elif opt.gt is not None:
        value = opt.gt
    elif opt.le is not None:
        value = opt.le + step
    elif opt.lt is not None:
        value = opt.lt
    return [value] if opt.many and value is not None else value


def cli_defaults(argv: list[str]) -> dict[str, Any]:
    return vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(("cls", "name", "opt", "default"), OPTIONS, ids=IDS)
def test_every_option_reaches_every_entry_point_alike(
    cls: Any,
    name: str,
    opt: Option,
    default: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = out_of_range(opt)
    # Python: the dataclass (LLM(...) takes EngineArgs' fields as keywords)
    assert getattr(cls(), name) == (default if name != "stop_token_ids" else [])
    if bad is not None:
        with pytest.raises(InvalidInputError) as e:
            cls(**{name: bad})
        assert e.value.field == name and str(e.value).startswith(f"{name} must be ")
        assert opt.limit in str(e.value)
    # the command line: generate has a flag for each, with the same default and the limit
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    argv = ["generate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    if opt.flag:
        assert cli_defaults(argv)[name] == default, name
        assert main([*argv, "--help"]) == 0
        shown = capsys.readouterr().out
        assert flag(name) in shown and (opt.limit in " ".join(shown.split()) or opt.choices)
        if bad is not None:
            value = ",".join(map(str, bad)) if isinstance(bad, list) else str(bad)
            assert main([*argv, flag(name), value]) == 2
            err = capsys.readouterr().err
            assert flag(name) in err and (opt.limit in err or "invalid choice" in err), err
    # the server: every sampling option is a request field, its default and limits stated
    if cls is SamplingParams:
        field = CompletionRequest.model_fields[name]
        assert field.default == default
        schema = CompletionRequest.model_json_schema()["properties"][name]
        for bound, key in LIMITS.items():
            assert schema.get(key) == getattr(opt, bound), (name, key)


def test_the_chat_aliases_state_the_limits_of_their_options() -> None:
    chat = ChatRequest.model_json_schema()["properties"]
    assert chat["max_completion_tokens"]["minimum"] == 1 == chat["max_tokens"]["minimum"]
    assert chat["top_logprobs"]["maximum"] == 20


@pytest.mark.parametrize("name", list(SHORTHANDS))
def test_a_shorthand_is_its_speculative_config_field(name: str) -> None:
    spec = {n: (o, d) for n, o, d in options_of(SpeculativeConfig)}[SHORTHANDS[name]]
    engine = {n: (o, d) for n, o, d in options_of(EngineArgs)}[name]
    assert engine[1] == spec[1] and engine[0].limit == spec[0].limit
    bad = out_of_range(spec[0])
    if bad is not None:  # the same limit, named as each spelling
        with pytest.raises(InvalidInputError, match=f"^{name} must be"):
            EngineArgs(**{name: bad})
        with pytest.raises(InvalidInputError, match=f"^speculative_config.{SHORTHANDS[name]} "):
            EngineArgs(speculative_config={"method": "ngram", SHORTHANDS[name]: bad})


SPEC_OPTIONS = list(options_of(SpeculativeConfig))


@pytest.mark.parametrize(("name", "opt", "default"), SPEC_OPTIONS, ids=[o[0] for o in SPEC_OPTIONS])
def test_every_speculative_config_key_is_checked_once_as_declared(
    name: str, opt: Option, default: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each key of ``speculative_config`` (the tree keys too) has its declared default, and a
    value past its limit is refused, naming ``speculative_config.KEY`` and the limit, whether
    ``LLM(...)`` takes it as a dict or the command line as JSON."""
    assert getattr(SpeculativeConfig(), name) == default
    bad = out_of_range(opt)
    if bad is None:
        return
    spec = {"method": "ngram", name: bad}
    with pytest.raises(InvalidInputError) as e:
        EngineArgs(speculative_config=spec)
    assert e.value.field == f"speculative_config.{name}"
    assert str(e.value).startswith(f"speculative_config.{name} must be {opt.expected(True)}")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    argv = ["generate", "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--speculative-config", json.dumps(spec)]) == 2
    err = capsys.readouterr().err
    assert f"error: speculative_config.{name} must be" in err and opt.limit in err, err


@pytest.fixture(scope="module")
def drafters(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    target = make_checkpoint("llama", num_layers=2)
    heads = tmp_path_factory.mktemp("heads")
    return target, {
        "draft_model": str(make_checkpoint("llama", num_layers=1, seed=3)),
        "eagle": str(make_eagle_head(heads / "eagle", target, "eagle")),
        "eagle3": str(make_eagle_head(heads / "eagle3", target, "eagle3")),
        "ngram": None,
        "self_sparse": None,
        "suffix": None,
    }


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_the_registry_builds_each_drafter_from_speculative_config(
    drafters: tuple[Path, dict[str, str | None]], method: str
) -> None:
    target, models = drafters
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 2}
    if models[method] is not None:
        spec["model"] = models[method]
    args = EngineArgs(str(target), speculative_config=spec, num_kv_blocks=16, max_model_len=64)
    engine = LLMEngine.from_engine_args(args)
    try:
        kind = DRAFTERS[method]
        drafter = engine.executor.worker.drafter
        assert type(drafter) is kind.load()
        assert engine.config.speculative_config.model == models[method]
        assert engine.scheduler.draft_input == kind.draft_input
        if method.startswith("eagle"):
            assert engine.config.draft.layout == method  # read once, handed to the loader
        engine.add_request([3, 4, 5] * 4, SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        rounds = engine.metrics.summary()["spec_rounds"]
        # a lookup drafts only what repeats: a random target's output rarely repeats the prompt
        assert rounds or not kind.samples
    finally:
        engine.shutdown()
