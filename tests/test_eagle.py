"""EAGLE heads: both published layouts against independent references, greedy output equal to
transformers' on the target, the sampled joint equal to the target's, the head's cache rolled
back and rebuilt under preemption, and the training script's every phase."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specbatch import LLM, InvalidInputError, SamplingParams
from specbatch.draft_shape import DraftShape
from specbatch.model.eagle import TargetParts, detect_layout, load_eagle_head
from specbatch.model.layers.attention import AttentionMetadata, TorchAttentionBackend
from specbatch.model.loader import load_model
from specbatch.scheduler.drafter_sleep import SLEEP_AFTER
from specbatch.stats import chi_square_gof
from specbatch.testing.eagle_heads import make_eagle_head
from tests.helpers import assert_full_vocab_head_has_no_d2t, exact_joint, hf_greedy

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_eagle.py"


def train_script():
    spec = importlib.util.spec_from_file_location("train_eagle", SCRIPT)
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(SCRIPT.parent))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tiny_llama_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny head trained by scripts/train_eagle.py (every phase) for the tiny target."""
    run = tmp_path_factory.mktemp("eagle_run")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--steps", "150", "--target",
         str(tiny_llama_checkpoint), "--out", str(run), "--export", str(run / "head"),
         "--generated", "1024", "--unroll", "3"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return tiny_llama_checkpoint, run / "head"


def test_training_script_writes_a_loadable_head(trained) -> None:
    _, head = trained
    info = json.loads((head / "training.json").read_text())
    for key in ("commands", "seed", "steps", "heldout_alpha_by_step", "parameters", "loss"):
        assert key in info, key
    assert info["generated_tokens"] >= 1024 - 32 and info["unroll"] == 3
    own = info["heldout_own_text_alpha_by_step"]
    assert own and all(len(alphas) == 3 for alphas in own.values())
    assert detect_layout(head) == "eagle3"
    log = (head.parent / "train_eagle.log").read_text()
    assert "features:" in log and "step 150/150" in log and "exported" in log
    assert_full_vocab_head_has_no_d2t(head)


# --- the layouts against references ---------------------------------------------------------


def prefill(head, ids: torch.Tensor, feats: torch.Tensor):
    """One ragged forward of a single sequence of len(ids) positions through the head."""
    n = len(ids)
    caches = head.allocate_kv_caches(-(-n // 4), 4, "cpu")
    meta = AttentionMetadata.from_lists([n], [n], [list(range(-(-n // 4)))], 4)
    return head(ids, head.from_target(feats), torch.arange(n), caches[0], meta)


def test_trained_head_matches_the_training_reference(trained) -> None:
    """The exported head run by the engine computes what the training script's module did."""
    target_dir, head_dir = trained
    target = load_model(target_dir, torch.float32, "cpu")
    head = load_eagle_head(head_dir, TargetParts.of(target), target.attention_backend,
                           torch.float32, "cpu")  # fmt: skip
    tr = train_script()
    cfg = json.loads((target_dir / "config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(str(head_dir / "model.safetensors"))
    state = {}
    for name, value in weights.items():
        short = name.removeprefix("midlayer.").removeprefix("self_attn.").removeprefix("mlp.")
        if name != "d2t":
            bare = "norm" in short or short == "lm_head.weight"  # Parameters, not Linears
            state[short.removesuffix(".weight") if bare else short] = value.float()
    streams = state["fc.weight"].shape[1] // cfg["hidden_size"]
    ref = tr.Head(cfg, state["gate_proj.weight"].shape[0], streams, state["lm_head"],
                  state["norm"])  # fmt: skip
    ref.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (21,), generator=gen)
    feats = torch.randn(21, streams * cfg["hidden_size"], generator=gen)
    pre, normed = prefill(head, ids, feats)
    feat = ref.fc(feats)[None]
    q, k, v = ref.qkv(target.model.embed_tokens(ids)[None], feat)
    g = ref.finish(feat, F.scaled_dot_product_attention(q, k, v, is_causal=True))[0]
    torch.testing.assert_close(pre, g, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(head.compute_logits(normed), ref.logits(g), atol=5e-4, rtol=5e-4)


def test_distillation_loss_gradient_is_the_autograd_one() -> None:
    """The training loss's hand-written gradient (KL + TV over row chunks, rows weighted)
    against autograd through the plain formula in float64."""
    tr = train_script()
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(600, 97, generator=gen).requires_grad_()
    log_p = torch.log_softmax(2 * torch.randn(600, 97, generator=gen), -1)
    w = torch.rand(600, generator=gen)
    w[:50] = 0.0
    w /= w.sum()
    loss, tv = tr.DistillLoss.apply(z, log_p.exp(), log_p, w)
    (3 * loss).backward()
    z64, lp, w64 = z.detach().double().requires_grad_(), log_p.double(), w.double()
    log_q = torch.log_softmax(z64, -1)
    tv_rows = 0.5 * (log_q.exp() - lp.exp()).abs().sum(-1)
    want = (w64 * ((lp.exp() * (lp - log_q)).sum(-1) + tv_rows)).sum()
    (3 * want).backward()
    assert abs(loss.item() - want.item()) < 1e-5 and abs(tv.item() - (w64 * tv_rows).sum()) < 1e-5
    torch.testing.assert_close(z.grad, z64.grad.float(), rtol=1e-4, atol=1e-7)


def eagle3_reference(w: dict, cfg: dict, ids, feats, embed, vocab: int) -> torch.Tensor:
    """EAGLE-3's head written out from its published design, over one whole sequence."""

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * weight

    tr = train_script()
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    t = len(ids)
    hid = feats @ w["fc.weight"].T
    x = torch.cat([norm(embed(ids), w["midlayer.input_layernorm.weight"]),
                   norm(hid, w["midlayer.hidden_norm.weight"])], dim=-1)  # fmt: skip
    cos, sin = tr.rope_tables(d, t, 10000.0)
    q = tr.rotate(
        (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d).transpose(0, 1), cos, sin
    )
    k = tr.rotate(
        (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d).transpose(0, 1), cos, sin
    )
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    r = hid + a.transpose(0, 1).reshape(t, h) @ w["midlayer.self_attn.o_proj.weight"].T
    n = norm(r, w["midlayer.post_attention_layernorm.weight"])
    mlp = F.silu(n @ w["midlayer.mlp.gate_proj.weight"].T) * (
        n @ w["midlayer.mlp.up_proj.weight"].T
    )
    pre = r + mlp @ w["midlayer.mlp.down_proj.weight"].T
    small = norm(pre, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((t, vocab), float("-inf"))
    full[:, torch.arange(small.shape[1]) + w["d2t"]] = small
    return full


def test_eagle3_head_matches_the_published_design(make_checkpoint, tmp_path) -> None:
    target_dir = make_checkpoint("llama", num_layers=6, seed=4)
    head_dir = make_eagle_head(tmp_path / "e3", target_dir, "eagle3", seed=3, draft_vocab_size=192)
    assert detect_layout(head_dir) == "eagle3"
    target = load_model(target_dir, torch.float32, "cpu")
    head = load_eagle_head(head_dir, TargetParts.of(target), TorchAttentionBackend(),
                           torch.float32, "cpu")  # fmt: skip
    assert head.streams == (2, 3, 3)  # layers 2, 6 // 2 and 6 - 3 of a 6-layer target
    from safetensors.torch import load_file

    w = {k: v.float() if v.is_floating_point() else v for k, v in
         load_file(str(head_dir / "model.safetensors")).items()}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (13,), generator=gen)
    feats = torch.randn(13, 3 * 64, generator=gen)
    _, hidden = prefill(head, ids, feats)
    got = head.compute_logits(hidden)
    cfg = json.loads((head_dir / "config.json").read_text())
    want = eagle3_reference(w, cfg, ids, feats, target.model.embed_tokens, 256)
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and finite.sum() == 13 * 192
    torch.testing.assert_close(got[finite], want[finite], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eagle3_flat_pass_is_the_module_path_bit_for_bit(make_checkpoint, tmp_path, dtype):
    """The head's pass as flat kernel calls (Eagle3HeadPlan), and with its logits as one call,
    gives the module path's feature, logits and K/V, bit for bit, on a ragged batch with cached
    context."""
    from specbatch.kernels.cpu import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not kernels.supports_linear(dtype):
        pytest.skip("no CPU kernel matrix multiply in this dtype here")
    target_dir = make_checkpoint("llama", num_layers=6, seed=4)
    head_dir = make_eagle_head(tmp_path / "e3", target_dir, "eagle3", seed=3)
    target = load_model(target_dir, dtype, "cpu")
    head = load_eagle_head(head_dir, TargetParts.of(target), target.attention_backend, dtype,
                           "cpu")  # fmt: skip
    head.use_cpu_kernels(kernels)
    plan = head.cpu_plan
    assert plan is not None
    lens, ctx, bs = [5, 1, 2], [0, 9, 14], 4
    tables = [[0, 1], [2, 3, 4], [5, 6, 7, 8]]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (sum(lens),), generator=gen)
    feats = torch.randn(sum(lens), 3 * 64, generator=gen).to(dtype)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(lens, ctx, strict=True)])
    results = []
    for mode in ("one call", "plan", "modules"):  # the pass and its logits in one kernel call
        head.cpu_plan = None if mode == "modules" else plan
        k, v = head.allocate_kv_caches(9, bs, "cpu")[0]
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(2)))
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(3)))
        meta = AttentionMetadata.from_lists(lens, [q + c for q, c in zip(lens, ctx)], tables, bs)
        if mode == "one call":
            pre, logits = head.forward_logits(ids, head.from_target(feats), positions, (k, v), meta)
        else:
            pre, normed = head(ids, head.from_target(feats), positions, (k, v), meta)
            logits = head.compute_logits(normed)
        results.append((pre, logits, k, v))
    for one, two, three in zip(*results, strict=True):
        assert torch.equal(one, two) and torch.equal(two, three)


def test_bad_heads_are_named(make_checkpoint, tmp_path) -> None:
    target = str(make_checkpoint("llama", seed=4))
    e1 = make_eagle_head(tmp_path / "e1", target, "eagle", seed=1)
    with pytest.raises(InvalidInputError, match=r"holds an EAGLE head; use method 'eagle'"):
        LLM(target, speculative_config={"method": "eagle3", "model": str(e1)})
    with pytest.raises(InvalidInputError, match="is not an EAGLE head"):
        LLM(target, speculative_config={"method": "eagle", "model": target})
    from safetensors.torch import load_file, save_file

    weights = load_file(str(e1 / "model.safetensors"))
    del weights["layers.0.mlp.down_proj.weight"]
    save_file(weights, str(e1 / "model.safetensors"))
    with pytest.raises(InvalidInputError, match=r"lacks mlp\.down_proj\.weight"):
        LLM(target, speculative_config={"method": "eagle", "model": str(e1)})


# --- through the engine -------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def eagle_llm(target, head, method: str = "eagle", k: int | str = 3, **kw) -> LLM:
    args = dict(block_size=4, num_kv_blocks=512, max_model_len=128, max_num_seqs=256)
    args.update(kw)
    config = {"method": method, "model": str(head), "num_speculative_tokens": k}
    return LLM(str(target), speculative_config=config, **args)


def greedy_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42], list(range(60, 95))]


def test_greedy_with_the_trained_head_equals_transformers(trained) -> None:
    target, head = trained
    llm = eagle_llm(target, head, "eagle3")
    assert greedy_ids(llm, PROMPTS) == hf_greedy(target, PROMPTS, 24)
    spec = llm.engine.metrics.spec
    assert spec.proposed > 0 and spec.accepted > 0


def test_greedy_with_an_eagle3_head_equals_transformers(make_checkpoint, tmp_path) -> None:
    target = make_checkpoint("llama", num_layers=6, seed=4)
    head = make_eagle_head(tmp_path / "e3", target, "eagle3", seed=3, draft_vocab_size=192)
    llm = eagle_llm(target, head, "eagle3", k=2)
    assert greedy_ids(llm, PROMPTS) == hf_greedy(target, PROMPTS, 24)
    assert llm.engine.metrics.spec.proposed > 0


def test_preemption_rebuilds_the_heads_cache(trained) -> None:
    """A pool so small that requests are preempted (recompute) again and again: the head's
    cache is rebuilt from the target's features and the greedy output does not change."""
    target, head = trained
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    small = eagle_llm(target, head, "eagle3", num_kv_blocks=16, max_model_len=48)
    got = greedy_ids(small, prompts)
    assert small.engine.metrics.num_preemptions > 0
    assert got == hf_greedy(target, prompts, 24)
    assert small.engine.metrics.spec.accepted > 0


N = 6000
ALPHA = 1e-3  # false-alarm rate


@pytest.mark.parametrize("layout", ["eagle", "eagle3"])
def test_joint_of_first_three_tokens_is_the_targets(make_checkpoint, tmp_path, layout) -> None:
    target = make_checkpoint("llama", vocab_size=32, hidden_size=32, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, seed=3, max_position_embeddings=64)  # fmt: skip
    head = make_eagle_head(tmp_path / "h", target, layout, seed=5, with_embedding=True)
    llm = eagle_llm(target, head, layout, k=3, seed=2, max_model_len=64)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    prompt = [3, 4, 5, 6]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    spec = llm.engine.metrics.spec
    assert spec.proposed > N and 0.05 < spec.acceptance_rate < 0.98
    samples = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    exact = exact_joint(target, prompt, 3)
    keys = sorted(set(exact) | set(samples))
    res = chi_square_gof([samples.get(k, 0) for k in keys], [exact.get(k, 0.0) for k in keys])
    assert res.p_value >= ALPHA, f"chi-square {res.statistic:.1f} on {res.dof} dof"


def test_auto_with_the_trained_head_equals_transformers(trained) -> None:
    target, head = trained
    llm = eagle_llm(target, head, "eagle3", k="auto")
    assert greedy_ids(llm, PROMPTS) == hf_greedy(target, PROMPTS, 24)
    assert llm.engine.metrics.spec.proposed > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_whole_round_in_one_call_drafts_what_pass_by_pass_does(
    make_checkpoint, tmp_path, monkeypatch, dtype
) -> None:
    """The EAGLE-3 head's drafting call two ways: the catch-up pass, the roots and the chains
    in one kernel call (csrc/draft_round.c), and pass by pass in Python. On batches sampled at
    temperature 1, greedily, and both mixed, with chains cut short by max_tokens beside full
    ones (so that some requests draft while others do not), the same outputs and the same
    drafts accepted (a draft whose K/V went astray, or whose q differed, would change what is
    accepted)."""
    from specbatch.kernels.cpu import cpu_kernels
    from specbatch.worker.eagle_proposer import EagleProposer

    kernels = cpu_kernels()
    if kernels is None or not kernels.supports_linear(getattr(torch, dtype)):
        pytest.skip("no CPU kernel matrix multiply in this dtype here")
    target = make_checkpoint("llama", num_layers=4, seed=4)
    head = make_eagle_head(tmp_path / "e3", target, "eagle3", seed=3)
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(6)]
    whole_round, rounds = EagleProposer._round, []

    def counted(self, *args):
        rounds.append(1)
        return whole_round(self, *args)

    monkeypatch.setattr(EagleProposer, "_round", counted)
    runs = {}
    for mode in ("one call", "pass by pass"):
        if mode == "pass by pass":
            monkeypatch.setattr(EagleProposer, "_embedding", None)
        rounds.clear()
        llm = eagle_llm(target, head, "eagle3", k=4, dtype=dtype)
        got = []
        for temperatures in ([1.0], [0.0], [0.0, 1.0]):
            params = [SamplingParams(temperature=temperatures[i % len(temperatures)],
                                     max_tokens=9 + 5 * (i % 3), seed=i, ignore_eos=True)
                      for i in range(len(prompts))]  # fmt: skip
            outs = llm.generate(prompts, params, use_tqdm=False)
            got.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.num_free_kv_blocks == llm.engine.num_kv_blocks
        assert bool(rounds) == (mode == "one call")
        spec = llm.engine.metrics.spec
        runs[mode] = (got, spec.proposed, spec.accepted)
    assert runs["one call"] == runs["pass by pass"]
    assert runs["one call"][2] > 0


class NoDrafts:
    """A policy that never wants drafts."""

    shape = DraftShape.chain(3)

    def draft_shapes(self, requests, prompt_rows=0, plain=0):
        return [DraftShape()] * len(requests)

    def observe(self, plan, result, seconds):
        pass


def test_a_sleeping_head_keeps_no_features_and_the_output_is_the_targets(
    make_checkpoint, tmp_path
) -> None:
    """While the policy wants no drafts the head lags, keeping the target's features of what it
    has yet to read; once the drafter sleeps it keeps none, and the greedy output is still the
    target's."""
    target = make_checkpoint("llama", num_layers=2, seed=4)
    head = make_eagle_head(tmp_path / "e3", target, "eagle3", seed=3)
    engine = eagle_llm(target, head, "eagle3", k="auto").engine
    engine.scheduler.policy = NoDrafts()
    tokens = SLEEP_AFTER + 20
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in PROMPTS]
    drafter = engine.executor.worker.drafter
    got: dict[str, list[int]] = {}
    kept = []
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        kept.append(len(drafter.pending))
    assert kept[SLEEP_AFTER - 1] == len(PROMPTS) and kept[SLEEP_AFTER + 1] == 0
    assert [got[i] for i in ids] == hf_greedy(target, PROMPTS, tokens)
    assert engine.num_free_kv_blocks == engine.num_kv_blocks
