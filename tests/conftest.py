"""Shared pytest fixtures.

Model checkpoints: ``make_checkpoint(arch="llama", **kwargs)`` writes a tiny random Hugging Face
checkpoint (see ``specbatch.testing.checkpoints.make_random_checkpoint`` for the arguments) once
per session and argument set, and returns its directory. Treat the directory as read-only.

CPU kernels: ``kern`` is this machine's build and, where the CPU has AVX-512, the AVX2 build too;
``attn_kern`` adds the test build of attention's path for AVX512-BF16.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specbatch.kernels.build import cpu_flags, load_module
from specbatch.kernels.cpu import CpuKernels, cpu_kernels
from specbatch.testing.checkpoints import make_random_checkpoint

# The tests run tiny models: one intra-op thread is as fast as two on them, and it keeps the
# suite from oversubscribing the cores when Ray workers or parallel jobs share the machine: each
# pytest-xdist worker (pyproject's addopts: two) runs here, so each has one thread. The tests of
# several threads set them themselves (test_cpu_attention*.py).
torch.set_num_threads(1)

# Without CUDA, triton runs nothing, yet torch._dynamo imports it where it is installed (an
# xgrammar dependency) the moment transformers' generation code is imported: the tests'
# reference (``generate``) and their checkpoints. The engine's gc.freeze() then keeps triton's
# objects alive past interpreter exit, and triton's bindings (nanobind) end every run with ~60
# lines of "nanobind: leaked ...". Here torch is told there is no triton, as it would be on a
# machine without it (``None`` in sys.modules makes ``import triton`` raise ImportError).
if not torch.cuda.is_available():
    sys.modules.setdefault("triton", None)


def _xdist_groups(item: pytest.Item) -> str:
    names = {
        str(m.args[0] if m.args else m.kwargs.get("name", "default"))
        for m in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` on an xdist worker: each test of an ``xdist_group`` gets the
    ``@group`` suffix on its node id, which is how the controller sends a group's tests to one
    worker. pytest-xdist (3.8) writes it to ``item._nodeid``, a field pytest 9.2 no longer reads
    (its node ids are ``item._id``; pytest-xdist issue #1386), and every group is then silently
    spread over the workers. Runs after xdist's hook, and only where the suffix is missing."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    for item in items:
        groups = _xdist_groups(item)
        if not groups or item.nodeid.endswith(f"@{groups}"):
            continue
        from _pytest.nodeid import NodeId  # pytest >= 9.2, where xdist's suffix is lost

        item._id = NodeId.parse(f"{item.nodeid}@{groups}")


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **kwargs: Any) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt_{arch}")
            cache[key] = make_random_checkpoint(out, arch, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    """The default tiny Llama (vocab 256, 2 layers, GQA 4/2 heads) with a small tokenizer."""
    return make_checkpoint("llama", with_tokenizer=True)


@functools.cache
def _kernel_build(name: str) -> CpuKernels | None:
    if name == "native":
        return cpu_kernels()
    if name == "avx2":
        return CpuKernels(load_module(avx2_only=True))
    return CpuKernels(load_module(defines=("SB_ATTN_PAIRS_TEST",)))


_AVX2_BUILD = pytest.param(
    "avx2",
    marks=pytest.mark.skipif(
        "avx512f" not in cpu_flags(), reason="the native build is the AVX2 build here"
    ),
)
_PAIRS_BUILD = pytest.param(
    "pairs",
    marks=pytest.mark.skipif(
        "avx512_bf16" in cpu_flags(), reason="the native build has the dot products of pairs"
    ),
)


def _kernels_of(name: str) -> CpuKernels:
    kernels = _kernel_build(name)
    if kernels is None:
        pytest.skip("the CPU kernels do not build here")
    return kernels


@pytest.fixture(params=["native", _AVX2_BUILD])
def kern(request: pytest.FixtureRequest) -> CpuKernels:
    """The op-level kernel tests run on this CPU's build and, where it has AVX-512, on the AVX2
    build too (the same sources with 16-lane vectors as register pairs)."""
    return _kernels_of(request.param)


@pytest.fixture(params=["native", _AVX2_BUILD, _PAIRS_BUILD])
def attn_kern(request: pytest.FixtureRequest) -> CpuKernels:
    """``kern``, and for attention also (where the CPU lacks AVX512-BF16) the build of its
    bfloat16 path on dot products of pairs, run on their two FMAs."""
    return _kernels_of(request.param)
