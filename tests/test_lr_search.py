"""The learning-rate search's result (`altgrad.tune.lr_search`): the largest stable learning rate per
format, from trial records alone."""

from __future__ import annotations

import json
import math

import pytest
from sweep_helpers import LR_SEARCH

from altgrad.config import StabilityConfig
from altgrad.experiment import TrialRecord

# How far (log scale) rounding to 3 significant digits moves a sampled rate, at most.
ROUNDING = math.log(1.005)


def trial(lr: float, vals: list[float], reason: str = "completed") -> TrialRecord:
    history = [{"step": i + 1, "val/loss": v, "val/step": i + 1} for i, v in enumerate(vals)]
    return TrialRecord(trial_id=str(lr), format="e4m3", optimizer="adamw", precision="all",
                       status="TERMINATED", stop_reason=reason, history=history,
                       summary={"final_val_loss": vals[-1]}, params={"lr": lr})


def test_lr_search_table():
    """The edge lies between the largest stable rate and the next unstable one above it (3e-2), not
    the smallest unstable one (5e-3, below it); a search whose rates all trained says the edge
    lies past its range."""
    from altgrad.tune.lr_search import render_lr_table, stable_lr_row

    records = [trial(1e-3, [10, 8]), trial(1e-2, [10, 7]), trial(3e-2, [10, 11, 6.5]),  # spiked, then recovered
               trial(1e-1, [10, float("inf")], "nan"), trial(5e-3, [10, 9], "bit_stall")]
    row = stable_lr_row("e4m3", records, 0.0)
    assert row == {"format": "e4m3", "largest_stable_lr": 1e-2, "val_loss_there": 7, "unstable_above": 3e-2,
                   "smallest_unstable_lr": 5e-3, "smallest_unstable_why": "was stopped (bit_stall)", "trials": 5,
                   "unfinished": 0, "unstable_above_why": "diverged (its val loss rose to 11, above its first, 10; it ended at 6.5)",
                   "idle_up_to": None, "idle_why": None, "diverged_from": None, "diverged_why": None,
                   "same_as": None}
    table = render_lr_table([row], (1e-4, 100.0)).splitlines()
    assert table[1].split()[:4] == ["e4m3", "0.01", "7.0000", "0.03"]
    assert table[2:] == ["e4m3: the edge lies between 0.01 and 0.03, which diverged (its val loss rose to 11, above its "
                         "first, 10; it ended at 6.5)"]
    learned = stable_lr_row("e5m2", [trial(1e-3, [10, 8]), trial(1e-1, [10, 7])], 0.0)
    assert (learned["largest_stable_lr"], learned["unstable_above"]) == (1e-1, None)
    # Where the edge lies past what was tried: samples reach it inside the range, a bound must move
    # outside it.
    assert render_lr_table([learned], (1e-4, 100.0)).splitlines()[2] == (
        "e5m2: no rate tried above 0.1 failed; the edge lies higher (more samples, or a larger lr.high)")
    assert render_lr_table([learned], (1e-4, 0.1)).splitlines()[2] == (
        "e5m2: the range's top, lr.high (0.1), trained stably; the edge lies above the range (raise lr.high)")
    # Nothing stable: where the smallest rate diverged the edge lies below it; where it ran without
    # learning, the stable rates (if any) lie above it.
    diverged = stable_lr_row("e7m0", [trial(1e-3, [10, float("nan")], "nan"), trial(1e-1, [10, 11])], 0.0)
    assert diverged["largest_stable_lr"] is None and diverged["smallest_unstable_why"] == "was stopped (nan)"
    assert diverged["unstable_above"] is None  # above no stable rate: the column stays empty
    assert render_lr_table([diverged], (1e-4, 100.0)).splitlines()[2] == (
        "e7m0: no rate tried trained stably; the smallest, 0.001, was stopped (nan): the edge lies lower (more samples, or a "
        "smaller lr.low)")
    assert render_lr_table([diverged], (1e-3, 100.0)).splitlines()[2] == (
        "e7m0: no rate tried trained stably; the smallest, 0.001, was stopped (nan): the edge lies below the range (lower lr.low)")
    idle = stable_lr_row("e7m0", [trial(1e-3, [10, 10]), trial(1e-2, [10, 10], "bit_stall"),
                                  trial(1e-1, [10, float("nan")], "nan"), trial(1.0, [10, 10])], 0.0)
    assert (idle["idle_up_to"], idle["diverged_from"]) == (1e-2, 1e-1)  # 1.0 lies above a rate that diverged
    assert render_lr_table([idle], (1e-3, 100.0)).splitlines()[2] == (
        "e7m0: no rate tried trained stably: 0.01 was stopped (bit_stall), 0.1 was stopped (nan); a rate that "
        "learns, if any, lies between (more samples, or more steps)")
    small = stable_lr_row("e7m0", [trial(1e-3, [10, 10]), trial(1e-1, [10, 10.0])], 0.0)
    assert render_lr_table([small], (1e-3, 0.1)).splitlines()[2] == (
        "e7m0: no rate tried trained stably: up to 0.1, the largest, ran its steps without learning; the edge lies "
        "above the range (raise lr.high (0.1), or run more steps)")


def test_tolerance_decides_stability_in_the_table_and_in_what_optuna_maximizes():
    """`tolerance: 0.25` asks for a val loss 25 % below the first: a run that fell 20 % is not stable,
    neither in the summary table nor in the `sweep/stable_lr` its trial reports to Optuna (which
    gets the setting through the trial config)."""
    from altgrad.metrics import STABLE_LR
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch, stable_lr_row
    from altgrad.tune.trainable import SweepSignals
    from altgrad.tune.trial_spec import learning_tolerance

    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", "tolerance=0.25"], smoke=True)
    row = stable_lr_row("e4m3", [trial(1e-3, [10, 7]), trial(1e-2, [10, 8])], cfg.tolerance)
    assert (row["largest_stable_lr"], row["smallest_unstable_lr"]) == (1e-3, 1e-2)
    config = LrSearch.experiments(cfg)[0].param_space
    for lr, last, stable_lr in [(1e-3, 7.0, 1e-3), (1e-2, 8.0, 0.0)]:
        signals = SweepSignals(StabilityConfig(), lr, tolerance=learning_tolerance(config))
        signals.observe({"step": 1.0, "val/loss": 10.0, "val/step": 1.0})
        assert signals.observe({"step": 2.0, "val/loss": last, "val/step": 2.0})[STABLE_LR] == stable_lr


def test_a_format_that_trains_like_an_earlier_one_is_searched_once(tmp_path, monkeypatch, capsys):
    """Under amax scaling e1m6 trains bit for bit like e0m7 at every rate, and the searcher asks
    for the same rates given the same results: one search, which the plan and the table say (its
    row is e0m7's, marked). Without scaling the two grids differ by a factor 2: both are searched."""
    from altgrad.tune import lr_search
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch

    sets = ["preset=cpu", "formats=[bf16, e0m7, e1m6, e4m3]", f"storage_path={tmp_path}"]
    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, sets)
    experiments = LrSearch.experiments(cfg)
    assert [e.path.rsplit("/", 1)[1] for e in experiments] == ["bf16", "e0m7", "e4m3"]
    per_format = len(cfg.lr.grid) + cfg.lr.samples
    plan = LrSearch.describe(cfg, experiments)
    assert f"3 formats searched × {per_format} trials = {3 * per_format} trials" in plan
    assert "formats: bf16, e0m7, e1m6 (= e0m7: an equivalent format, the same search), e4m3" in plan

    results = {"e0m7": [trial(1e-3, [10, 8]), trial(1e-2, [10, 12])], "bf16": [trial(1e-2, [10, 7])],
               "e4m3": [trial(1e-3, [10, 9])]}
    monkeypatch.setattr(lr_search, "load_experiment", lambda path: results[path.rsplit("/", 1)[1]])
    (tmp_path / cfg.name).mkdir()
    assert LrSearch.summarize(cfg, experiments) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / cfg.name / "lr_search.json").read_text())
    assert [r["format"] for r in rows] == cfg.formats
    twin, measured = rows[2], rows[1]
    assert twin == {**measured, "format": "e1m6", "same_as": "e0m7"} and measured["same_as"] is None
    assert measured["largest_stable_lr"] == 1e-3
    assert "e1m6: the trials of e0m7 (an equivalent format, the same search: one measurement)" in out
    assert next(line for line in out.splitlines() if line.startswith("e1m6 ")).endswith("= e0m7")

    unscaled = load_sweep_config(LrSearchConfig, LR_SEARCH, [*sets, "base.quant.scaling.mode=none"])
    assert [e.path.rsplit("/", 1)[1] for e in LrSearch.experiments(unscaled)] == ["bf16", "e0m7", "e1m6", "e4m3"]
    assert "formats: bf16, e0m7, e1m6, e4m3" in LrSearch.describe(unscaled, LrSearch.experiments(unscaled))


def test_trial_keys_tell_close_learning_rates_apart():
    """Two sampled learning rates that agree to 3 significant digits get their own keys (and so
    their own trial directories); the grid's round values keep their short names."""
    from altgrad.tune.trial_spec import trial_key

    keys = [trial_key({"key": "e4m3-adamw-all-s42", "lr": lr}) for lr in (0.17701, 0.17704, 0.1770400000000001)]
    assert len(set(keys)) == 3 and keys[0] == "e4m3-adamw-all-s42-lr0.17701"
    assert [trial_key({"key": "k", "lr": lr}) for lr in (0.01, 10.0, 1000.0)] == ["k-lr0.01", "k-lr10", "k-lr1e+03"]


def test_samples_wait_for_the_grid_then_split_the_edges_bracket(monkeypatch):
    """Each format's searcher hands out the grid first and no sample while a grid point still runs;
    then, asked together (as a sweep with max_concurrent_trials 5 asks its free slots), samples that split the bracket between
    the largest rate that learned (0.1) and the smallest above it that did not (1.0) evenly: no
    stretch of it left wider than a quarter (log scale) after three. An errored grid point bounds
    nothing: e7m0's at 1.0 leaves its bracket 0.1 to 10, split at 1.0 as by a sample still running. No sample is Optuna's random draw, and a
    resumed trial's repeated reports raise no Optuna warning."""
    import warnings

    from optuna.samplers import RandomSampler

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch

    random_draws: list[str] = []
    draw = RandomSampler.sample_independent
    monkeypatch.setattr(RandomSampler, "sample_independent",
                        lambda self, study, trial, name, dist: random_draws.append(name) or draw(self, study, trial, name, dist))
    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", "formats=[e4m3, e7m0]"])
    assert cfg.lr.grid == [1e-3, 1e-2, 1e-1, 1.0, 10.0]
    for errored, bracket, exp in zip((None, "grid3"), ((0.1, 1.0), (0.1, 10.0)), LrSearch.experiments(cfg),
                                     strict=True):
        search = exp.search_alg
        search.set_search_properties(None, None, exp.param_space)
        search.set_max_concurrency(len(cfg.lr.grid))  # max_concurrent_trials 5: the samples together
        grid = {f"grid{i}": search.suggest(f"grid{i}")["lr"] for i in range(len(cfg.lr.grid))}
        assert list(grid.values()) == cfg.lr.grid
        assert search.suggest("early") is None  # the grid still runs
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for trial_id, lr in grid.items():
                if trial_id == errored:  # not told to Optuna
                    search.on_trial_complete(trial_id, None, error=True)
                    continue
                result = {STABLE_LR: lr if lr <= 0.1 else 0.0, "training_iteration": 1}
                search.on_trial_result(trial_id, result)
                search.on_trial_result(trial_id, result)  # resumed: the same iteration again
                search.on_trial_complete(trial_id, result)
        samples = sorted(search.suggest(f"sample{i}")["lr"] for i in range(cfg.lr.samples))
        low, high = bracket
        assert low < samples[0] and samples[-1] < high
        # the errored rate bounds nothing, but no sample takes it (its rerun will tell): a split point
        points = sorted([low, *samples, high, *([grid[errored]] if errored else [])])
        assert len(set(points)) == len(points)
        widest = max(math.log(b / a) for a, b in zip(points, points[1:], strict=False))
        assert widest <= math.log(high / low) / 4 + 2 * ROUNDING  # each sample rounded to 3 digits
    assert random_draws == []


def test_a_search_on_s3_ends_with_the_command_that_reads_it(capsys):
    """`python -m altgrad trials` reads each format's experiment from the bucket: no copy to local disk."""
    from sweep_helpers import LR_SEARCH

    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch

    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu"], storage_path="s3://bucket/p")
    assert LrSearch.summarize(cfg, []) == 0
    out = capsys.readouterr().out
    # quoted: a shell reads "<" as a redirection
    searched = [f for f in cfg.formats if f != "e1m6"]  # e1m6: the trials of e0m7
    assert (f"python -m altgrad trials 's3://bucket/p/{cfg.name}/<format>' (formats: {', '.join(searched)}; "
            "e1m6: the trials of e0m7)") in out
    assert "local disk" not in out


def test_the_searcher_prints_no_optuna_info(capfd):
    """Optuna's "A new study created in memory" interleaved with the sweep's own progress lines."""
    import optuna
    from ray import tune

    from altgrad.tune.lr_searcher import GridThenEdge

    optuna.logging.set_verbosity(optuna.logging.INFO)
    search = GridThenEdge([0.01, 1.0])
    search.set_search_properties(None, None, {"lr": tune.loguniform(1e-4, 10.0)})
    assert "A new study created" not in "".join(capfd.readouterr())


def test_an_errored_grid_point_rerun_on_resume_reaches_optuna_as_a_first_run(tmp_path):
    """Interrupted with a grid point errored and another running, the sweep resumes (Tune's own
    save and restore of the searcher behind `max_concurrent_trials`, `resume_errored`): the errored
    point runs again under its trial id, no sample is asked while it runs, its result reaches
    Optuna, and the sample is the one a sweep where it never errored draws (near 1.0, which learns;
    modelled as errored, 1.0 sent the samples down to 1e-3)."""
    import pickle

    from ray import tune
    from ray.tune.search import ConcurrencyLimiter, SearchGenerator

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    grid, stable = [0.01, 1.0, 100.0], {0.01: 0.01, 1.0: 1.0, 100.0: 0.0}
    built = pickle.dumps(GridThenEdge(grid))  # what tuner.pkl keeps, read back by Tuner.restore

    def tuned() -> SearchGenerator:  # the searcher as `tune.run` wraps it for max_concurrent_trials=2
        search = SearchGenerator(ConcurrencyLimiter(pickle.loads(built), max_concurrent=2))
        search.set_search_properties(None, None, {"lr": tune.loguniform(1e-3, 1e3)})
        return search

    def done(search: SearchGenerator, trial_id: str, lr: float) -> None:
        search.on_trial_complete(trial_id, {STABLE_LR: stable[lr]})

    first = tuned()
    assert [first.searcher.suggest(t)["lr"] for t in ("g0", "g1")] == grid[:2]
    assert first.searcher.suggest("g2") is None  # two at a time
    first.on_trial_complete("g1", error=True)
    assert first.searcher.suggest("g2")["lr"] == grid[2]
    done(first, "g0", 0.01)
    first.save_to_dir(str(tmp_path), "interrupted")  # g2 still running

    resumed = tuned()
    resumed.restore_from_dir(str(tmp_path))
    done(resumed, "g2", 100.0)
    assert resumed.searcher.suggest("s0") is None  # g1 runs again: the grid has not finished
    done(resumed, "g1", 1.0)
    sample = resumed.searcher.suggest("s0")["lr"]
    assert {t.params["lr"]: t.value for t in resumed.searcher.searcher.told()} == stable

    never_errored = tuned()
    for trial_id, lr in zip(("g0", "g1", "g2"), grid, strict=True):
        assert never_errored.searcher.suggest(trial_id)["lr"] == lr
        done(never_errored, trial_id, lr)
    assert never_errored.searcher.suggest("s0")["lr"] == sample and 1.0 < sample < 100.0


@pytest.mark.parametrize("limited", [False, True])
def test_a_searcher_saved_by_the_previous_version_resumes(tmp_path, limited):
    """A sweep started before errored trials were kept open (the searcher counted its trials) resumes:
    Tune unpickles the searcher the previous version built (tuner.pkl: none of the fields added
    since) and restores the state that version saved; the samples still wait for the grid. With and
    without `max_concurrent_trials` (Tune's limiter)."""
    import pickle

    from ray import tune
    from ray.tune.search import ConcurrencyLimiter, SearchGenerator

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    def as_built_before(searcher: GridThenEdge) -> GridThenEdge:
        for added in ("errored", "max_concurrent"):
            vars(searcher).pop(added, None)
        searcher.asked = len(searcher._ot_trials)  # the count it kept, which this version ignores
        return searcher

    def tuned(searcher: GridThenEdge) -> SearchGenerator:
        search = SearchGenerator(ConcurrencyLimiter(searcher, max_concurrent=2) if limited else searcher)
        search.set_search_properties(None, None, {"lr": tune.loguniform(1e-3, 1e3)})
        return search

    built = pickle.dumps(as_built_before(GridThenEdge([0.01, 1.0])))  # its tuner.pkl
    old = tuned(GridThenEdge([0.01, 1.0]))  # its run, to the state it saved
    assert [old.searcher.suggest(t)["lr"] for t in ("g0", "g1")] == [0.01, 1.0]
    old.on_trial_complete("g0", {STABLE_LR: 0.01})
    inner = old.searcher.searcher if limited else old.searcher
    as_built_before(inner)  # what the previous version's running searcher held when it saved
    if limited:  # and its limiter: the searcher did not keep the limit, so the limiter did
        old.searcher._limit_concurrency, old.searcher.live_trials = True, {"g1"}
    old.save_to_dir(str(tmp_path), "interrupted")

    resumed = tuned(pickle.loads(built))
    resumed.restore_from_dir(str(tmp_path))
    inner = resumed.searcher.searcher if limited else resumed.searcher
    assert inner.tells_errors and resumed.searcher.suggest("s0") is None  # g1 still running
    resumed.on_trial_complete("g1", {STABLE_LR: 1.0})
    assert 1e-3 <= resumed.searcher.suggest("s0")["lr"] <= 1e3
    # a sample errors in this version's run, and the sweep is resumed once more: as in the version
    # it started with, the error is Optuna's (unstable), and the samples go on (Tune's limiter, back
    # from the old state, would drop a reopened trial's rerun, and they would wait for it for good)
    resumed.on_trial_complete("s0", error=True)
    (tmp_path / "again").mkdir()
    resumed.save_to_dir(str(tmp_path / "again"), "again")
    again = tuned(pickle.loads(built))
    again.restore_from_dir(str(tmp_path / "again"))
    again.on_trial_complete("s0", {STABLE_LR: 1.0})  # its rerun: dropped or not, nothing waits for it
    inner = again.searcher.searcher if limited else again.searcher
    assert [t.value for t in inner._ot_study.get_trials()][-1] == 0.0
    assert again.searcher.suggest("s1") is not None


def test_samples_one_at_a_time_halve_the_bracket():
    """Each between the largest rate that trained stably and the smallest above it that did not,
    in the middle (log scale): with the grid's 1e-2 stable and 10 not, Optuna's TPE over the whole
    range (1e-4 to 100) sampled 1.3e-4, 4.6e-3 and 2.0, where none could raise the answer (1e-2)."""
    from ray import tune

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    for edge in (0.02, 0.3, 5.0):  # learns below it
        search = GridThenEdge([1e-2, 10.0])
        search.set_search_properties(None, None, {"lr": tune.loguniform(1e-4, 100.0)})
        told = {}
        for trial_id in ("g0", "g1", "s0", "s1", "s2"):
            lr = search.suggest(trial_id)["lr"]
            stable = max((x for x, ok in told.items() if ok), default=None)
            if trial_id.startswith("s"):
                above = min(x for x, ok in told.items() if not ok and x > stable)
                assert math.isclose(math.log(lr / stable), math.log(above / lr), abs_tol=ROUNDING), (edge, told, lr)
                assert lr == float(f"{lr:.2e}")  # 3 significant digits
            told[lr] = lr < edge
            search.on_trial_complete(trial_id, {STABLE_LR: lr if lr < edge else 0.0})


def test_the_edge_bracket_on_each_side_of_the_grid():
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    from altgrad.tune.lr_searcher import edge_bracket, next_rate

    space = FloatDistribution(1e-4, 100.0, log=True)

    def trials(*pairs):
        return [create_trial(params={"lr": lr}, distributions={"lr": space}, value=v) for lr, v in pairs]

    def bounds(*pairs):
        return edge_bracket(trials(*pairs), space)

    assert bounds((1e-3, 1e-3), (1e-2, 0.0), (1e-1, 0.0)) == (1e-3, 1e-2)
    assert bounds((1e-3, 0.0), (1e-2, 0.0)) == (1e-4, 1e-3)  # nothing learned: below the grid
    assert bounds((1e-3, 1e-3), (1e-2, 1e-2)) == (1e-2, 100.0)  # nothing failed: above it
    assert bounds((1e-3, 0.0), (1e-2, 1e-2), (1e-1, 0.0)) == (1e-2, 1e-1)  # a failure below a success
    assert bounds((100.0, 100.0)) == (100.0, 100.0)  # the whole range learned
    assert bounds((1e-4, 0.0), (1e-2, 0.0)) == (1e-4, 1e-4)  # nothing learned down to the range's bottom
    assert next_rate((1e-3, 1e-1), []) == 1e-2 and next_rate((0.01, 10.0), []) == 0.316
    assert next_rate((1.0, 1.002), []) == 1.001  # a narrow stretch: more digits
    assert next_rate((1.0, 1.0 + 1e-9), []) == pytest.approx(1.0 + 5e-10, rel=1e-12)
    assert next_rate((100.0, 100.0), []) is None and next_rate((1e-4, 1e-4), [1e-4]) is None  # nothing left to try
    assert next_rate((0.1, math.nextafter(0.1, 1)), []) is None  # no float between


def test_a_search_with_nothing_left_to_try_finishes_short_and_says_so(tmp_path):
    """Every rate up to the range's top (0.1) trained stably: no sample could raise the answer, so
    the searcher asks for none (Tune's FINISHED) and records the bracket; the sweep reads the
    experiment as finished with 2 of its 5 trials, where before the samples repeated 0.1 under one
    trial key and the finished search read as interrupted. Resumed from its saved state, it
    answers the same; with a trial still running, the experiment is not over."""
    import pickle

    from ray import tune
    from ray.tune.search import Searcher

    from altgrad.experiment import SEARCH_FILE, TRIALS_FILE, SweepStatus, TrialStatus
    from altgrad.metrics import STABLE_LR
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch
    from altgrad.tune.trial_spec import trial_key

    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, [
        "preset=cpu", "formats=[e4m3]", "lr={grid: [0.01, 0.1], low: 0.001, high: 0.1, samples: 3}",
        f"storage_path={tmp_path}"])
    (exp,) = LrSearch.experiments(cfg)
    search = exp.search_alg
    search.set_search_properties(None, None, {"lr": tune.loguniform(cfg.lr.low, cfg.lr.high)})
    grid = {trial_id: search.suggest(trial_id)["lr"] for trial_id in ("g0", "g1")}
    index = {trial_id: {"key": trial_key({"key": "e4m3", "lr": lr}), "status": TrialStatus.RUNNING}
             for trial_id, lr in grid.items()}
    for trial_id, lr in grid.items():
        search.on_trial_complete(trial_id, {STABLE_LR: lr})
        index[trial_id]["status"] = TrialStatus.TERMINATED
        if trial_id == "g0":
            assert search.suggest("s0") is None  # the grid still runs: not over
            exp.store.write(TRIALS_FILE, index)
            assert exp.outcome() is SweepStatus.INTERRUPTED
    saved = pickle.dumps(search)
    assert exp.store.read(SEARCH_FILE) is None and exp.outcome() is SweepStatus.INTERRUPTED
    assert search.suggest("s0") == Searcher.FINISHED
    assert exp.store.read(SEARCH_FILE) == {"bracket": [0.1, 0.1], "trials": 2}
    exp.store.write(TRIALS_FILE, index)
    assert exp.total_trials == 5 and exp.outcome() is SweepStatus.FINISHED
    assert pickle.loads(saved).suggest("s0") == Searcher.FINISHED  # resumed
    index["g1"]["status"] = TrialStatus.RUNNING
    exp.store.write(TRIALS_FILE, index)
    assert exp.outcome() is SweepStatus.INTERRUPTED


def test_a_searcher_pickled_under_its_former_name_resumes():
    """An lr search started before the samples left TPE pickled its searcher (tuner.pkl) as
    `GridThenTpe`; Tune's restore reads it back under that name."""
    import pickle

    from altgrad.tune.lr_searcher import GridThenEdge

    GridThenEdge.__qualname__ = "GridThenTpe"  # as that version named the class
    try:
        built = pickle.dumps(GridThenEdge([0.01, 1.0]))
    finally:
        GridThenEdge.__qualname__ = "GridThenEdge"
    assert b"GridThenTpe" in built and type(pickle.loads(built)) is GridThenEdge


def test_the_table_says_what_stable_means_and_on_how_many_runs():
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import what_stable_means

    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", "tolerance=0.25", "base.train.seed=7",
                                                        "base.train.max_steps=30"])
    assert what_stable_means(cfg) == (
        "stable: ran its 30 steps, no val loss over 1 % above its first, the last finite and below the first by "
        "more than 25 %; "
        "each rate ran once (seed 7): near the edge another seed may judge a rate otherwise")


def test_one_verdict_of_stability_for_the_search_and_the_table():
    """What a trial's last report tells the searcher (`sweep/stable_lr`, `sweep/diverged`) is what
    the table says of its record, the same rows fed to each. A run whose val loss rose above its
    first diverged, whatever it fell back to (helper-35's lr-100 run: 10.995, 185991, then 10.826 at
    chance, below its first: 'stable' before, the largest stable rate of its search), but not by a
    chance-level wobble (1e-4 of it). A report the stability stopper ends a trial on is not stable,
    though its val loss fell (a bit-stall stop: Optuna had been told 'stable', the table said not),
    and a stall is not a divergence; a NaN step at the end is."""
    from altgrad.experiment import StopReason
    from altgrad.metrics import BIT_STALL_RATE, DIVERGED, LOSS_IS_NAN, STABLE_LR
    from altgrad.tune.lr_search import judged, why_unstable
    from altgrad.tune.stopper import stability_stop
    from altgrad.tune.trainable import SweepSignals

    limits = StabilityConfig(stall_stop=0.5, stall_stop_reports=2)

    def both(vals: list[float], stall: list[float] | None = None, nan_at_end: bool = False,
             evaluated: bool = True) -> tuple[bool, bool]:
        rows = [{"step": float(i + 1), "val/loss": v, "val/step": float(i + 1 if evaluated else 0),
                 **({BIT_STALL_RATE: stall[i]} if stall else {}),
                 **({LOSS_IS_NAN: 1.0} if nan_at_end and i == len(vals) - 1 else {})} for i, v in enumerate(vals)]
        signals = SweepSignals(limits, 100.0)
        last = [signals.observe(row) for row in rows][-1]
        stop = stability_stop({**rows[-1], **last}, limits)
        record = TrialRecord(trial_id="t", format="e4m3", optimizer="adamw", precision="all", status="TERMINATED",
                             stop_reason=stop["reason"] if stop else StopReason.COMPLETED, history=rows,
                             summary={}, params={"lr": 100.0})
        told = (last[STABLE_LR] > 0, last[DIVERGED] > 0)
        assert told == judged(record, 0.0), (vals, told)
        if told == (False, True) and not stop:
            assert why_unstable(record).startswith("diverged")
        return told

    assert both([10.995, 185991.0, 10.826]) == (False, True)
    assert both([10.995, 10.9, 10.826]) == (True, False)
    assert both([10.995, 10.996, 10.5]) == (True, False)  # a wobble above its first: within the margin
    assert both([10.995, 10.995, 10.995]) == (False, False)  # ran without learning: the search looks above
    assert both([10.0, 9.0, 8.0], stall=[0.0, 0.9, 0.9]) == (False, False)  # stopped for a stall on its last
    assert both([10.0, 9.0, 8.0], stall=[0.0, 0.9, 0.0]) == (True, False)  # the streak broke
    assert both([10.0, 9.0, 8.0], nan_at_end=True) == (False, True)
    # a NaN step at the end of a run whose val loss wobbled within the margin: the step diverged
    wobbled = [{"step": 1.0, "val/loss": 10.0, "val/step": 1.0}, {"step": 2.0, "val/loss": 10.05, "val/step": 2.0},
               {"step": 3.0, "val/loss": 9.0, "val/step": 3.0, LOSS_IS_NAN: 1.0}]
    assert why_unstable(TrialRecord(trial_id="t", format="e4m3", optimizer="adamw", precision="all",
                                    status="TERMINATED", stop_reason="completed", history=wobbled, summary={},
                                    params={"lr": 1.0})) == "diverged (a non-finite step at its end)"
    assert both([10.0, 9.0, 8.0], stall=[0.9, 0.9, 0.9], evaluated=False) == (False, False)  # no evaluation logged



@pytest.mark.parametrize("window", [1, 2])
def test_the_rates_asked_depend_on_the_results_not_on_when_they_came(window):
    """A search's samples are the same whichever order their results come in and whenever a slot
    asks (a resumed search asks again while its restored trials run): one at a time by default,
    each after the one before; with max_concurrent_trials 2, sample i after sample i - 2, by the
    results up to it. helper-35's resumed search asked 1.78 and 0.0562 where the uninterrupted one
    asked 0.316, 1.78 and 0.75."""
    from ray import tune

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    def search_with(order: str) -> list[float]:
        search = GridThenEdge([1e-2, 10.0])
        search.set_search_properties(None, None, {"lr": tune.loguniform(1e-4, 100.0)})
        if window > 1:
            search.set_max_concurrency(window)
        rates = {t: search.suggest(t)["lr"] for t in ("g0", "g1")}
        for t in ("g1", "g0"):
            search.on_trial_complete(t, {STABLE_LR: rates[t] if rates[t] < 0.5 else 0.0})
        samples: list[float] = []
        pending: list[str] = []
        while len(samples) < 4:
            while (asked := search.suggest(f"s{len(samples)}")) is not None:  # every slot asks
                samples.append(asked["lr"])
                pending.append(f"s{len(samples) - 1}")
                if len(pending) > window:  # no more slots than the window
                    raise AssertionError(f"{len(pending)} samples at once")
            # the results come in the order given: the newest first, or the oldest
            done = pending.pop(-1 if order == "newest" else 0)
            lr = samples[int(done[1:])]
            search.on_trial_complete(done, {STABLE_LR: lr if lr < 0.5 else 0.0})
        return samples

    newest, oldest = search_with("newest"), search_with("oldest")
    assert newest == oldest
    if window == 1:  # bisection, towards the edge at 0.5
        assert newest == [0.316, 1.78, 0.75, 0.487]


@pytest.mark.parametrize("limit, waves", [(None, 10), (3, 6)])
def test_the_plan_counts_the_samples_one_window_at_a_time(monkeypatch, limit, waves):
    """Two formats, one after the other, on 4 slots: each its 5 grid points in 2 waves, then its 3
    samples one at a time (3 waves), or 3 at once with max_concurrent_trials 3 (3 slots: 2 + 1)."""
    from altgrad.tune import grid
    from altgrad.tune.config import LrSearchConfig, load_sweep_config
    from altgrad.tune.lr_search import LrSearch

    monkeypatch.setattr(grid, "machine_resources", lambda: (4, 0))
    cfg = load_sweep_config(LrSearchConfig, LR_SEARCH, ["preset=cpu", "formats=[e4m3, e5m2]",
                                                        f"max_concurrent_trials={'null' if limit is None else limit}"])
    plan = LrSearch.describe(cfg, LrSearch.experiments(cfg))
    assert f"16 trials in about {waves} waves of up to {limit or 4}" in plan, plan


def test_where_nothing_trained_the_samples_look_between_too_small_and_too_large():
    """No rate stable: 0.01 ran without learning (`sweep/diverged` 0), 10 diverged. The samples
    look between them (0.316 first), not below 0.01, where a rate smaller still would not learn
    either; a trial told without the attribute (an older version's) counts as diverged, as all did."""
    from ray import tune

    from altgrad.metrics import DIVERGED, STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    for told_diverged, first in ((0.0, 0.316), (1.0, 1e-3), (None, 1e-3)):
        search = GridThenEdge([1e-2, 10.0])
        search.set_search_properties(None, None, {"lr": tune.loguniform(1e-4, 100.0)})
        rates = {t: search.suggest(t)["lr"] for t in ("g0", "g1")}
        search.on_trial_complete("g0", {STABLE_LR: 0.0, **({} if told_diverged is None else {DIVERGED: told_diverged})})
        search.on_trial_complete("g1", {STABLE_LR: 0.0, DIVERGED: 1.0})
        assert rates == {"g0": 1e-2, "g1": 10.0} and search.suggest("s0")["lr"] == first


def test_a_sample_after_an_errored_one_does_not_repeat_its_rate():
    """An errored sample bounds nothing, so the bracket stays as it was; the next sample must not
    be its rate again (one trial key, one trial directory, for two trials)."""
    from ray import tune

    from altgrad.metrics import STABLE_LR
    from altgrad.tune.lr_searcher import GridThenEdge

    search = GridThenEdge([1e-2, 10.0])
    search.set_search_properties(None, None, {"lr": tune.loguniform(1e-4, 100.0)})
    for t in ("g0", "g1"):
        lr = search.suggest(t)["lr"]
        search.on_trial_complete(t, {STABLE_LR: lr if lr < 1 else 0.0})
    first = search.suggest("s0")["lr"]
    search.on_trial_complete("s0", error=True)
    second = search.suggest("s1")["lr"]
    assert first == 0.316 and second not in (first, 1e-2, 10.0) and 1e-2 < second < 10.0
