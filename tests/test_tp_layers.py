"""Tensor-parallel layers at TP=2, over two gloo processes, against the same layers at TP=1.

The parent serves the rendezvous store (``specbatch.distributed.init``, as the Ray executor
does) and spawns two ranks that run every case once; each test then checks one case:

- column-parallel (plain, merged gate/up, fused QKV): each rank holds exactly its slice of the
  full output (whole heads for QKV);
- row-parallel (with bias): every rank holds the full output, the bias counted once;
- column -> SiLU*up -> row (the MLP): equals the unsharded MLP;
- vocab-parallel embedding and LM head (an uneven vocabulary, and a tied head): the full result
  on every rank, nothing from the padding;
- whole models (Mistral; Qwen2 with tied embeddings and biases) through the paged cache: logits
  equal TP=1, bit-identical across ranks.

The ranks read their weights as lazy safetensors slices (``get_slice``: only their rows or
columns), the TP=1 reference reads whole tensors, so both paths of the weight loaders are used.
``spawn`` (not fork): another test module may have started Ray's threads in this process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specbatch.distributed.init import Rendezvous, destroy_process_group, init_process_group
from specbatch.distributed.init import serve_store as _serve_store
from specbatch.distributed.parallel_state import SINGLE, TensorParallelGroup
from specbatch.model.layers.activation import SiluAndMul
from specbatch.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from specbatch.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from specbatch.model.layers.weights import Loaded, get_weight_loader, read_all
from specbatch.model.loader import load_model
from tests.test_model import SCHEDULE, random_tokens, run_schedule

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    # one worker (pytest-xdist) runs the module: ``outputs`` runs the two ranks once
    pytest.mark.xdist_group("tp_layers"),
]

WORLD = 2
HIDDEN, INTER, TOKENS = 16, 24, 5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4
VOCAB = 11  # not divisible by 2: rank 1's last row is padding
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {"vocab_size": 250}),
    "qwen2-tied": ("qwen2", {"vocab_size": 250, "tie_word_embeddings": True}),
}
TIMEOUT_S = 240


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {
        "x": r(TOKENS, HIDDEN),
        "x_inter": r(TOKENS, INTER),
        "ids": torch.arange(VOCAB).flip(0),  # every id, both ranks' ranges
        "col.w": r(INTER, HIDDEN),
        "col.b": r(INTER),
        "gate.w": r(INTER, HIDDEN),
        "up.w": r(INTER, HIDDEN),
        "gate.b": r(INTER),
        "up.b": r(INTER),
        "q.w": r(q, HIDDEN),
        "k.w": r(kv, HIDDEN),
        "v.w": r(kv, HIDDEN),
        "q.b": r(q),
        "k.b": r(kv),
        "v.b": r(kv),
        "row.w": r(HIDDEN, INTER),
        "row.b": r(HIDDEN),
        "emb.w": r(VOCAB, HIDDEN),
        "head.w": r(VOCAB, HIDDEN),
    }


def _load(module: torch.nn.Module, get: Callable[[str], Loaded], spec: dict[str, Any]) -> None:
    """``spec``: parameter name -> checkpoint name, or a list of (checkpoint name, shard id)."""
    params = dict(module.named_parameters())
    for pname, sources in spec.items():
        param = params[pname]
        for name, shard in sources if isinstance(sources, list) else [(sources, None)]:
            get_weight_loader(param)(param, get(name), shard)


@torch.inference_mode()
def run_cases(
    tp: TensorParallelGroup, get: Callable[[str], Loaded], models: dict[str, str]
) -> dict[str, Any]:
    """Every case at this rank; ``get(name)`` gives a checkpoint tensor or lazy slice."""
    kw: dict[str, Any] = {"tp": tp, "dtype": torch.float32, "device": "cpu"}
    x, x_inter, ids = (read_all(get(name)) for name in ("x", "x_inter", "ids"))
    out: dict[str, Any] = {}

    col = ColumnParallelLinear(HIDDEN, INTER, bias=True, **kw)
    _load(col, get, {"weight": "col.w", "bias": "col.b"})
    out["column"] = col(x)

    merged = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=True, **kw)
    _load(
        merged,
        get,
        {"weight": [("gate.w", 0), ("up.w", 1)], "bias": [("gate.b", 0), ("up.b", 1)]},
    )
    out["merged"] = merged(x)

    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, **kw)
    _load(
        qkv,
        get,
        {
            "weight": [("q.w", "q"), ("k.w", "k"), ("v.w", "v")],
            "bias": [("q.b", "q"), ("k.b", "k"), ("v.b", "v")],
        },
    )
    out["qkv"] = [t.clone() for t in qkv.split(qkv(x))]

    row = RowParallelLinear(INTER, HIDDEN, bias=True, **kw)
    _load(row, get, {"weight": "row.w", "bias": "row.b"})
    n = INTER // tp.size
    out["row"] = row(x_inter[:, tp.rank * n : (tp.rank + 1) * n].contiguous())

    # the MLP: merged column -> SiLU(gate) * up -> row, one all-reduce
    out["mlp"] = row(SiluAndMul()(merged(x)))

    emb = VocabParallelEmbedding(VOCAB, HIDDEN, **kw)
    _load(emb, get, {"weight": "emb.w"})
    out["embedding"] = emb(ids)

    head = ParallelLMHead(VOCAB, HIDDEN, **kw)
    _load(head, get, {"weight": "head.w"})
    out["lm_head"] = head(x)
    tied = ParallelLMHead(VOCAB, HIDDEN, tied_weight=emb.weight, **kw)
    out["lm_head_tied"] = tied(x)

    for name, path in models.items():
        model = load_model(path, torch.float32, "cpu", tp)
        lengths = [sum(step[b] for step in SCHEDULE) for b in range(len(SCHEDULE[0]))]
        out[name] = run_schedule(model, random_tokens(lengths, model.vocab_size), SCHEDULE)
    return out


def _rank_main(rank: int, rdv: Rendezvous, weights: str, models: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    tp = init_process_group(rank, rdv)
    try:
        with safe_open(weights, framework="pt", device="cpu") as f:
            result = run_cases(tp, f.get_slice, models)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        destroy_process_group()
    # Leave without the interpreter's teardown: there, now and then, a C++ thread of the
    # process group is destroyed while still joinable ("terminate called without an active
    # exception", SIGABRT) after the results are written. An exception above still fails.
    os._exit(0)


@pytest.fixture(scope="module")
def outputs(make_checkpoint, tmp_path_factory) -> dict[str, Any]:
    """``{"ranks": [rank0 results, rank1 results], "ref": TP=1 results, "w": full tensors}``."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("tp_layers")
    tensors = make_tensors()
    save_file(tensors, tmp / "w.safetensors")
    models = {name: str(make_checkpoint(arch, **kwargs)) for name, (arch, kwargs) in MODELS.items()}
    store = _serve_store(TIMEOUT_S)
    rdv = Rendezvous("127.0.0.1", store.port, "tp-layers/", "gloo", WORLD, TIMEOUT_S)
    args = (rdv, str(tmp / "w.safetensors"), models, str(tmp))
    ctx = mp.start_processes(_rank_main, args=args, nprocs=WORLD, join=False, start_method="spawn")
    ref = run_cases(SINGLE, load_file(tmp / "w.safetensors").__getitem__, models)  # meanwhile
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"tensor-parallel ranks did not finish within {TIMEOUT_S} s")
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]
    return {"ranks": ranks, "ref": ref, "w": tensors}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _slice(t: torch.Tensor, rank: int, parts: int = WORLD) -> torch.Tensor:
    n = t.shape[-1] // parts
    return t[..., rank * n : (rank + 1) * n]


def test_column_parallel_holds_its_slice(outputs) -> None:
    full = outputs["ref"]["column"]
    for rank, got in enumerate(outputs["ranks"]):
        assert got["column"].shape == (TOKENS, INTER // WORLD)
        _close(got["column"], _slice(full, rank))


def test_merged_gate_up_holds_its_slice_of_each(outputs) -> None:
    gate, up = outputs["ref"]["merged"].split(INTER, dim=-1)
    for rank, got in enumerate(outputs["ranks"]):
        _close(got["merged"], torch.cat([_slice(gate, rank), _slice(up, rank)], dim=-1))


def test_qkv_holds_whole_heads(outputs) -> None:
    full_q, full_k, full_v = outputs["ref"]["qkv"]
    for rank, got in enumerate(outputs["ranks"]):
        q, k, v = got["qkv"]
        assert q.shape == (TOKENS, HEADS // WORLD, HEAD_DIM)
        assert k.shape == v.shape == (TOKENS, KV_HEADS // WORLD, HEAD_DIM)
        hq, hk = HEADS // WORLD, KV_HEADS // WORLD
        _close(q, full_q[:, rank * hq : (rank + 1) * hq])
        _close(k, full_k[:, rank * hk : (rank + 1) * hk])
        _close(v, full_v[:, rank * hk : (rank + 1) * hk])


def test_row_parallel_all_reduces_and_adds_bias_once(outputs) -> None:
    w = outputs["w"]
    want = torch.nn.functional.linear(w["x_inter"], w["row.w"], w["row.b"])
    _close(outputs["ref"]["row"], want)
    for got in outputs["ranks"]:
        _close(got["row"], want)


def test_mlp_equals_unsharded(outputs) -> None:
    for got in outputs["ranks"]:
        _close(got["mlp"], outputs["ref"]["mlp"])


def test_vocab_parallel_embedding_uneven_vocab(outputs) -> None:
    want = outputs["w"]["emb.w"][outputs["w"]["ids"]]
    _close(outputs["ref"]["embedding"], want)
    for got in outputs["ranks"]:
        _close(got["embedding"], want)


@pytest.mark.parametrize("case", ["lm_head", "lm_head_tied"])
def test_lm_head_gathers_the_full_vocabulary(outputs, case: str) -> None:
    w = outputs["w"]
    weight = w["head.w"] if case == "lm_head" else w["emb.w"]
    want = w["x"] @ weight.T
    for got in [outputs["ref"], *outputs["ranks"]]:
        assert got[case].shape == (TOKENS, VOCAB) and got[case].dtype == torch.float32
        _close(got[case], want)


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_logits_equal_tp1(outputs, name: str) -> None:
    ref = outputs["ref"][name]
    rank0, rank1 = (r[name] for r in outputs["ranks"])
    for a, b, want in zip(rank0, rank1, ref, strict=True):
        assert a.shape == want.shape
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # ranks agree bit for bit
        torch.testing.assert_close(a, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), want.argmax(-1))
