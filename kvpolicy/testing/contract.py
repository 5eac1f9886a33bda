"""The eviction-policy contract as hypothesis properties: :func:`check_policy`.

The properties (:data:`PROPERTIES`), each run on many drawn examples (see :mod:`kvpolicy.testing.profiles`):

``replay``
    On :func:`kvpolicy_numpy.replay` (the reference backend): the cache never holds more than
    ``capacity`` tokens during a decode step's attention and at most ``capacity - 1`` after an
    eviction (prefill included); kept positions are sorted, unique, in ``[0, t]`` and never come
    back once evicted; ``selection="shared"`` keeps the same tokens on every head; the same input
    gives the same trace (no state kept on the policy object); the sizes do not depend on the
    scores (equal to :func:`kvpolicy.simulate_sizes`); the policy's own invariants hold after
    every step; a composition (:class:`~kvpolicy.Composed`) keeps after the prompt only tokens
    its prefill policy keeps alone on the same input (:func:`check_prefill_decision`).
``sizes``
    *Whether* to evict and *how many* to keep are host decisions, so the sizes can be checked
    exhaustively on placeholder scores, cheaply: every prompt length up to ``max_prompt``
    (followed by a decode step) and one long decode run of ``long_steps`` tokens, for the drawn
    batch and head counts. This finds capacity bugs that only one input in thousands triggers
    (a prompt of one exact length, a rare ``n_seen``), and long-context bugs short replays miss.
``full_cache``
    While the sequence fits in ``capacity`` the policy behaves exactly like
    :class:`~kvpolicy.FullCache` (it may evict only once the cache reaches ``capacity``).
``backends``
    Batched (left-padded rows of different lengths), GQA-grouped inputs, driven on NumPy and on
    :class:`kvpolicy_torch.LayerCache` in lockstep with bit-equal scores: the kept positions
    agree on every step of every example (when torch is installed); each row of a batch equals
    that row run alone; every ``select`` result is ``[batch, heads, k]`` integer slots, strictly
    ascending, in range, evicting at least one token (a head-wise policy, ``ragged_heads``, may
    start a row with holes, ``-1``; its caches are compared without holes common to every head); *whether* to evict, *how many* to keep
    and the state update do not depend on the score values (the policy is probed with other
    scores); capacity and invariants as above.
``stateful``
    A hypothesis ``RuleBasedStateMachine`` (:mod:`kvpolicy.testing.stateful`) appends tokens,
    prefills chunks, decodes and evicts in any order, checking everything after every step.
``ranking``, ``head_ties``
    A policy that ranks tokens (an AdaKV scorer) keeps with ``select`` what its ``ranking``
    evicts last; AdaKV (and a subclass) shares out a layer's budget, ties between heads included,
    as docs/policies.md says (:mod:`kvpolicy.testing.rankings`). Skipped for the policies they
    do not apply to.

Around every ``select()`` call the kit enforces ``settings.deadline`` (per call) and fails a
policy that keeps state on its object or class (:mod:`kvpolicy.testing.watch`).

A failure raises :class:`ContractViolation` whose message ends with Python code that replays the
shrunk example, e.g. ``kvpolicy_numpy.replay(EveryKth(k=2, window=1, limit=2), np.array([...]),
prompt_len=3)``.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from hypothesis import HealthCheck, given, settings as Settings, strategies as st
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Unsatisfiable

import kvpolicy_numpy
from kvpolicy.validation import check_bool, check_int
from kvpolicy.driver import PolicyError
from kvpolicy.policy import KEY_STATISTICS, RECONSTRUCTION, EvictionPolicy
from kvpolicy.registry import Preset, get_policy

from .. import Composed, FullCache
from ..budget import replay_sizes, simulate_sizes
from ..policies.adakv import AdaKV
from . import _format
from ._driver import ContractViolation, NumpyCache, check_positions, example_inputs, held_per_head, run_replay, sequence_rows, trim_holes
from ._util import torch_available
from .invariants import Invariant, policy_invariants, run_invariants
from .profiles import selected_settings
from .rankings import check_head_ties, check_ranking, ranking_lengths
from .watch import watched
from .stateful import run_machine
from .strategies import TIE_KINDS, LogitsSpec, gqa_shapes, last_refusal, logits_specs, padded_batches, policies, prompt_lengths

__all__ = [
    "PROPERTIES",
    "ContractReport",
    "ContractViolation",
    "check_policy",
    "check_prefill_decision",
    "check_replay",
    "check_sizes",
    "compare_backends",
    "refuse_reconstruction",
    "torch_available",
]

#: The properties :func:`check_policy` runs, in order.
PROPERTIES = ("replay", "sizes", "full_cache", "backends", "stateful", "ranking", "head_ties")


# ============================================================================ single examples
def _first(prompt_len: int) -> int:
    return max(prompt_len - 1, 0)


def _keys_arg(policy: EvictionPolicy, expr: str, logits: str) -> str:
    """The ``keys=`` (and for Expected Attention ``values=``, ``queries=``) arguments of a printed
    replay: the kit's inputs for a policy scoring keys (:func:`example_inputs`)."""
    if policy.score_statistic not in KEY_STATISTICS:
        return ""
    return f", **kvpolicy.testing.example_inputs({expr}, {logits})"


def _first_difference(one: Any, other: Any) -> tuple[int, Any, Any] | None:
    """``(t, kept, other's kept)`` (as lists) at the first step two traces keep differently, or ``None``."""
    for t, (a, b) in enumerate(zip(one.kept, other.kept)):
        if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
            return t, None if a is None else a.tolist(), None if b is None else b.tolist()
    return None


def check_replay(
    policy: EvictionPolicy,
    logits: np.ndarray,
    prompt_len: int = 0,
    *,
    invariants: Invariant | Sequence[Invariant] | None = None,
) -> Any:
    """Check the ``replay`` property on one example; returns the :class:`~kvpolicy_numpy.Trace`.

    Raises :class:`ContractViolation` describing the first broken rule.
    """
    logits = np.asarray(logits, dtype=np.float64)
    steps = logits.shape[0]
    invs = policy_invariants(policy, invariants)
    inputs = example_inputs(policy, logits)  # a policy scoring keys gets the kit's keys of this example
    try:
        trace = kvpolicy_numpy.replay(policy, logits, prompt_len, **inputs)
    except RuntimeError as e:  # the reference backend's own checks
        raise ContractViolation(f"kvpolicy_numpy.replay refused {policy!r}: {e}") from None
    cap = policy.capacity
    if cap is not None and len(trace.sizes) and trace.sizes.max() > cap:
        i = int(np.argmax(trace.sizes > cap))
        raise ContractViolation(
            f"{policy!r} let the cache hold {int(trace.sizes[i])} tokens during the attention of token "
            f"{prompt_len + i}, above its declared capacity {cap}"
        )
    previous: np.ndarray | None = None
    for t in range(_first(prompt_len), steps):
        kept = trace.kept[t]
        if kept is None:
            raise ContractViolation(f"replay kept nothing after token {t}")
        check_positions(policy, kept, t, "replay")
        if previous is not None:
            for h in range(kept.shape[0]):
                back = set(kept[h].tolist()) - set(previous[h].tolist()) - {t, -1}
                if back:
                    raise ContractViolation(f"evicted positions {sorted(back)} came back after token {t} (head {h})")
        try:
            run_invariants(invs, policy, kept, t)
        except AssertionError as e:
            raise ContractViolation(f"invariant broken: {e}") from None
        previous = kept
    again = kvpolicy_numpy.replay(policy, logits, prompt_len, **inputs)
    differs = _first_difference(trace, again)
    if differs is not None:
        t, a, b = differs
        raise ContractViolation(
            f"{policy!r} is not deterministic: a second replay of the same input kept {b} instead of {a} after "
            f"token {t} (keep per-sequence state in view.state, not on the policy object)"
        )
    if not policy.uses_scores:
        # a backend gives such a policy no scores (zeros: nothing is captured), so what it keeps must
        # not depend on them: the same example with the scores' order reversed keeps the same tokens
        differs = _first_difference(trace, kvpolicy_numpy.replay(policy, -logits, prompt_len, **inputs))
        if differs is not None:
            t, a, b = differs
            raise ContractViolation(
                f"{policy!r} declares uses_scores = False, but with the logits negated it kept {b} instead of {a} "
                f"after token {t}: backends capture no scores for it (they stay 0), so it would evict blind. "
                "Declare uses_scores = True"
            )
    check_prefill_decision(policy, logits, prompt_len)
    sim = simulate_sizes(policy, steps, prompt_len)
    if sim.tolist() != trace.sizes.tolist() and policy.size_rule() is not None:
        _check_size_rule(policy, trace, steps, prompt_len, sim)
    if sim.tolist() != trace.sizes.tolist():
        raise ContractViolation(
            f"{policy!r}: the cache sizes depend on the score values (replay: {trace.sizes.tolist()}, the same "
            f"policy on placeholder scores: {sim.tolist()}); decide *whether* and *how many* from host ints only"
        )
    return trace


def check_prefill_decision(policy: EvictionPolicy, logits: np.ndarray, prompt_len: int) -> None:
    """For a composition (:class:`~kvpolicy.Composed`; any other policy passes): right after a
    prompt its prefill policy cuts (longer than the decode policy's ``capacity - 1``), each head
    keeps only tokens the prefill policy keeps alone on the same input (the decode policy may
    then evict some of them, never bring others back): the prefill decision is ranked by the
    prefill policy's own score statistic. Skipped when the decode policy's log n scaling changes
    the prompt's attention itself. Raises :class:`ContractViolation`.

    Example:
        >>> import numpy as np
        >>> from kvpolicy import FullCache, Knorm, compose
        >>> check_prefill_decision(compose(prefill=Knorm(size=3), decode=FullCache()), np.zeros((8, 2, 8)), 6)
    """
    if not isinstance(policy, Composed) or prompt_len < 2 or policy.log_n != policy.prefill.log_n:
        return
    prefill, cap = policy.prefill, policy.decode.capacity
    if cap is not None and prompt_len <= cap - 1:
        return  # the prefill policy is not asked: the prompt fits the decode policy
    inputs = {**example_inputs(policy, logits), **example_inputs(prefill, logits)}  # (the same keys: seeded by the logits)
    mine = kvpolicy_numpy.replay(policy, logits, prompt_len, **inputs).kept[prompt_len - 1]
    alone = kvpolicy_numpy.replay(prefill, logits, prompt_len, **inputs).kept[prompt_len - 1]
    for h in range(mine.shape[0]):
        extra = sorted(set(mine[h].tolist()) - set(alone[h].tolist()) - {-1})
        if extra:
            raise ContractViolation(
                f"{policy!r} kept {mine[h].tolist()} on head {h} after a {prompt_len}-token prompt, but its prefill policy "
                f"{prefill!r} alone keeps {alone[h].tolist()}: positions {extra} were not its choice. The composition's "
                f"scores ({policy.score_statistic!r}) must be what the prefill policy ranks ({prefill.score_statistic!r}) "
                "when it decides"
            )


def _check_size_rule(policy: EvictionPolicy, trace: Any, steps: int, prompt_len: int, rule: np.ndarray) -> None:
    """The replay's sizes differ from the declared size rule's: when ``select`` on placeholder
    scores gives the replay's sizes, the rule is what is wrong, and the message says so."""
    selected = replay_sizes(policy, steps, prompt_len)
    if selected.tolist() == trace.sizes.tolist():
        i = int(np.argmax(rule != selected))
        raise ContractViolation(
            f"{policy!r}'s size_rule disagrees with its select: the rule says the decode step of token {prompt_len + i} "
            f"(after a {prompt_len}-token prompt) attends {int(rule[i])} tokens, but select left {int(selected[i])} "
            f"(sizes by the rule: {rule.tolist()}, by select: {selected.tolist()}, on any scores): plan_policy and "
            "simulate_sizes plan with the rule, so it must give select's sizes at every length (or declare none)"
        )


def check_sizes(
    policy: EvictionPolicy,
    *,
    batch: int = 1,
    heads: int = 1,
    max_prompt: int = 48,
    long_steps: int = 256,
    prompt_len: int = 0,
) -> None:
    """Check the ``sizes`` property: on placeholder (zero) scores, after a prefill of every length
    ``1..max_prompt`` (and one decode step after it), and at every step of a ``long_steps``-token
    decode run after a ``prompt_len`` prompt, the cache holds at most ``capacity - 1`` tokens once
    evicted and at most ``capacity`` during a decode step's attention; every ``select`` result is
    valid; a declared :meth:`~kvpolicy.EvictionPolicy.size_rule` gives the sizes ``select`` gave
    at each of those steps, and a declared :meth:`~kvpolicy.EvictionPolicy.decode_size_rule` at
    each decode step. Raises :class:`ContractViolation` with the replay that shows it."""
    cap = policy.capacity

    prompt = 0  # the prompt length of the run being checked (for the replay in the message)

    def violation(msg: str, cache: NumpyCache) -> ContractViolation:
        e = ContractViolation(msg)
        e.replay_args = (cache.n_seen, prompt)  # type: ignore[attr-defined]
        return e

    def stable(cache: NumpyCache, what: str) -> None:
        """Evict, then hold the cache to its capacity (the backends' own check included)."""
        try:
            cache.evict()
            length = cache.length
        except PolicyError as e:
            if e.n_cached is None:
                raise violation(str(e), cache) from None
            length = e.n_cached
        if cap is not None and length > cap - 1:
            raise violation(
                f"{policy!r} kept {length} tokens after {what} (token {cache.n_seen - 1}); its capacity is "
                f"{cap}, so at most {cap - 1} may remain after an eviction (the next token must fit)",
                cache,
            )

    decode_rule = policy.decode_size_rule()

    def decode(cache: NumpyCache) -> int:
        """One decode step; returns the tokens it attended. A declared decode size rule (what the
        torch backend skips asking ``select`` by) says the tokens ``select`` kept."""
        cache.append(1)
        attended = cache.length
        if cap is not None and attended > cap:
            raise violation(
                f"{policy!r} attended {attended} tokens at the decode step of token {cache.n_seen - 1}, above its "
                f"capacity {cap}",
                cache,
            )
        said = None if decode_rule is None else decode_rule(attended, dict(cache.state))
        stable(cache, f"the decode step of token {cache.n_seen - 1}")
        if said is not None and said != cache.length:
            raise violation(
                f"{policy!r}'s decode_size_rule says the decode step of token {cache.n_seen - 1} keeps {said} of its "
                f"{attended} tokens, but its select left {cache.length}: the torch backend skips asking select at a "
                "decode step where the rule keeps every token, so it must give select's sizes (or declare none)",
                cache,
            )
        return attended

    declared = policy.size_rule() is not None

    def follows_rule(attended: list[int], cache: NumpyCache) -> None:
        """A declared size rule (what budget planning simulates) says the sizes ``select`` gave."""
        if not declared:
            return
        rule = simulate_sizes(policy, prompt + len(attended), prompt).tolist()
        for i, (said, kept) in enumerate(zip(rule, attended)):
            if said != kept:
                raise violation(
                    f"{policy!r}'s size_rule says the decode step of token {prompt + i} (after a {prompt}-token prompt) "
                    f"attends {said} tokens, but its select left {kept}: plan_policy and simulate_sizes plan with the "
                    "rule, so it must give select's sizes at every length",
                    cache,
                )

    for prompt in range(1, max_prompt + 1):
        cache = NumpyCache(policy, batch, heads, probe=False)
        cache.append(prompt)
        stable(cache, f"a prefill of {prompt} tokens")
        follows_rule([decode(cache)], cache)
    prompt = prompt_len
    cache = NumpyCache(policy, batch, heads, probe=False)
    if prompt_len:
        cache.append(prompt_len)
        stable(cache, f"a prefill of {prompt_len} tokens")
    follows_rule([decode(cache) for _ in range(long_steps)], cache)


def check_full_cache(policy: EvictionPolicy, logits: np.ndarray, prompt_len: int = 0) -> None:
    """While ``capacity`` covers the sequence, ``policy`` keeps exactly what FullCache keeps."""
    cap = policy.capacity
    if cap is None:
        return
    steps = logits.shape[0]
    trace = kvpolicy_numpy.replay(policy, logits, prompt_len, **example_inputs(policy, logits))
    full = kvpolicy_numpy.replay(FullCache(), logits, prompt_len)
    early = [(t, before, after) for t, before, after in trace.evictions if t < cap - 1]
    if early:
        t, before, after = early[0]
        raise ContractViolation(
            f"{policy!r} evicted ({before} -> {after} tokens) after token {t}, before its cache reached its "
            f"capacity {cap}: while the capacity covers the sequence a policy must keep everything, like FullCache"
        )
    if trace.sizes.tolist() != full.sizes.tolist():
        raise ContractViolation(f"sizes differ from FullCache's within capacity {cap}: {trace.sizes.tolist()} vs {full.sizes.tolist()}")
    for t in range(_first(prompt_len), min(steps, cap - 1)):
        if trace.kept[t].tolist() != full.kept[t].tolist():
            raise ContractViolation(f"after token {t} the policy kept {trace.kept[t].tolist()}, FullCache everything")


def compare_backends(
    policy: EvictionPolicy,
    logits: np.ndarray,
    prompt_len: int = 0,
    *,
    group: int = 1,
    invariants: Invariant | Sequence[Invariant] | None = None,
    torch: bool | None = None,
) -> list[np.ndarray | None]:
    """Check the ``backends`` property on one example; returns ``kept[t]`` ``[batch, kv_heads, n]``.

    ``logits`` is ``[steps, heads, steps]`` (one sequence, as for :func:`kvpolicy_numpy.replay`)
    or ``[batch, steps, query_heads, steps]``; ``group`` query heads share a KV head. Torch takes
    part when installed (``torch=None``), must (``True``) or does not (``False``).
    """
    torch = check_bool("torch", torch, allow_none=True)
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 3:
        logits = logits[None]
    use_torch = torch_available() if torch is None else torch
    invs = policy_invariants(policy, invariants)
    cap = policy.capacity

    def on_step(t: int, positions: np.ndarray, rounds: list[tuple[int, int]]) -> None:
        for b in range(positions.shape[0]):
            check_positions(policy, positions[b], t, f"row {b}")
            try:
                run_invariants(invs, policy, positions[b], t)
            except AssertionError as e:
                raise ContractViolation(f"invariant broken (row {b}): {e}") from None

    kept = run_replay(policy, logits, prompt_len, group=group, torch=use_torch, probe=True, on_step=on_step)
    if cap is not None:
        for t in range(prompt_len, logits.shape[1]):
            size = (held_per_head(kept[t - 1]) if t > 0 and kept[t - 1] is not None else 0) + 1
            if size > cap:
                raise ContractViolation(f"{policy!r} attended {size} tokens at token {t}, above its capacity {cap}")
    if logits.shape[0] > 1:
        for b in range(logits.shape[0]):
            alone = run_replay(policy, logits[b : b + 1], prompt_len, group=group, torch=False, probe=False)
            mine = sequence_rows(kept, b)
            for t, (x, y) in enumerate(zip(mine, alone)):
                if x is not None and not np.array_equal(trim_holes(x), trim_holes(y[0])):
                    raise ContractViolation(
                        f"row {b} of a batch of {logits.shape[0]} kept {x.tolist()} after token {t}, but the same row "
                        f"alone keeps {y[0].tolist()}: rows of a batch must be independent"
                    )
    return kept


# ============================================================================ check_policy
@dataclass
class ContractReport:
    """What :func:`check_policy` ran: ``results[property]`` is ``"passed"`` or ``"skipped: why"``."""

    policy: str
    results: dict[str, str] = field(default_factory=dict)
    max_examples: int = 0

    @property
    def passed(self) -> list[str]:
        return [k for k, v in self.results.items() if v.startswith("passed")]

    def __str__(self) -> str:
        lines = [f"kvpolicy contract for {self.policy} ({self.max_examples} examples per property)"]
        lines += [f"  {k:<11} {v}" for k, v in self.results.items()]
        return "\n".join(lines)


def _label(factory: Any) -> str:
    if isinstance(factory, EvictionPolicy):
        return repr(factory)
    name = getattr(factory, "__qualname__", None) or getattr(factory, "name", None)
    return str(name or repr(factory))


def _wrap(prop: str, body: Callable[[], Any], replay: Callable[[], str]) -> Any:
    """Run ``body``; on any failure raise :class:`ContractViolation` with the replay code."""
    try:
        return body()
    except Exception as e:  # noqa: BLE001 - every failure is reported with its replay
        if isinstance(e, ContractViolation):
            what = str(e)
        else:
            where = traceback.extract_tb(e.__traceback__)[-1]
            what = f"{type(e).__name__}: {e} (raised at {where.filename}:{where.lineno})"
        raise ContractViolation(f"[{prop}] {what}\n\nReplay it:\n{replay()}") from e


class _KeyedDatabase(ExampleDatabase):
    """``base`` with every key prefixed by ``prefix``: each (policy, property) pair keeps its own
    examples although the property functions share their source (hypothesis keys a database entry
    by the test's source)."""

    def __init__(self, base: ExampleDatabase, prefix: bytes) -> None:
        super().__init__()
        self.base = base
        self.prefix = prefix

    def save(self, key: bytes, value: bytes) -> None:
        self.base.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        yield from self.base.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.base.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.base.move(self.prefix + src, self.prefix + dest, value)


def _prop_settings(base: Settings, key: str) -> Settings:
    suppress = list(base.suppress_health_check) + [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    database = None if base.database is None else _KeyedDatabase(base.database, key.encode() + b":")
    return Settings(base, deadline=None, suppress_health_check=suppress, report_multiple_bugs=False, database=database)


def _run(fn: Callable[..., None], label: str, prop: str, settings: Settings) -> None:
    """Run one property: ``fn(data)`` under ``@given(data=st.data())``, with its own database key."""
    fn.__name__ = f"check_policy_{prop}"
    fn.__qualname__ = f"check_policy[{label}].{prop}"
    try:
        _prop_settings(settings, f"{label}:{prop}")(given(data=st.data())(fn))()
    except Unsatisfiable:
        refusal = last_refusal()
        raise ValueError(
            f"check_policy({label}): no example for the {prop!r} check could be drawn: the policy's constructor "
            "refused (ValueError) every parameter set drawn from params=, so nothing was checked"
            + (f" (the last: {refusal})" if refusal else "")
            + ". Draw parameters the constructor accepts (e.g. st.integers(1, 8) for a size)"
        ) from None


def refuse_reconstruction(policy_factory: Any) -> None:
    """``NotImplementedError`` for a policy scored by a context reconstruction (KVzip, as a class,
    an instance or a registry preset over it): the kit drives policies on attention logits (and
    keys), step by step, and such a policy's scores come from a second forward after the prompt,
    which it does not model. Its selection is held to the reference given its scores by its own
    tests instead (tests/core/policies/test_kvzip.py).

    Example:
        >>> from kvpolicy import KVzip
        >>> refuse_reconstruction(KVzip)
        Traceback (most recent call last):
        ...
        NotImplementedError: KVzip is scored by a context reconstruction (score_statistic 'reconstruction'), which the kit does not drive: hold its selection to kvpolicy_numpy.replay(policy, logits, prompt_len, reconstruction=scores) instead
    """
    def reconstructs(factory: Any) -> bool:
        if isinstance(factory, EvictionPolicy):
            return factory.needs_reconstruction
        if isinstance(factory, type) and issubclass(factory, EvictionPolicy):
            return getattr(factory, "score_statistic", None) == RECONSTRUCTION
        if isinstance(factory, Preset):
            scorer = factory.fixed.get("scorer")
            return reconstructs(factory.cls) or (isinstance(scorer, str) and reconstructs(get_policy(scorer)))
        return False

    if reconstructs(policy_factory):
        name = policy_factory.name if isinstance(policy_factory, Preset) else getattr(policy_factory, "__name__", None) or repr(policy_factory)
        raise NotImplementedError(
            f"{name} is scored by a context reconstruction (score_statistic {RECONSTRUCTION!r}), which the kit does not "
            "drive: hold its selection to kvpolicy_numpy.replay(policy, logits, prompt_len, reconstruction=scores) instead"
        )


def check_policy(
    policy_factory: Any = None,
    params: Any = None,
    *,
    invariants: Invariant | Sequence[Invariant] | None = None,
    checks: Sequence[str] | None = None,
    torch: bool | None = None,
    settings: Settings | None = None,
    max_steps: int = 48,
    max_heads: int = 3,
    max_batch: int = 3,
    max_group: int = 3,
    max_prompt: int = 48,
    long_steps: int = 256,
    stateful_steps: int = 20,
) -> ContractReport:
    """Check that a policy keeps the eviction-policy contract, on many hypothesis-drawn examples.

    Args:
        policy_factory: what makes the policies: a policy class (built-in ones use their own
            strategies; others draw their constructor arguments, see ``params``), a registry
            preset, a factory function, a hypothesis strategy of policies, or one instance.
        params: the constructor arguments of ``policy_factory``: a dict of strategies by
            parameter name (the rest is derived from the signature, see
            :func:`~kvpolicy.testing.strategies.params_strategy`) or a strategy of keyword dicts.
        invariants: the policy's own promises, ``invariant(policy, kept, t)`` (one or a list; see
            :mod:`kvpolicy.testing.invariants`); a policy method ``invariants(kept, t)`` is used too.
        checks: which of :data:`PROPERTIES` to run (default all).
        torch: compare with the torch backend: ``None`` when installed, ``True`` required,
            ``False`` never.
        settings: hypothesis settings (default: the selected kit profile, see
            :mod:`kvpolicy.testing.profiles`). Its ``deadline`` bounds each ``select()`` call
            (twice over it on the same view fails; see :mod:`kvpolicy.testing.watch`), not a whole
            example; the kit's profiles set none.
        max_steps, max_heads, max_batch, max_group: bounds of the drawn sequences and shapes.
        max_prompt, long_steps: the ``sizes`` sweep: every prompt length up to ``max_prompt``
            and a decode run of ``long_steps`` tokens (placeholder scores, cheap).
        stateful_steps: steps per state-machine run.

    Returns:
        A :class:`ContractReport`. Raises :class:`ContractViolation` (an ``AssertionError``) on
        the first broken property, with the shrunk example and code that replays it.

    Example:
        >>> from hypothesis import settings, strategies as st
        >>> from kvpolicy import LocalWindow
        >>> report = check_policy(LocalWindow, {"window": st.integers(1, 4)}, torch=False,
        ...                       settings=settings(max_examples=5))
        >>> report.passed  # (LocalWindow ranks no tokens: 'ranking' and 'head_ties' are skipped)
        ['replay', 'sizes', 'full_cache', 'backends', 'stateful']
    """
    refuse_reconstruction(policy_factory)
    chosen = list(PROPERTIES if checks is None else checks)
    unknown = sorted(set(chosen) - set(PROPERTIES))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; choose from {', '.join(PROPERTIES)}")
    torch = check_bool("torch", torch, allow_none=True)
    for name, value, least in (("max_steps", max_steps, 1), ("max_heads", max_heads, 1), ("max_batch", max_batch, 1),
                               ("max_group", max_group, 1), ("max_prompt", max_prompt, 0), ("long_steps", long_steps, 1),
                               ("stateful_steps", stateful_steps, 1)):
        check_int(name, value, minimum=least)
    given_invariants = [] if invariants is None else [invariants] if callable(invariants) else list(invariants)
    for inv in given_invariants:
        if not callable(inv):
            raise TypeError(
                f"invariants must be callables invariant(policy, kept, t) (see kvpolicy.testing.invariants), got {inv!r}"
            )
    use_torch = torch_available() if torch is None else torch
    if use_torch and not torch_available():
        raise ImportError("check_policy(torch=True) needs torch installed")
    base = settings if settings is not None else selected_settings()
    strategy = watched(policies(policy_factory, params), base.deadline)
    label = _label(policy_factory)
    report = ContractReport(label, max_examples=base.max_examples)

    for prop in PROPERTIES:
        if prop not in chosen:
            continue
        if prop == "replay":
            _run(_replay_property(strategy, invariants, max_steps, max_heads), label, prop, base)
        elif prop == "sizes":
            _run(_sizes_property(strategy, max_heads, max_batch, max_prompt, long_steps), label, prop, base)
        elif prop == "full_cache":
            _run(_full_cache_property(strategy, max_steps, max_heads), label, prop, base)
        elif prop == "backends":
            _run(_backends_property(strategy, invariants, use_torch, max_steps, max_heads, max_batch, max_group), label, prop, base)
        elif prop == "stateful":
            run_machine(strategy, invariants=invariants, torch=use_torch, settings=_prop_settings(base, f"{label}:stateful"), steps=stateful_steps, label=label)
        elif prop in ("ranking", "head_ties"):
            applied: list[bool] = []
            build = _ranking_property(strategy, max_heads, applied) if prop == "ranking" else _head_ties_property(strategy, use_torch, max_heads, applied)
            _run(build, label, prop, base)
            if not applied:
                report.results[prop] = "skipped: " + ("no drawn policy ranks tokens (ranking() and head_budget())" if prop == "ranking"
                                                      else "no drawn policy has head-wise budgets (AdaKV)")
                continue
        report.results[prop] = "passed"
    if "backends" in chosen and not use_torch:
        report.results["backends"] = "passed (NumPy only: torch is not installed)" if torch is None else "passed (NumPy only)"
    return report


def _replay_property(strategy, invariants, max_steps: int, max_heads: int) -> Callable[..., None]:
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        spec: LogitsSpec = data.draw(logits_specs(max_steps=max_steps, max_heads=max_heads), label="logits")
        prompt_len = data.draw(prompt_lengths(spec.steps), label="prompt_len")
        logits = spec.build()

        def replay_code() -> str:
            p = _format.policy_expr(policy)
            setup = [f"logits = {_format.array_expr(logits, spec)}",
                     f"trace = kvpolicy_numpy.replay({p}, logits, prompt_len={prompt_len}{_keys_arg(policy, p, 'logits')})"]
            call = f"kvpolicy.testing.check_replay({p}, logits, prompt_len={prompt_len}{{inv}})"
            return _format.replay_snippet(policy, setup, call, invariants,
                                          extra_imports=("import kvpolicy_numpy", "import kvpolicy.testing"))

        _wrap("replay", lambda: check_replay(policy, logits, prompt_len, invariants=invariants), replay_code)

    return prop


def _sizes_property(strategy, max_heads: int, max_batch: int, max_prompt: int, long_steps: int) -> Callable[..., None]:
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        batch = data.draw(st.integers(1, max_batch), label="batch")
        heads = data.draw(st.integers(1, max_heads), label="heads")
        prompt_len = data.draw(st.one_of(st.just(0), st.integers(0, max_prompt)), label="prompt_len")
        failure: list[Any] = []

        def body() -> None:
            try:
                check_sizes(policy, batch=batch, heads=heads, max_prompt=max_prompt, long_steps=long_steps, prompt_len=prompt_len)
            except ContractViolation as e:
                failure.append(getattr(e, "replay_args", None))
                raise

        def replay_code() -> str:
            p = _format.policy_expr(policy)
            lines = []
            args = failure[0] if failure else None
            if args is not None and batch == 1:
                steps, prompt = args
                lines += [
                    "# the reference backend refuses the same run (kvpolicy.driver.PolicyError):",
                    f"# kvpolicy_numpy.replay({p}, np.zeros(({steps}, {heads}, {steps})), prompt_len={prompt}"
                    f"{_keys_arg(policy, p, f'np.zeros(({steps}, {heads}, {steps}))')})",
                ]
            lines.append(
                f"kvpolicy.testing.check_sizes({p}, batch={batch}, heads={heads}, max_prompt={max_prompt}, "
                f"long_steps={long_steps}, prompt_len={prompt_len})  # raises this error"
            )
            return _format.code_block(policy, lines, extra_imports=("import kvpolicy_numpy", "import kvpolicy.testing"))

        _wrap("sizes", body, replay_code)

    return prop


def _full_cache_property(strategy, max_steps: int, max_heads: int) -> Callable[..., None]:
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        cap = policy.capacity
        if cap is None:
            return
        steps = data.draw(st.integers(1, max(1, min(cap, max_steps))), label="steps")
        spec: LogitsSpec = data.draw(logits_specs(steps=steps, max_heads=max_heads), label="logits")
        prompt_len = data.draw(prompt_lengths(steps), label="prompt_len")
        logits = spec.build()

        def replay_code() -> str:
            p = _format.policy_expr(policy)
            return _format.code_block(
                policy,
                [
                    f"logits = {_format.array_expr(logits, spec)}",
                    f"trace = kvpolicy_numpy.replay({p}, logits, prompt_len={prompt_len}{_keys_arg(policy, p, 'logits')})",
                    "print(trace.evictions)  # (token, size before, size after): expected none before the capacity is reached",
                ],
                extra_imports=("import kvpolicy_numpy", "import kvpolicy.testing"),
            )

        _wrap("full_cache", lambda: check_full_cache(policy, logits, prompt_len), replay_code)

    return prop


def _backends_property(strategy, invariants, use_torch: bool, max_steps: int, max_heads: int, max_batch: int, max_group: int) -> Callable[..., None]:
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        kv_heads, group = data.draw(gqa_shapes(max_kv_heads=max_heads, max_group=max_group), label="(kv_heads, group)")
        batch = data.draw(
            padded_batches(max_batch=max_batch, max_steps=max_steps, query_heads=kv_heads * group, kinds=TIE_KINDS), label="batch"
        )
        prompt_len = data.draw(prompt_lengths(batch.spec.steps), label="prompt_len")
        logits = batch.logits

        def replay_code() -> str:
            arr = _format.array_expr(logits, None) if logits.size <= _format.MAX_LITERAL else batch.call()
            torch_arg = "" if use_torch else ", torch=False"
            call = (f"kvpolicy.testing.compare_backends({_format.policy_expr(policy)}, logits, prompt_len={prompt_len}, "
                    f"group={group}{torch_arg}{{inv}})")
            return _format.replay_snippet(policy, [f"logits = {arr}  # [batch, steps, query_heads, steps]"], call, invariants,
                                          extra_imports=("import kvpolicy.testing", "import kvpolicy.testing.strategies"))

        _wrap(
            "backends",
            lambda: compare_backends(policy, logits, prompt_len, group=group, invariants=invariants, torch=use_torch),
            replay_code,
        )

    return prop


def _ranking_property(strategy, max_heads: int, applied: list[bool]) -> Callable[..., None]:
    """The ``ranking`` property (:func:`~kvpolicy.testing.rankings.check_ranking`) on drawn views:
    a length at which the policy evicts, several heads, positions with gaps, tie-rich scores."""
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        if not policy.ranks_tokens:
            return
        phases = [p for p in ("decode", "prefill") if ranking_lengths(policy, p)]  # type: ignore[arg-type]
        if not phases:
            return
        applied.append(True)
        phase = data.draw(st.sampled_from(phases), label="phase")
        n = data.draw(st.sampled_from(ranking_lengths(policy, phase)), label="n_cached")
        batch = data.draw(st.integers(1, 2), label="batch")
        heads = data.draw(st.integers(1, max_heads), label="heads")
        level = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, float("nan")]), st.floats(-8.0, 8.0))
        scores = np.asarray(data.draw(st.lists(level, min_size=batch * heads * n, max_size=batch * heads * n), label="scores"),
                            dtype=np.float64).reshape(batch, heads, n)
        width = data.draw(st.integers(n, 2 * n + 4), label="positions seen")
        positions = np.asarray([sorted(data.draw(st.lists(st.integers(0, width - 1), min_size=n, max_size=n, unique=True)))
                                for _ in range(batch * heads)], dtype=np.int64).reshape(batch, heads, n)

        def replay_code() -> str:
            def literal(a: np.ndarray) -> str:
                return "np.array(" + repr(a.tolist()).replace("nan", "np.nan").replace("inf", "np.inf") + ")"

            return _format.code_block(policy, [
                f"kvpolicy.testing.rankings.check_ranking({_format.policy_expr(policy)}, {literal(scores)}, {literal(positions)}, "
                f"n_seen={width}, phase={phase!r})  # raises this error",
            ], extra_imports=("import kvpolicy.testing.rankings",))

        _wrap("ranking", lambda: check_ranking(policy, scores, positions, width, phase), replay_code)

    return prop


def _head_ties_property(strategy, use_torch: bool, max_heads: int, applied: list[bool]) -> Callable[..., None]:
    """The ``head_ties`` property (:func:`~kvpolicy.testing.rankings.check_head_ties`) on drawn
    views: heads holding overlapping positions (some leading holes) with a few score levels."""
    def prop(data: st.DataObject) -> None:
        policy = data.draw(strategy, label="policy")
        if not isinstance(policy, AdaKV):
            return
        phases = {p: ranking_lengths(policy.scorer, p, count=4) for p in ("decode", "prefill")}  # type: ignore[arg-type]
        phases = {p: lengths for p, lengths in phases.items() if lengths}
        if not phases:
            return
        applied.append(True)
        phase = data.draw(st.sampled_from(sorted(phases)), label="phase")
        n = data.draw(st.sampled_from(phases[phase]), label="n_cached")
        batch = data.draw(st.integers(1, 2), label="batch")
        heads = data.draw(st.integers(2, max(2, max_heads)), label="heads")
        width = data.draw(st.integers(n, n + 3), label="positions seen")
        rows = []
        for _ in range(batch * heads):
            held = data.draw(st.integers(max(1, n - 2), n), label="held")
            kept = sorted(data.draw(st.lists(st.integers(0, width - 1), min_size=held, max_size=held, unique=True), label="positions"))
            rows.append([-1] * (n - held) + kept)
        positions = np.asarray(rows, dtype=np.int64).reshape(batch, heads, n)
        # a token's score is a function of its position in most heads: equal keys across heads
        levels = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=width, max_size=width), label="levels")
        scores = np.where(positions >= 0, np.asarray(levels + [0.0])[positions], 0.0)
        for i in data.draw(st.lists(st.integers(0, batch * heads * n - 1), max_size=3), label="changed"):
            scores.reshape(-1)[i] = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), label="score")

        def replay_code() -> str:
            torch_arg = ", torch=True" if use_torch else ""
            return _format.code_block(policy, [
                f"kvpolicy.testing.rankings.check_head_ties({_format.policy_expr(policy)}, np.array({scores.tolist()!r}), "
                f"np.array({positions.tolist()!r}), n_seen={width}, phase={phase!r}{torch_arg})  # raises this error",
            ], extra_imports=("import kvpolicy.testing.rankings",))

        _wrap("head_ties", lambda: check_head_ties(policy, scores, positions, width, phase, torch=use_torch), replay_code)

    return prop
