"""kvpolicy/policies/kvzip.py, KVzip (context-reconstruction scores): given the reconstruction's
scores, the NumPy reference keeps each head's sinks and best-scored tokens (uniform), AdaKV over it
with no floor keeps the layer's best (kvzip_headwise), prefill_only compresses to kvpress's ratio,
the torch LayerCache keeps exactly what the reference keeps, and what cannot be served is refused
by name (no scores, a decode step before the reconstruction, a second reconstruction). The
statistic itself: tests/core/test_statistics.py; the transformers pass:
tests/integrations/test_reconstruction.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpolicy_numpy
from kvpolicy import H2O, AdaKV, KVzip, get_policy, make_policy, prefill_only

torch = pytest.importorskip("torch")

import kvpolicy_torch  # noqa: E402


def _scores(seed: int, heads: int, n: int, ties: bool) -> np.ndarray:
    """Reconstruction scores (probabilities in [0, 1]); with ``ties``, few distinct values."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4, size=(heads, n)) / 4 if ties else rng.random((heads, n))


def _best(scores: np.ndarray, size: int, sink: int) -> list[list[int]]:
    """Brute force: per head, the first ``sink`` positions and the ``size - sink`` highest scores of
    the rest, a tie to the later position."""
    out = []
    for row in scores:
        rest = sorted(range(sink, len(row)), key=lambda j: (row[j], j), reverse=True)[: size - sink]
        out.append(sorted(list(range(min(sink, len(row)))) + rest))
    return out


@given(st.integers(0, 2**32 - 1), st.integers(2, 24), st.integers(1, 24), st.integers(0, 4), st.booleans())
@settings(max_examples=80, deadline=None)
def test_each_head_keeps_its_sinks_and_best_reconstruction_scores(seed, n, size, sink, ties) -> None:
    """After the prompt each head keeps its first ``sink`` positions and its ``size - sink`` highest
    reconstruction scores (ties: the later position), whatever the prompt's attention; later tokens
    are all kept. The attention logits never matter (no attention is captured)."""
    if sink >= size:
        return
    heads, steps = 3, n + 3
    rec = _scores(seed, heads, n, ties)
    logits = np.random.default_rng(seed + 1).normal(size=(steps, heads, steps))
    trace = kvpolicy_numpy.replay(KVzip(size=size, sink=sink), logits, n, reconstruction=rec)
    expected = _best(rec, size, sink) if size < n else [list(range(n))] * heads
    assert trace.kept[n - 1].tolist() == expected
    assert trace.kept[steps - 1].tolist() == [row + list(range(n, steps)) for row in expected]
    other = kvpolicy_numpy.replay(KVzip(size=size, sink=sink), np.zeros((steps, heads, steps)), n, reconstruction=rec)
    assert other.kept[steps - 1].tolist() == trace.kept[steps - 1].tolist()


@given(st.integers(0, 2**32 - 1), st.integers(4, 30), st.sampled_from([0.25, 0.5, 0.75, 0.875]), st.booleans())
@settings(max_examples=60, deadline=None)
def test_headwise_budgets_keep_the_layers_best_scores(seed, n, ratio, ties) -> None:
    """kvzip_headwise under kvpress's protocol: the layer keeps ``heads x k`` tokens, k = int(n (1 - r)),
    the sinks of every head and then the highest scores over all heads at once (no floor per head;
    a full tie: the later position, then the higher head stays), however the prompt was chunked."""
    heads, sink = 3, 2
    k = max(1, int(n * (1 - ratio)))
    if k <= sink:
        return
    rec = _scores(seed, heads, n, ties)
    p = prefill_only(AdaKV(KVzip(size=k, sink=sink), alpha_safeguard=0.0), ratio)
    logits = np.zeros((n + 2, heads, n + 2))
    kept = kvpolicy_numpy.replay(p, logits, n, reconstruction=rec).kept[n - 1]
    chunked = kvpolicy_numpy.replay(p, logits, n, reconstruction=rec, prompt_chunk=3).kept[n - 1]
    assert kept.tolist() == chunked.tolist()
    rest = sorted(((rec[h, j], j, h) for h in range(heads) for j in range(sink, n)), reverse=True)
    chosen = {(h, j) for h in range(heads) for j in range(sink)} | {(h, j) for _, j, h in rest[: heads * k - heads * sink]}
    got = {(h, int(j)) for h in range(heads) for j in kept[h] if j >= 0}
    assert got == chosen


@given(st.integers(0, 2**32 - 1), st.integers(3, 20), st.integers(1, 3), st.booleans(),
       st.sampled_from(["uniform", "headwise", "prefill_only", "shared"]))
@settings(max_examples=50, deadline=None)
def test_torch_layer_keeps_what_the_reference_keeps(seed, n, batch, ties, kind) -> None:
    """kvpolicy_torch.LayerCache.evict_reconstructed on the same scores keeps exactly the reference's
    tokens (every row of a batch on its own scores), and then keeps every decode token."""
    heads, size = 2, max(2, n // 2)
    policy = {
        "uniform": KVzip(size=size, sink=1),
        "headwise": AdaKV(KVzip(size=size, sink=1), alpha_safeguard=0.0),
        "prefill_only": prefill_only(KVzip(size=2, sink=1), 0.5),
        "shared": KVzip(size=size, sink=1, selection="shared"),
    }[kind]
    rec = np.stack([_scores(seed + r, heads, n, ties) for r in range(batch)])
    layer = kvpolicy_torch.LayerCache(policy)
    layer.append(torch.randn(batch, heads, n, 4), torch.randn(batch, heads, n, 4))
    assert layer.evict() == [] and layer.lengths == [n] * batch  # nothing before the reconstruction
    layer.evict_reconstructed(torch.tensor(rec))
    layer.append(torch.randn(batch, heads, 1, 4), torch.randn(batch, heads, 1, 4))
    layer.attend(torch.randn(batch, heads, 1, 4), 0.5)
    layer.evict()
    for r in range(batch):
        trace = kvpolicy_numpy.replay(policy, np.zeros((n + 1, heads, n + 1)), n, reconstruction=rec[r])
        expected = trace.kept[n]
        got = layer.positions[r].numpy()
        width = max(int((expected >= 0).sum(-1).max()), 1)
        assert np.sort(got, axis=-1)[:, -width:].tolist() == expected[:, -width:].tolist()


def test_what_cannot_be_served_is_refused_by_name() -> None:
    """No reconstruction scores, a one-token prompt, a decode step before the reconstruction, or a
    second reconstruction: each a ValueError saying what is missing."""
    logits = np.zeros((6, 1, 6))
    with pytest.raises(ValueError, match="reconstruction is required"):
        kvpolicy_numpy.replay(KVzip(size=2, sink=1), logits, 4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        kvpolicy_numpy.replay(KVzip(size=2, sink=1), logits, 1, reconstruction=np.zeros((1, 1)))
    with pytest.raises(ValueError, match=r"shape \[heads, prompt_len\] = \[1, 4\]"):
        kvpolicy_numpy.replay(KVzip(size=2, sink=1), logits, 4, reconstruction=np.zeros((1, 5)))
    layer = kvpolicy_torch.LayerCache(KVzip(size=2, sink=1))
    layer.append(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
    layer.evict()
    layer.append(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    with pytest.raises(ValueError, match="context reconstruction, which has not run"):
        layer.evict()
    layer = kvpolicy_torch.LayerCache(KVzip(size=2, sink=1))
    layer.append(torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2))
    layer.evict_reconstructed(torch.rand(1, 1, 4))
    with pytest.raises(ValueError, match="already scored"):
        layer.evict_reconstructed(torch.rand(1, 1, 2))
    with pytest.raises(ValueError, match="is not"):
        kvpolicy_torch.LayerCache(H2O(heavy=2, recent=2)).evict_reconstructed(torch.rand(1, 1, 4))


def test_a_composition_that_would_rank_it_by_another_score_is_refused() -> None:
    """compose(prefill=KVzip, decode=H2O) would make the backends capture H2O's attention sums, which
    KVzip would then rank instead of its reconstruction's scores: refused by name (issue 41 item 1's
    rule); with a decode policy that reads no scores the composition ranks by the reconstruction."""
    from kvpolicy import StreamingLLM, compose

    with pytest.raises(ValueError, match="context reconstruction's scores"):
        compose(prefill=KVzip(size=8), decode=H2O(heavy=4, recent=4))
    with pytest.raises(ValueError, match="context reconstruction's scores"):
        compose(prefill=H2O(heavy=4, recent=4), decode=KVzip(size=8))
    assert compose(prefill=KVzip(size=8), decode=StreamingLLM(sink=4, window=12)).needs_reconstruction


def test_registered_and_planned_like_the_prefill_policies() -> None:
    """kvzip and kvzip_headwise plan from a budget (as SnapKV: the tokens kept after the prompt) and
    from kvpress's ratio (prefill_only); the paper's defaults: 4 sinks, head-wise without a floor."""
    p = make_policy("kvzip", 0.5, context_length=300, prompt_length=256)
    assert isinstance(p, KVzip) and p.sink == 4 and p.capacity is None
    h = make_policy("kvzip_headwise", 0.5, context_length=300, prompt_length=256)
    assert isinstance(h, AdaKV) and h.alpha_safeguard == 0.0 and isinstance(h.scorer, KVzip)
    assert get_policy("kvzip") is KVzip
    assert KVzip.from_size(3) == KVzip(size=3, sink=2)
    with pytest.raises(ValueError, match="size"):
        KVzip(size=4, sink=4)
