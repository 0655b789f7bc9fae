"""Elastic training's pure parts, in this process: the run loop's reaction to each error, ObjectState's commit
and restore, ElasticSampler's split of an epoch over changing worlds, and the driver's discovery parsing,
blacklist, placement and topology, and its watch for hung workers. The jobs themselves are in test_elastic.py."""

from __future__ import annotations

import json
import types

import pytest

pytest.importorskip("rvod._rvod")

from rvod.common import elastic, elastic_variables  # noqa: E402
from rvod.exceptions import HostsUpdatedInterrupt, RvodInternalError, RvodMismatchError  # noqa: E402
from rvod.runner import elastic as driver  # noqa: E402
from rvod.runner.cli import build_parser, job_from_args, parse_args  # noqa: E402
from rvod.runner.hung import Hung, HungWatch  # noqa: E402
from rvod.runner.job import JobSpec  # noqa: E402


class RecordingState(elastic.ObjectState):
    def __init__(self, log, **kwargs):
        self.log = log
        super().__init__(bcast_object=lambda obj, root, name: obj, get_rank=lambda: 0, **kwargs)

    def sync(self):
        self.log.append("sync")
        super().sync()

    def restore(self):
        self.log.append("restore")
        super().restore()


def test_run_restores_after_a_failure_and_not_after_a_host_change():
    log = []
    state = RecordingState(log, steps=[])
    errors = [RvodInternalError("peer died"), HostsUpdatedInterrupt(skip_sync=True), HostsUpdatedInterrupt(False)]

    def train(state, scale):
        state.steps.append(scale)
        log.append(f"train{len(state.steps)}")
        if errors:
            raise errors.pop(0)
        return len(state.steps)

    state.register_reset_callbacks([lambda: log.append("callback")])
    result = elastic.run_fn(train, reset=lambda: log.append("reset"))(state, 2)
    # Nothing is committed here, so a restore or a sync (from rank 0's commit) empties the list again; a
    # change that only removed hosts keeps what the function had done.
    assert log == ["sync", "train1", "restore", "reset", "callback",  # failure: restore the commit
                   "sync", "train1", "reset", "callback",  # hosts only removed: no restore, no sync
                   "train2", "reset", "callback",  # hosts added: no restore, then sync
                   "sync", "train1"]
    assert result == 1


def test_a_mismatch_is_not_retried():
    """A mismatch is a bug in the script: not an RvodInternalError, so the loop lets it through, with no
    restore and no reset, also when a framework wraps it."""
    assert not issubclass(RvodMismatchError, RvodInternalError)
    log = []
    state = RecordingState(log, value=1)

    def train(state):
        raise RvodMismatchError("shapes differ")

    with pytest.raises(RvodMismatchError):
        elastic.run_fn(train, reset=lambda: log.append("reset"))(state)

    class WrappedError(Exception):
        pass

    def wrapped(state):
        raise WrappedError("rvod.tensorflow.adapter.MismatchError: ranks disagree on the shape")

    with pytest.raises(WrappedError):
        elastic.run_fn(wrapped, reset=lambda: log.append("reset"), wrapping_errors=(WrappedError,))(state)
    assert log == ["sync", "sync"]


def test_a_framework_error_carrying_an_internal_error_is_recovered_from():
    """TensorFlow reports an RvodInternalError raised inside a tf.function as its own error naming it: with
    that type in wrapping_errors, the loop restores and resets as for the RvodInternalError itself."""

    class OpError(Exception):
        pass

    log = []
    state = RecordingState(log, value=1)
    errors = [OpError("rvod.exceptions.RvodInternalError: allreduce 'g.0' failed: rank 1 closed its connection")]

    def train(state):
        if errors:
            raise errors.pop()
        return "done"

    assert elastic.run_fn(train, reset=lambda: log.append("reset"), wrapping_errors=(OpError,))(state) == "done"
    assert log == ["sync", "restore", "reset", "sync"]
    with pytest.raises(OpError):
        elastic.run_fn(lambda state: (_ for _ in ()).throw(OpError("RvodInternalError")), reset=lambda: None)(state)


def test_object_state_commits_copies_and_restores_them():
    state = RecordingState([], counter=[0, 0], epoch=0)
    state.counter[0] += 5
    state.epoch = 2
    state.commit()
    state.counter[1] += 7  # changed in place after the commit
    state.epoch = 3
    state.restore()
    assert (state.counter, state.epoch) == ([5, 0], 2)


def test_sampler_splits_what_is_left_when_the_world_changes(monkeypatch):
    torch = pytest.importorskip("torch")
    from rvod.torch.elastic import sampler as sampler_module

    world = {"rank": 0, "size": 3}
    monkeypatch.setattr(sampler_module, "rank", lambda: world["rank"])
    monkeypatch.setattr(sampler_module, "size", lambda: world["size"])
    dataset = torch.utils.data.TensorDataset(torch.arange(11))
    sampler = sampler_module.ElasticSampler(dataset, shuffle=True, seed=4)
    assert len(sampler) == 4  # 11 samples over 3 ranks, padded to 12
    first = [sampler.get_indices(0, 2, r) for r in range(3)]
    assert sorted(sum(first, [])) == sorted(set(sum(first, []))) and len(sum(first, [])) == 6
    sampler.record_batch(0, 2)  # every rank's batch 0, as every rank records it
    assert sampler.processed_indices == set(sum(first, []))

    world.update(rank=1, size=2)
    sampler.reset()
    left = sorted(set(range(11)) - sampler.processed_indices)
    assert sorted(sampler.remaining_indices) == left
    seen = [i for r in range(2) for b in range(len(sampler)) for i in sampler.get_indices(b, 1, r)]
    assert sorted(seen) == left  # padding left out: each remaining sample once
    assert len(list(iter(sampler))) == len(sampler) == 3

    state = sampler.state_dict()
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and len(sampler.remaining_indices) == 11
    sampler.load_state_dict(state)
    assert sorted(sampler.remaining_indices) == left


def test_discovery_output_is_parsed_with_default_slots():
    assert driver.parse_discovery_output("a:2\n\n# comment\nb\nc:1 # spare\n", 3) == {"a": 2, "b": 3, "c": 1}
    assert driver.parse_discovery_output("a\n", None) == {"a": 1}
    with pytest.raises(ValueError, match=r"line 2: expected 'host' or 'host:slots' with slots >= 1, got 'b:0'"):
        driver.parse_discovery_output("a:1\nb:0\n", None)


def test_blacklist_cooldown_doubles_and_without_a_range_lasts_for_good():
    forever = driver.Blacklist(None)
    assert forever.add("a", 100.0) == "host a is blacklisted"
    assert forever.blocked("a", 1e12) and forever.for_good("a") and not forever.blocked("b", 0.0)
    cooling = driver.Blacklist((2, 2))
    assert cooling.add("a", 100.0) == "host a is blacklisted for 2.0 s (failure 1)"
    assert cooling.blocked("a", 101.9) and not cooling.blocked("a", 102.1)
    assert cooling.add("a", 200.0) == "host a is blacklisted for 4.0 s (failure 2)"
    assert cooling.blocked("a", 203.9) and not cooling.blocked("a", 204.1) and not cooling.for_good("a")


def test_topology_of_a_world_with_interleaved_hosts():
    slots = driver.topology([(7, "a"), (3, "b"), (9, "a")])
    assert [(s.rank, s.size, s.hostname, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in (slots[7], slots[3], slots[9])] == [
        (0, 3, "a", 0, 2, 0, 2), (1, 3, "b", 0, 1, 1, 2), (2, 3, "a", 1, 2, 0, 1)]


def _driver(min_np, max_np, hosts):
    settings = driver.ElasticSettings(min_np=min_np, max_np=max_np, discovery_script=None, fixed_hosts=None,
                                      slots_per_host=None, elastic_timeout=1.0, reset_limit=None,
                                      cooldown_range=None)
    job = driver.ElasticDriver(settings, driver.ProcessLauncher(JobSpec(), ["true"], None), lambda: hosts,
                               engine_settings={})
    job.hosts = hosts
    return job


def _worker(job, worker_id, host, rank):
    process = types.SimpleNamespace(returncode=None)
    job.workers.append(driver._ElasticWorker(worker_id, host, process, rank=rank))
    return job.workers[-1]


def test_plan_keeps_survivors_first_and_fills_free_slots_up_to_max_np():
    job = _driver(2, 4, {"a": 2, "b": 1, "c": 3})
    second, first = _worker(job, 2, "b", 1), _worker(job, 1, "c", 0)
    kept, added = job._plan(0.0)
    assert kept == [first, second] and added == ["a", "a"]
    job.blacklist.add("a", 0.0)
    kept, added = job._plan(0.0)
    assert kept == [first, second] and added == ["c", "c"]
    job.hosts = {"a": 2}
    assert job._plan(0.0) is None  # a is blacklisted, b and c are gone: fewer than --min-np


class RecordingStore:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


def test_a_worker_told_to_leave_that_still_runs_is_told_again_in_every_later_world():
    """A worker reads only the latest world: one that missed the world telling it to leave (it was busy failing a
    collective, say) must find {"leave": true} in the next, not wait for a place that never comes."""
    job = _driver(1, 2, {"a": 1, "b": 1})
    first, second = _worker(job, 1, "a", 0), _worker(job, 2, "b", 1)
    store = RecordingStore()
    job.blacklist.add("b", 0.0)
    assert job._form("failure", 0.0, store)
    assert json.loads(store.values[f"elastic/round/{job.round}/assign/2"]) == {"leave": True}
    assert second.leaving and json.loads(store.values[f"elastic/round/{job.round}/assign/1"])["rank"] == 0
    assert job._form("removed", 0.0, store)  # the leaver has not exited yet
    assert json.loads(store.values[f"elastic/round/{job.round}/assign/2"]) == {"leave": True}
    second.process.returncode = 0  # once it has exited, later worlds name it no more
    assert job._form("removed", 0.0, store)
    assert f"elastic/round/{job.round}/assign/2" not in store.values
    assert json.loads(store.values[f"elastic/round/{job.round}/assign/1"])["size"] == 1
    assert first.rank == 0


@pytest.mark.timeout(120)
def test_tensorflow_state_commits_restores_and_syncs_variables():
    tf = pytest.importorskip("tensorflow")
    import rvod.tensorflow as hvd

    hvd.init()
    try:
        weights = tf.Variable([1.0, 2.0])
        state = hvd.elastic.TensorFlowState([weights], epoch=0)
        weights.assign([3.0, 4.0])
        state.epoch = 1
        state.commit()
        weights.assign([5.0, 6.0])
        state.epoch = 2
        state.restore()
        assert weights.numpy().tolist() == [3.0, 4.0] and state.epoch == 1
        state.sync()  # one rank: its own values
        assert weights.numpy().tolist() == [3.0, 4.0] and state.epoch == 1
    finally:
        hvd.shutdown()


def _keras_model(keras, built=True):
    layers = [keras.layers.Dense(3), keras.layers.Dense(1)]
    return keras.Sequential(([keras.Input((4,))] if built else []) + layers)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shim", ["tensorflow", "keras"])
def test_keras_model_state_commits_restores_and_syncs_model_and_optimizer(monkeypatch, shim):
    """rvod.tensorflow.elastic.TensorFlowKerasState and rvod.keras.elastic.KerasState (one logic, in
    rvod.common.elastic.KerasModelState): Keras 3 builds an optimizer's variables at its first step, so the
    state builds them when it is made (a rank that has not trained has them for sync() to fill), and
    commits, restores and syncs the model's and the optimizer's variables with the named objects."""
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import importlib

    import numpy as np

    hvd = importlib.import_module(f"rvod.{shim}")
    state_class = hvd.elastic.TensorFlowKerasState if shim == "tensorflow" else hvd.elastic.KerasState
    assert issubclass(state_class, elastic_variables.KerasModelState)
    hvd.init()
    try:
        with pytest.raises(ValueError, match="Model must be built first"):
            state_class(_keras_model(keras, built=False), keras.optimizers.SGD(0.1))
        model = _keras_model(keras)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        assert not optimizer.built
        state = state_class(model, optimizer, epoch=0)
        assert optimizer.built  # momentums and iteration count exist before the first step

        def values():
            return [np.array(keras.ops.convert_to_numpy(v)) for v in model.variables + list(optimizer.variables)]

        def train_one_step():
            x, y = tf.ones((2, 4)), tf.zeros((2, 1))
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        train_one_step()
        state.epoch = 1
        state.commit()
        committed = values()
        train_one_step()
        state.epoch = 2
        assert any(not np.array_equal(a, b) for a, b in zip(values(), committed))
        state.restore()
        assert all(np.array_equal(a, b) for a, b in zip(values(), committed)) and state.epoch == 1
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 1
        train_one_step()
        state.sync()  # one rank: its own values become the commit
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2
        state.restore()
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 2
        compiled = _keras_model(keras)
        compiled.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        assert state_class(compiled).optimizer is compiled.optimizer  # default: the model's optimizer
    finally:
        hvd.shutdown()


@pytest.mark.timeout(120)
def test_tensorflow_run_recovers_from_a_collective_failing_inside_a_tf_function():
    """A collective that fails inside a tf.function reaches hvd.elastic.run as TensorFlow's error, which
    names the RvodInternalError: the state is restored and the function runs again (in a one-rank job, the
    reset restarts the engine)."""
    tf = pytest.importorskip("tensorflow")
    import rvod.tensorflow as hvd

    def fail():
        raise RvodInternalError("allreduce 'g.0' failed: rank 1 closed its connection")

    @tf.function
    def step():
        return tf.py_function(fail, [], tf.float32)

    hvd.init()
    try:
        weights = tf.Variable([1.0])
        state = hvd.elastic.TensorFlowState([weights], runs=0)
        runs = []

        @hvd.elastic.run
        def train(state):
            runs.append(state.runs)
            weights.assign([2.0])
            state.runs += 1
            if len(runs) == 1:
                step()
            return float(weights.numpy()[0])

        assert train(state) == 2.0 and runs == [0, 0]
    finally:
        hvd.shutdown()


def test_elastic_flags_become_settings_or_a_clear_error():
    from rvod.runner.cli import build_parser, job_from_args, parse_args

    def settings(*flags):
        return driver.elastic_settings(job_from_args(parse_args(build_parser(), [*flags, "true"])), None)

    chosen = settings("--min-num-proc", "2", "--max-num-proc", "4", "--host-discovery-script", "./hosts.sh",
                      "--slots-per-host", "3", "--reset-limit", "5", "--blacklist-cooldown-range", "10", "20")
    assert (chosen.min_np, chosen.max_np, chosen.discovery_script, chosen.slots_per_host, chosen.reset_limit,
            chosen.cooldown_range, chosen.elastic_timeout) == (2, 4, "./hosts.sh", 3, 5, (10, 20), 600.0)
    assert settings("-np", "3", "--host-discovery-script", "x", "--elastic-timeout", "30").min_np == 3
    with pytest.raises(ValueError, match="--max-np at least --min-np"):
        settings("--min-np", "3", "--max-np", "2", "--host-discovery-script", "x")
    with pytest.raises(ValueError, match="needs 0 <= MIN <= MAX, got 20 10"):
        settings("--min-np", "1", "--host-discovery-script", "x", "--blacklist-cooldown-range", "20", "10")
    with pytest.raises(ValueError, match="needs --host-discovery-script"):
        settings("--min-np", "1")


def test_elastic_timeout_defaults_to_the_environment(monkeypatch):
    """horovodrun's --elastic-timeout defaults to HOROVOD_ELASTIC_TIMEOUT (rvod's name first), which is also
    how rvod.run, which has no such argument, is given one."""
    from rvod.runner.cli import build_parser, job_from_args, parse_args

    def timeout(*flags):
        options = parse_args(build_parser(), [*flags, "--min-np", "1", "-H", "a:1", "true"])
        return driver.elastic_settings(job_from_args(options), []).elastic_timeout

    monkeypatch.delenv("RVOD_ELASTIC_TIMEOUT", raising=False)
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "45")
    assert timeout() == 45.0
    monkeypatch.setenv("RVOD_ELASTIC_TIMEOUT", "7.5")
    assert (timeout(), timeout("--elastic-timeout", "3")) == (7.5, 3.0)
    monkeypatch.setenv("RVOD_ELASTIC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RVOD_ELASTIC_TIMEOUT must be a number of seconds, got 'soon'"):
        timeout()


@pytest.mark.timeout(60)
def test_object_state_needs_no_framework_and_syncs_from_rank_0():
    from rvod.common import basics

    basics.init()
    try:
        state = elastic.ObjectState(epoch=3, history=[1])
        state.epoch = 4
        state.commit()
        state.history.append(2)
        state.sync()  # one rank: rank 0's commit
        assert (state.epoch, state.history) == (4, [1])
    finally:
        basics.shutdown()


def _beat(count, round_=None, hung=()):
    value = {"beat": count}
    if round_ is not None:
        value.update(round=round_, hung=[list(h) for h in hung])
    return json.dumps(value).encode()


def test_hung_watch_finds_a_worker_whose_beats_stop_after_the_hung_time():
    watch = HungWatch(4.0)
    assert watch.interval == 0.5
    assert watch.check({1: _beat(1), 2: _beat(1), 3: None}, 1, {0: 1, 1: 2}, 0.0) == []
    assert watch.check({1: _beat(2), 2: _beat(1), 3: None}, 1, {0: 1, 1: 2}, 3.9) == []
    # Worker 2 stopped beating at 0.0; worker 3 never beat (not in init() yet): not judged.
    found = watch.check({1: _beat(3), 2: _beat(1), 3: None}, 1, {0: 1, 1: 2}, 4.1)
    assert found == [Hung(2, "sent no heartbeat for 4.1 s (its process is stopped, frozen or cut off from the driver)")]
    assert watch.check({1: _beat(4), 2: _beat(2)}, 1, {0: 1, 1: 2}, 8.0) == [], "beating again"
    assert watch.check({1: _beat(5), 2: b"not json", 4: _beat(1)}, 1, {0: 1, 1: 2}, 12.1)[0].worker == 2


def test_hung_watch_takes_a_rank_named_by_a_worker_of_the_running_world():
    watch = HungWatch(3.0)
    ranks = {0: 10, 1: 11, 2: 12}
    named = _beat(7, round_=2, hung=[(2, 3.25, ["allreduce.grad"])])
    found = watch.check({10: named, 11: _beat(1), 12: _beat(1)}, 2, ranks, 0.0)
    assert found == [Hung(12, "made no progress for 3.2 s: it has not submitted [allreduce.grad], which the other "
                              "ranks wait on (found by rank 0)")]
    stale = _beat(8, round_=1, hung=[(2, 9.0, ["allreduce.grad"])])
    assert watch.check({10: stale, 11: _beat(2), 12: _beat(2)}, 2, ranks, 0.5) == [], "a report of an older world"
    assert watch.check({10: named, 11: _beat(3)}, 2, ranks, 1.0) == [], "worker 12 is gone already"
    bad = _beat(9, round_=2, hung=[("x",), (5, 1.0, [])])
    assert watch.check({10: bad, 11: _beat(4), 12: _beat(4)}, 2, ranks, 1.5) == [], "malformed or unknown ranks"


def test_elastic_hung_timeout_comes_from_the_flag_or_the_environment_and_a_bad_value_is_named(monkeypatch):
    options = parse_args(build_parser(), ["--min-np", "2", "--host-discovery-script", "x", "--elastic-hung-timeout",
                                          "2.5", "true"])
    assert job_from_args(options).engine_env()["RVOD_ELASTIC_HUNG_TIMEOUT"] == "2.5"
    monkeypatch.delenv("RVOD_ELASTIC_HUNG_TIMEOUT", raising=False)
    monkeypatch.setenv("RVOD_TIMEOUT", "10")
    assert driver._hung_watch({}).timeout == 5.0, "half of RVOD_TIMEOUT when shorter than 30 s"
    assert driver._hung_watch({"RVOD_ELASTIC_HUNG_TIMEOUT": "2.5"}).timeout == 2.5
    assert driver._hung_watch({"RVOD_ELASTIC_HUNG_TIMEOUT": "0"}) is None
    monkeypatch.setenv("RVOD_ELASTIC_HUNG_TIMEOUT", "soon")
    with pytest.raises(driver.ElasticFailure, match='invalid environment variable RVOD_ELASTIC_HUNG_TIMEOUT="soon"'):
        driver._hung_watch({})
