"""Issue 28, the torch backend (``kvpolicy_torch``) and ``kvpolicy.hf.generate``: LayerCache checks
what it is given (``kvpolicy_torch.checks``) before it allocates or writes, refuses what a policy
returns when it breaks the contract, and ``generate`` blames the argument at fault."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpolicy import H2O, FullCache, LocalWindow, PolicyError, StreamingLLM  # noqa: E402
from kvpolicy_torch import LayerCache  # noqa: E402
from kvpolicy_torch.checks import check_capacity, check_kv, check_memory, check_query  # noqa: E402
from misbehaving import CORRUPTIONS, Corrupting  # noqa: E402


def kv(heads: int = 2, q: int = 1, d: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(1, heads, q, d, dtype=dtype)


def drive(layer: LayerCache, steps: int, heads: int = 2) -> None:
    for _ in range(steps):
        keys, _ = layer.append(kv(heads), kv(heads))
        layer.accumulate(torch.ones(1, heads, keys.shape[2]))
        layer.evict()


# ---------------------------------------------------------------------------- what select() returns
@pytest.mark.parametrize("how", sorted(set(CORRUPTIONS) - {"over_capacity"}))  # (that one meets the layer's own storage check)
def test_layer_cache_refuses_a_bad_keep_naming_the_policy(how: str) -> None:
    policy = Corrupting(how)
    with pytest.raises(PolicyError) as exc:
        drive(LayerCache(policy), 12)
    assert repr(policy) in str(exc.value), str(exc.value)


def test_layer_cache_refuses_duplicate_slots() -> None:
    """Duplicates used to be kept twice (the same token in two slots) without a word."""
    with pytest.raises(PolicyError, match="appears twice"):
        drive(LayerCache(Corrupting("duplicate")), 8)


class DuplicatingH2O(H2O):
    """H2O whose every eviction keeps its first kept slot twice."""

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        keep = super().select(view)
        if keep is None:
            return None
        keep = view.xp.asarray(keep, copy=True)
        keep[..., 1] = keep[..., 0]
        return keep


def test_a_subclass_of_a_builtin_is_checked_at_decode_steps() -> None:
    """Built-ins skip the host read at torch decode steps (no sync: the kit holds them to the
    contract); a subclass that redefines select is not one of them."""
    from kvpolicy.registry import is_builtin_policy

    policy = DuplicatingH2O(heavy=2, recent=2)
    assert is_builtin_policy(H2O(heavy=2, recent=2)) and not is_builtin_policy(policy)
    with pytest.raises(PolicyError, match=r"DuplicatingH2O\(heavy=2, recent=2\).*appears twice"):
        drive(LayerCache(policy), 8)


def test_a_prompt_chunk_is_checked_too() -> None:
    layer = LayerCache(Corrupting("unsorted"))
    keys, _ = layer.append(kv(q=9), kv(q=9))
    layer.accumulate(torch.ones(1, 2, keys.shape[2]))
    with pytest.raises(PolicyError, match="not in ascending order"):
        layer.evict()


# ---------------------------------------------------------------------------- LayerCache's inputs
def test_keys_and_values_of_different_dtypes() -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    with pytest.raises(ValueError, match=r"keys and values must share a dtype, got torch.float32 keys and torch.float16 values"):
        layer.append(kv(), kv(dtype=torch.float16))
    assert not layer.is_initialized  # refused before anything was allocated


def test_integer_keys() -> None:
    with pytest.raises(TypeError, match="keys must be floating point"):
        LayerCache(H2O(heavy=2, recent=2)).append(torch.zeros(1, 2, 1, 4, dtype=torch.int64), kv())


def test_query_heads_not_a_multiple_of_kv_heads() -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    layer.append(kv(heads=2), kv(heads=2))
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of the cache's KV heads \(2\)"):
        layer.attend(torch.zeros(1, 3, 1, 4), 0.5)


def test_query_dtype_differs_from_the_keys() -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    layer.append(kv(), kv())
    with pytest.raises(ValueError, match=r"query dtype torch.float64 differs from the cache's keys' \(torch.float32\)"):
        layer.attend(torch.zeros(1, 2, 1, 4, dtype=torch.float64), 0.5)


def test_accumulate_of_something_that_is_not_a_tensor() -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    layer.append(kv(q=3), kv(q=3))
    with pytest.raises(TypeError, match="received must be a torch.Tensor.*got list"):
        layer.accumulate([[[0.1, 0.2, 0.3]] * 2])


@pytest.mark.parametrize("index", [[3], [-1], [0, 1]])
def test_select_batch_of_rows_it_does_not_hold_leaves_the_layer_as_it_was(index) -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    drive(layer, 6)
    before = layer.positions.clone()
    with pytest.raises(ValueError, match=r"index holds row -?\d+, outside the 1 rows held"):
        layer.select_batch(torch.tensor(index))
    assert torch.equal(layer.positions, before)
    drive(layer, 3)  # still usable


@pytest.mark.parametrize("index, error, match", [
    (torch.tensor([], dtype=torch.long), ValueError, "at least one row"),
    (torch.tensor([True, False]), TypeError, "1-D integer tensor of rows"),  # a mask is not row indices
])
def test_select_batch_of_no_rows_or_a_mask_is_named(index, error, match) -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    drive(layer, 6)
    before = layer.positions.clone()
    with pytest.raises(error, match=match):
        layer.select_batch(index)
    assert torch.equal(layer.positions, before)


def test_a_prompt_of_pads_only_reads_as_no_tokens() -> None:
    """A chunk whose every token is a pad (every row) keeps nothing: reads give empty tensors (a
    view of no slots was refused by a reshape), and the next decode step is the first token."""
    layer = LayerCache(H2O(heavy=2, recent=2))
    K, _ = layer.append(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), valid=torch.zeros(1, 3, dtype=torch.bool))
    layer.accumulate(torch.ones(1, 1, K.shape[2]))
    layer.evict()
    assert layer.lengths == [0] and layer.positions.shape == (1, 1, 0) and layer.keys.shape == (1, 1, 0, 4)
    layer.append(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    layer.attend(torch.randn(1, 1, 1, 4), 0.5)
    layer.evict()
    assert layer.positions.tolist() == [[[0]]]


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_static_shapes_must_be_a_bool(flag) -> None:
    with pytest.raises(ValueError, match="static_shapes must be True or False"):
        LayerCache(H2O(heavy=2, recent=2), static_shapes=flag)


def test_query_head_size_differs_from_the_keys() -> None:
    layer = LayerCache(H2O(heavy=2, recent=2))
    layer.append(kv(d=4), kv(d=4))
    with pytest.raises(ValueError, match=r"query head size \(8\) differs from the keys' \(4\)"):
        layer.attend(torch.zeros(1, 4, 1, 8), 0.5)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(kv_heads=st.integers(1, 4), q_heads=st.integers(1, 12), kd=st.integers(1, 6), qd=st.integers(1, 6))
def test_check_query_accepts_exactly_gqa_shaped_queries(kv_heads, q_heads, kd, qd) -> None:
    """Property: a query passes iff its heads are a multiple of the KV heads and its head size is
    the keys'; otherwise the error names the mismatch."""
    query, keys = torch.zeros(1, q_heads, 1, qd), torch.zeros(1, kv_heads, 5, kd)
    if q_heads % kv_heads == 0 and qd == kd:
        check_query(query, keys)
    else:
        with pytest.raises(ValueError, match="query head"):
            check_query(query, keys)


class OddCapacity(StreamingLLM):
    """StreamingLLM declaring a capacity no cache can have."""

    bad = 0

    @property
    def capacity(self):  # type: ignore[override]
        return self.bad

    decode_eviction = size_rule = None  # its own select: no inherited rule

    def select(self, view):
        return super().select(view)


@pytest.mark.parametrize("bad", [0, 4.5, -1, True])
def test_a_policy_whose_capacity_is_not_a_positive_integer(bad) -> None:
    policy = OddCapacity(sink=1, window=2)
    policy.bad = bad
    with pytest.raises(ValueError, match=r"capacity must be None \(unbounded\) or an integer >= 1"):
        LayerCache(policy)
    with pytest.raises(ValueError, match="capacity"):
        check_capacity(policy)


def test_an_allocation_that_cannot_fit_fails_before_allocating() -> None:
    """LocalWindow(window=10**9) asked the allocator for ~128 GB and failed with its message."""
    layer = LayerCache(LocalWindow(window=10**9))
    with pytest.raises(ValueError, match=r"LocalWindow\(window=1000000000\) needs [\d,.]+ GiB for its capacity of 1000000001 tokens"):
        layer.append(torch.zeros(1, 8, 1, 64), torch.zeros(1, 8, 1, 64))
    assert not layer.is_initialized


@pytest.mark.parametrize("reserve", [-1, 2.5, "64"])
def test_a_bad_reserve_is_named(reserve) -> None:
    with pytest.raises(ValueError, match="reserve must be"):
        LayerCache(FullCache(), reserve=reserve).append(kv(), kv())


def test_an_unbounded_reserve_that_cannot_fit() -> None:
    with pytest.raises(ValueError, match=r"FullCache\(\) needs [\d,.]+ GiB for its reserve of 1000000000000 tokens"):
        LayerCache(FullCache(), reserve=10**12).append(kv(), kv())


def test_check_memory_passes_what_fits() -> None:
    check_memory(H2O(heavy=8, recent=8), 17, kv(), kv())
    check_kv(kv(), kv())


# ---------------------------------------------------------------------------- kvpolicy.hf.generate
class Tok:
    """A stand-in tokenizer: one id per character (the empty text has none)."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text, return_tensors=None):
        return {"input_ids": torch.tensor([[1 + ord(c) % 100 for c in text]], dtype=torch.int64).reshape(1, -1)}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers")
    from kvpolicy_tools.models import tiny_llama

    return tiny_llama(num_layers=1, heads=4, kv_heads=2, head_dim=8, vocab=128)


def test_generate_blames_max_new_tokens(tiny) -> None:
    from kvpolicy.hf import generate

    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1, got 0"):
        generate(tiny, Tok(), "hello there", "h2o", budget=0.5, max_new_tokens=0)
    res = generate(tiny, Tok(), "hello world " * 3, "h2o", budget=0.5, max_new_tokens=3)  # 3 is fine
    assert len(res.token_ids) == 3


@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_says_the_prompt_is_empty(tiny, prompt) -> None:
    from kvpolicy.hf import generate

    with pytest.raises(ValueError, match="prompt is empty"):
        generate(tiny, Tok(), prompt, "h2o", budget=0.5, max_new_tokens=4)


def test_generate_says_a_prompt_that_tokenizes_to_nothing_is_empty(tiny) -> None:
    from kvpolicy.hf import generate

    class Nothing(Tok):
        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.zeros(1, 0, dtype=torch.int64)}

    with pytest.raises(ValueError, match="empty after tokenization"):
        generate(tiny, Nothing(), "hello", "h2o", budget=0.5, max_new_tokens=4)


# A decode step shaped as the last one, into the same storage, skips append's and attend's check
# functions (one tuple comparison: benchmarks/decode_calls.py). Whatever differs from it is checked.
BAD_STEPS = {
    "head_dim changed": lambda: (kv(d=8), kv(d=8)),
    "dtype changed": lambda: (kv(dtype=torch.float64), kv(dtype=torch.float64)),
    "batch and kv_heads changed": lambda: (kv(heads=1), kv(heads=1)),
    "equal first three dims": lambda: (kv(), kv(q=2)),
    "at least one token": lambda: (kv(q=0), kv(q=0)),
}


@pytest.mark.parametrize("message", sorted(BAD_STEPS))
@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_step_unlike_the_last_one_is_still_checked(message: str, static_shapes: bool) -> None:
    layer = LayerCache(H2O(heavy=2, recent=2), static_shapes=static_shapes)
    layer.append(kv(q=6), kv(q=6))
    layer.accumulate(torch.ones(1, 2, 6))
    layer.evict()
    for _ in range(3):  # decode steps that passed: the fast comparison is armed
        layer.append(kv(), kv())
        layer.attend(torch.zeros(1, 4, 1, 4), 0.5)
        layer.evict()
    keys, values = BAD_STEPS[message]()
    with pytest.raises(ValueError, match=message):
        layer.append(keys, values)
    layer.append(kv(), kv())  # (the refused step wrote nothing: a good one still goes)
    for query, refused in [(torch.zeros(1, 3, 1, 4), "must be a multiple"), (torch.zeros(1, 4, 1, 4, dtype=torch.float64), "differs"),
                           (torch.zeros(2, 4, 1, 4), "batch")]:
        with pytest.raises(ValueError, match=refused):
            layer.attend(query, 0.5)
    layer.attend(torch.zeros(1, 4, 1, 4), 0.5)
    layer.evict()
