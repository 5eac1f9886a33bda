"""The contract as a hypothesis state machine: append, prefill a chunk, decode, evict, in any order.

:class:`PolicyMachine` drives one policy on a NumPy cache and a torch
:class:`~kvpolicy_torch.LayerCache` in lockstep (identical received-attention scores on both),
and after every step checks: sorted, unique positions below ``n_seen``; at most ``capacity - 1``
tokens once evicted and at most ``capacity`` during a decode step's attention; NumPy == torch;
the ``select`` results and host-int decisions (see :mod:`kvpolicy.testing._driver`); that an
eviction on a cache the policy already accepted evicts nothing; the policy's invariants.

Every step is an *event* (a tuple); :func:`replay_events` re-runs a list of them, so a failure
prints one call that reproduces it::

    kvpolicy.testing.replay_events(EveryKth(k=2, window=1, limit=2), [("chunk", 5, "levels", 0), ("decode", "normal", 3)], batch=1, heads=2)

Use it through :func:`~kvpolicy.testing.check_policy` (property ``stateful``) or directly::

    Machine = policy_machine(EveryKth, {"k": st.integers(2, 4)})
    TestEveryKth = Machine.TestCase  # a unittest/pytest test case
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from hypothesis import settings as Settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvpolicy.validation import check_bool
from kvpolicy.policy import EvictionPolicy

from . import _format
from ._driver import ContractViolation, Lockstep, check_positions, seeded_keys, softmax, step_received
from ._util import torch_available
from .invariants import Invariant, policy_invariants, run_invariants
from .strategies import LOGIT_EXTREMES, LOGIT_LEVELS, policies

__all__ = ["PolicyMachine", "policy_machine", "replay_events", "received_for", "run_machine"]

#: Score kinds an event draws its attention logits from (ties, extremes, plain).
SCORE_KINDS = ("levels", "extremes", "constant", "normal")


def received_for(
    kind: str, seed: int, batch: int, heads: int, n_cached: int, q: int, rows: int | None = None,
    *, policy: EvictionPolicy | None = None,
) -> np.ndarray:
    """Received attention ``[batch, heads, n_cached + q]`` of ``q`` new queries (causal among
    themselves, all seeing the ``n_cached`` cached tokens), summed over the queries (over the last
    ``rows`` of them when given: a policy's ``prompt_rows``); a ``"low_history"`` ``policy``'s
    record of the step instead (as the kit's replays compute it); a pure function
    of its arguments."""
    rng = np.random.default_rng(seed)
    n = n_cached + q
    shape = (batch, q, heads, n)
    if kind == "levels":
        logits = rng.choice(np.asarray(LOGIT_LEVELS), size=shape)
    elif kind == "extremes":
        logits = rng.choice(np.asarray(LOGIT_EXTREMES), size=shape)
    elif kind == "constant":
        logits = np.zeros(shape)
    elif kind == "normal":
        logits = rng.normal(size=shape)
    else:
        raise ValueError(f"kind must be one of {', '.join(SCORE_KINDS)}, got {kind!r}")
    visible = np.arange(n)[None, :] <= (n_cached + np.arange(q))[:, None]  # [q, n]
    probs = softmax(np.where(visible[None, :, None, :], logits, -np.inf))
    if policy is not None and policy.score_statistic == "low_history":
        return step_received(policy, probs, 1, visible, rows)
    return probs[:, q - min(rows or q, q) :].sum(axis=1)


class _Run:
    """Applies events to a :class:`Lockstep` and checks the contract after each."""

    def __init__(
        self, policy: EvictionPolicy, batch: int, heads: int, invariants: Sequence[Invariant], torch: bool,
        extra: Sequence[Invariant] = (),
    ) -> None:
        self.policy, self.batch, self.heads = policy, batch, heads
        self.invariants = list(invariants)
        self.extra = list(extra)  # the invariants given by the caller (the policy's own method aside)
        self.torch = torch
        self.events: list[tuple[Any, ...]] = []
        self.pending = False
        self.lock = Lockstep(policy, batch, heads, torch=torch)

    def replay_call(self) -> str:
        torch_arg = "" if self.torch else ", torch=False"
        inv = _format.invariants_line(self.extra or None)
        inv_arg = ", invariants=invariants" if inv else ""
        return _format.code_block(
            self.policy,
            [
                *([inv] if inv else []),
                f"kvpolicy.testing.replay_events({_format.policy_expr(self.policy)}, {self.events!r}, "
                f"batch={self.batch}, heads={self.heads}{torch_arg}{inv_arg})  # raises this error",
            ],
            extra_imports=("import kvpolicy.testing",),
        )

    def apply(self, event: tuple[Any, ...]) -> None:
        self.events.append(event)
        try:
            self._apply(event)
        except ContractViolation as e:
            raise ContractViolation(f"[stateful] {e}\n\nafter events {self.events!r}\n\nReplay it:\n{self.replay_call()}") from None
        except Exception as e:  # noqa: BLE001
            raise ContractViolation(
                f"[stateful] {type(e).__name__}: {e}\n\nafter events {self.events!r}\n\nReplay it:\n{self.replay_call()}"
            ) from e

    def _append(self, q: int, kind: str, seed: int) -> None:
        lock = self.lock
        cap = self.policy.capacity
        if q == 1 and not self.pending and cap is not None and lock.np.length + 1 > cap:
            raise ContractViolation(
                f"{self.policy!r}: a decode step attends {lock.np.length + 1} tokens, above its capacity {cap}"
            )
        rows = self.policy.prompt_rows if q > 1 else None  # a decode step's one query either way
        keys = seeded_keys(seed, (self.batch, self.heads, q))  # read by a policy scoring keys only
        slots = lock.np.positions.shape[-1]  # (under head-wise budgets more than lock.np.length)
        received = received_for(kind, seed, self.batch, self.heads, slots, q, rows, policy=self.policy)
        received[..., :slots][lock.np.positions < 0] = 0.0  # holes (head-wise budgets) receive nothing
        lock.append(q, received, keys)

    def _evict(self) -> list[tuple[int, int]]:
        rounds = self.lock.evict(self._check_stable)
        self.pending = False
        return rounds

    def _apply(self, event: tuple[Any, ...]) -> None:
        op = event[0]
        if op == "append":
            _, q, kind, seed = event
            self._append(q, kind, seed)
            self.pending = True
        elif op == "evict":
            was_pending = self.pending
            rounds = self._evict()
            if not was_pending and rounds:
                raise ContractViolation(
                    f"{self.policy!r} evicted again ({rounds}) from a cache it had accepted, with nothing appended: "
                    "select must keep returning None once the cache satisfies the policy"
                )
        elif op == "chunk":
            _, q, kind, seed = event
            self._append(q, kind, seed)
            self._evict()
        elif op == "decode":
            _, kind, seed = event
            self._append(1, kind, seed)
            self._evict()
        else:
            raise ValueError(f"unknown event {event!r}")

    def _check_stable(self) -> None:
        pos = self.lock.positions
        t = self.lock.n_seen - 1
        for b in range(pos.shape[0]):
            check_positions(self.policy, pos[b], t, f"row {b}")
            try:
                run_invariants(self.invariants, self.policy, pos[b], t)
            except AssertionError as e:
                raise ContractViolation(f"invariant broken (row {b}): {e}") from None


def replay_events(
    policy: EvictionPolicy,
    events: Sequence[tuple[Any, ...]],
    *,
    batch: int = 1,
    heads: int = 1,
    invariants: Invariant | Sequence[Invariant] | None = None,
    torch: bool | None = None,
) -> np.ndarray:
    """Re-run a state-machine history: events ``("append", q, kind, seed)``, ``("evict",)``,
    ``("chunk", q, kind, seed)`` (append + evict) and ``("decode", kind, seed)``. Returns the
    final ``[batch, heads, n]`` positions; raises :class:`ContractViolation` like the machine."""
    torch = check_bool("torch", torch, allow_none=True)
    run = _Run(policy, batch, heads, policy_invariants(policy, invariants), torch_available() if torch is None else torch, _as_list(invariants))
    for event in events:
        run.apply(tuple(event))
    return run.lock.positions


_seeds = st.integers(0, 2**32 - 1)
_kinds = st.sampled_from(SCORE_KINDS)


class PolicyMachine(RuleBasedStateMachine):
    """The state machine; subclass it with :func:`policy_machine` (it needs a policy strategy)."""

    policy_strategy: st.SearchStrategy[EvictionPolicy] = st.nothing()
    extra_invariants: list[Invariant] = []  # a list: a bare function here would become a method
    use_torch: bool = True
    max_batch: int = 2
    max_heads: int = 3

    def __init__(self) -> None:
        super().__init__()
        self.run: _Run | None = None

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        policy = data.draw(self.policy_strategy, label="policy")
        batch = data.draw(st.integers(1, self.max_batch), label="batch")
        heads = data.draw(st.integers(1, self.max_heads), label="heads")
        self.run = _Run(policy, batch, heads, policy_invariants(policy, self.extra_invariants), self.use_torch, self.extra_invariants)

    def _idle(self) -> bool:
        return self.run is not None and not self.run.pending

    @precondition(lambda self: self._idle())
    @rule(kind=_kinds, seed=_seeds)
    def decode_step(self, kind: str, seed: int) -> None:
        self.run.apply(("decode", kind, seed))  # type: ignore[union-attr]

    @precondition(lambda self: self._idle())
    @rule(q=st.integers(2, 8), kind=_kinds, seed=_seeds)
    def prefill_chunk(self, q: int, kind: str, seed: int) -> None:
        self.run.apply(("chunk", q, kind, seed))  # type: ignore[union-attr]

    @precondition(lambda self: self._idle())
    @rule(q=st.integers(1, 8), kind=_kinds, seed=_seeds)
    def append(self, q: int, kind: str, seed: int) -> None:
        self.run.apply(("append", q, kind, seed))  # type: ignore[union-attr]

    @precondition(lambda self: self.run is not None)
    @rule()
    def evict(self) -> None:
        self.run.apply(("evict",))  # type: ignore[union-attr]

    @invariant()
    def backends_hold_the_same_tokens(self) -> None:
        run = self.run
        if run is None or run.lock.tc is None:
            return
        a, b = run.lock.np.positions, run.lock.tc.positions
        if a.shape != b.shape or not np.array_equal(a, b):
            raise ContractViolation(
                f"[stateful] NumPy and torch hold different positions: {a.tolist()} vs {b.tolist()}\n\n"
                f"after events {run.events!r}\n\nReplay it:\n{run.replay_call()}"
            )


def _as_list(invariants: Invariant | Sequence[Invariant] | None) -> list[Invariant]:
    if invariants is None:
        return []
    return [invariants] if callable(invariants) else list(invariants)


def policy_machine(
    policy_factory: Any = None,
    params: Any = None,
    *,
    invariants: Invariant | Sequence[Invariant] | None = None,
    torch: bool | None = None,
) -> type[PolicyMachine]:
    """A :class:`PolicyMachine` subclass for the policies ``policy_factory`` / ``params`` make
    (the same arguments as :func:`~kvpolicy.testing.check_policy`)."""
    strategy = policies(policy_factory, params)
    torch = check_bool("torch", torch, allow_none=True)
    use_torch = torch_available() if torch is None else torch
    return type(
        "PolicyMachine",
        (PolicyMachine,),
        {"policy_strategy": strategy, "extra_invariants": _as_list(invariants), "use_torch": use_torch, "__module__": __name__},
    )


def run_machine(
    strategy: st.SearchStrategy[EvictionPolicy],
    *,
    invariants: Invariant | Sequence[Invariant] | None = None,
    torch: bool = True,
    settings: Settings | None = None,
    steps: int = 20,
    label: str = "",
) -> None:
    """Run the machine for ``strategy`` under ``settings`` (``steps`` rules per run)."""
    torch = check_bool("torch", torch)
    machine = type(
        "PolicyMachine",
        (PolicyMachine,),
        {"policy_strategy": strategy, "extra_invariants": _as_list(invariants), "use_torch": torch, "__module__": __name__},
    )
    base = settings if settings is not None else Settings()
    run_state_machine_as_test(machine, settings=Settings(base, stateful_step_count=steps))
