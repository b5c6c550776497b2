"""The tuning database: measured winners persist and are reused, bucketing, version invalidation, pinning, a corrupt
file, concurrent writers, the tuning budget."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from fly_lightning import DISPATCH_LOG, dispatch_config, tuning
from fly_lightning.dispatch import Op


def _op(costs: dict[str, float], calls: list[str]) -> Op:
    """A private op whose backends take known times (seconds) and log their calls."""
    op = Op(name="scratch", reference=lambda x: x * 2, signature=lambda x: (x.shape, x.dtype))

    def make(backend):
        def fn(x):
            calls.append(backend)
            time.sleep(costs[backend])
            return x * 2

        return fn

    op.implement("aten")(make("aten"))
    op.implement("triton")(make("triton"))
    return op


def _db() -> tuning.TuningDB:
    return tuning.active_db()


def test_measured_winner_is_written_and_reused_by_a_later_process():
    calls: list[str] = []
    with dispatch_config(select="measure"):
        _op({"aten": 0.004, "triton": 0.0}, calls)(torch.ones(3))
    assert DISPATCH_LOG.records("scratch")[0]["backend"] == "triton"
    ((env, op, key, entry),) = list(_db().entries())
    assert op == "scratch" and entry["backend"] == "triton" and set(entry["timings_ms"]) == {"aten", "triton"}
    assert key == "4 float32 c | " and env.startswith("cpu | torch ")  # 3 rows bucketed to 4
    # a new process: nothing cached in memory, the database answers without timing anything
    DISPATCH_LOG.reset()
    calls.clear()
    with dispatch_config(select="measure"):
        _op({"aten": 0.0, "triton": 0.004}, calls)(torch.ones(4))  # triton now slower: the stored winner still holds
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "triton" and rec["tuning_s"] == 0.0 and calls == ["triton"]
    assert "tuning database: triton measured earlier" in rec["reason"]


def test_bucketing_of_the_leading_dimension():
    key = lambda n: tuning.tuning_key((torch.ones(n, 8), 2, True))  # noqa: E731
    assert key(3000) == key(4096) == "4096x8 float32 c | 2, True"
    assert key(4097) != key(4096)
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 5, 1024, 1025)] == [0, 1, 2, 4, 8, 1024, 2048]
    assert tuning.tuning_key((torch.ones(4, 6).t(),)) == "8x4 float32 t | "


def test_an_upgrade_measures_again(monkeypatch):
    calls: list[str] = []
    with dispatch_config(select="measure"):
        _op({"aten": 0.0, "triton": 0.003}, calls)(torch.ones(2))
    monkeypatch.setattr(tuning, "_version", lambda dist: "9.9" if dist == "triton" else "-")
    DISPATCH_LOG.reset()
    with dispatch_config(select="measure"):
        _op({"aten": 0.003, "triton": 0.0}, calls)(torch.ones(2))
    assert DISPATCH_LOG.records("scratch")[0]["backend"] == "triton"  # measured, not read from the old entry
    assert len({env for env, *_ in _db().entries()}) == 2


def test_a_pinned_entry_wins_and_is_never_overwritten():
    env = tuning.environment_key(torch.device("cpu"))
    key = tuning.tuning_key((torch.ones(2),))
    _db().pin(env, "scratch", key, "aten")
    calls: list[str] = []
    with dispatch_config(select="measure"):
        _op({"aten": 0.003, "triton": 0.0}, calls)(torch.ones(2))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "aten" and calls == ["aten"] and "aten pinned" in rec["reason"]
    assert _db().put(env, "scratch", key, "triton", {"triton": 0.1}, replace=True)["backend"] == "aten"
    assert _db().get(env, "scratch", key)["backend"] == "aten"


def test_a_corrupt_file_warns_and_is_rebuilt(tmp_path):
    path = tuning.active_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": "fly-lightning tuning db", "version": 1, "environments": {"x": ')  # truncated
    calls: list[str] = []
    with pytest.warns(UserWarning, match="unreadable"), dispatch_config(select="measure"):
        _op({"aten": 0.002, "triton": 0.0}, calls)(torch.ones(2))
    assert DISPATCH_LOG.records("scratch")[0]["backend"] == "triton"
    assert json.loads(path.read_text())["format"] == "fly-lightning tuning db"
    assert list(path.parent.glob("tuning.json.corrupt-*"))  # the bad file is kept aside, not silently lost


def test_a_reader_never_moves_the_file_only_a_writer_under_the_lock(tmp_path):
    """A reader that moved a bad file aside could take away the good one a writer had just put there."""
    path = tmp_path / "tuning.json"
    path.write_text('{"format": "fly-lightning tuning db", "version": 99, "environments": {}}')
    with pytest.warns(UserWarning, match="nothing tuned is used"):
        assert tuning.TuningDB(path).get("env", "op", "k") is None
    assert path.exists() and not list(tmp_path.glob("*.corrupt-*"))
    with pytest.warns(UserWarning, match="moved to"):
        tuning.TuningDB(path).put("env", "op", "k", "triton", {"triton": 1.0})
    assert len(list(tmp_path.glob("tuning.json.corrupt-*"))) == 1
    assert tuning.TuningDB(path).get("env", "op", "k")["backend"] == "triton"


@pytest.mark.parametrize(
    "entry",
    [{"backend": "triton", "timings_ms": None}, {"backend": "triton", "timings_ms": {"triton": "1"}},
     {"backend": "triton", "detail": [1]}],
)  # fmt: skip
def test_entries_that_callers_cannot_read_make_the_file_malformed(tmp_path, entry):
    path = tmp_path / "tuning.json"
    data = {"format": "fly-lightning tuning db", "version": tuning.VERSION, "environments": {"e": {"op": {"k": entry}}}}
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="malformed"):
        assert tuning.TuningDB(path).get("e", "op", "k") is None


def test_a_path_that_cannot_be_looked_at_reads_as_empty(tmp_path):
    (tmp_path / "file").write_text("")
    db = tuning.TuningDB(tmp_path / "file" / "tuning.json")  # a regular file where a directory should be
    with pytest.warns(UserWarning, match="cannot be read"):
        assert db.get("e", "op", "k") is None


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "tuning.json"
    path.mkdir()  # a directory in the file's place: the final rename fails
    with pytest.warns(UserWarning), pytest.raises(OSError):
        tuning.TuningDB(path).put("e", "op", "k", "triton", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json", "tuning.json.lock"]


@pytest.mark.parametrize("value", ["120s", "nan", "-5"])
def test_a_bad_budget_is_named_and_the_default_used(monkeypatch, value):
    monkeypatch.setenv("FLY_LIGHTNING_TUNING_BUDGET_S", value)
    tuning._warn_budget.cache_clear()
    with pytest.warns(UserWarning, match="FLY_LIGHTNING_TUNING_BUDGET_S"):
        assert tuning.budget_s() == tuning.DEFAULT_BUDGET_S


_WRITER = """
import sys
from fly_lightning.tuning import TuningDB
db = TuningDB(sys.argv[1])
for i in range(25):
    db.put("env", "op", f"{sys.argv[2]}-{i}", "triton", {"triton": 1.0})
"""


def test_four_processes_writing_at_once_lose_nothing():
    path = str(tuning.active_path())
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, path, f"w{w}"]) for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    keys = {key for _, _, key, _ in tuning.TuningDB(path).entries()}
    assert keys == {f"w{w}-{i}" for w in range(4) for i in range(25)}


def test_the_tuning_budget_bounds_measurement(monkeypatch):
    monkeypatch.setenv("FLY_LIGHTNING_TUNING_BUDGET_S", "0")
    calls: list[str] = []
    with dispatch_config(select="measure"):
        _op({"aten": 0.0, "triton": 0.003}, calls)(torch.ones(2))
    rec = DISPATCH_LOG.records("scratch")[0]
    assert rec["backend"] == "triton" and calls == ["triton"]  # the first supported candidate, not timed
    assert "tuning budget (0 s) spent" in rec["reason"]


def test_off_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("FLY_LIGHTNING_TUNING_DB", "off")
    assert tuning.active_db() is None
    with dispatch_config(select="measure"):
        _op({"aten": 0.0, "triton": 0.002}, [])(torch.ones(2))
    assert DISPATCH_LOG.records("scratch")[0]["backend"] == "aten"
    assert not list(tmp_path.glob("*.json"))


def test_prune_keeps_pinned_entries_and_the_current_environment():
    db = _db()
    db.put("old", "a", "k1", "triton", {})
    db.put("old", "a", "k2", "aten", {})
    db.pin("old", "a", "k3", "aten")
    db.put("new", "a", "k1", "triton", {})
    assert db.prune(keep_env="new") == 2
    assert sorted((env, key) for env, _, key, _ in db.entries()) == [("new", "k1"), ("old", "k3")]


_RANK = """
import sys, time, torch
from fly_lightning import DISPATCH_LOG, dispatch_config
from fly_lightning.dispatch import Op
fast = sys.argv[1]  # each process finds a different backend faster
op = Op(name="scratch", reference=lambda x: x * 2, signature=lambda x: (x.shape, x.dtype))
for b in ("aten", "triton"):
    op.implement(b)(lambda x, b=b: (time.sleep(0 if b == fast else 0.01), x * 2)[1])
while time.time() < float(sys.argv[2]):  # start measuring together
    time.sleep(0.001)
with dispatch_config(select="measure"):
    op(torch.ones(4))
print(DISPATCH_LOG.records("scratch")[0]["backend"])
"""


def test_processes_measuring_one_shape_at_once_take_one_choice():
    """Two ranks on one host disagree on the fastest backend; both take the one stored first."""
    start = time.time() + 8  # past both imports
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, fast, str(start)], stdout=subprocess.PIPE, text=True)
        for fast in ("aten", "triton")
    ]
    chosen = [p.communicate(timeout=120)[0].split()[-1] for p in procs]
    assert chosen[0] == chosen[1]
    ((_, _, _, entry),) = list(_db().entries())
    assert entry["backend"] == chosen[0]


_GLOO_RANK = """
import json, sys, time, torch, torch.distributed as dist
from fly_lightning import DISPATCH_LOG, dispatch_config, tuning
from fly_lightning.dispatch import Op
rank, init, fast = int(sys.argv[1]), sys.argv[2], sys.argv[3]  # each rank (a host of its own) finds another faster
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
calls = []
op = Op(name="scratch", reference=lambda x: x * 2, signature=lambda x: (x.shape, x.dtype))
for b in ("aten", "triton"):
    op.implement(b)(lambda x, b=b: (calls.append(b), time.sleep(0 if b == fast else 0.01), x * 2)[-1])
with dispatch_config(select="measure"):
    op(torch.ones(4))
    measured = DISPATCH_LOG.records("scratch")[0]["backend"]
    changed = tuning.agree_across_ranks()
    calls.clear()
    op(torch.ones(4))  # the same shape: the agreed backend runs
    if rank == 1:
        op(torch.ones(16))  # a shape only this rank has seen: agreed at the next agreement, by rank 1's choice
    tuning.agree_across_ranks()
    if rank == 0:
        op(torch.ones(16))  # rank 0 meets it later: it takes the agreed choice without measuring
rec = {r["shape"]: r for r in DISPATCH_LOG.records("scratch")}
print(json.dumps({"measured": measured, "changed": changed, "calls": calls, "backend": rec["4"]["backend"],
                  "later": rec["16"]["backend"], "later_reason": rec["16"]["reason"]}))
dist.barrier()  # neither rank tears gloo down while the other still talks to it
dist.destroy_process_group()
"""


def test_two_gloo_ranks_agree_on_one_choice(tmp_path):
    """Two ranks with a tuning file each (as on two hosts) measure opposite winners; after the agreement both run
    rank 0's choice, and rank 1's file holds it too (its next run agrees from the start)."""
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GLOO_RANK, str(rank), init, fast],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "FLY_LIGHTNING_TUNING_DB": str(tmp_path / f"host{rank}.json")},
        )
        for rank, fast in ((0, "triton"), (1, "aten"))
    ]
    out = [json.loads(p.communicate(timeout=180)[0].splitlines()[-1]) for p in procs]
    assert [o["measured"] for o in out] == ["triton", "aten"]  # each rank's own measurement differed
    assert [o["backend"] for o in out] == ["triton", "triton"] and [o["changed"] for o in out] == [0, 1]
    assert out[1]["calls"][0] == "triton"  # after agreement rank 1 runs rank 0's choice
    assert [o["later"] for o in out] == ["aten", "aten"]  # the shape only rank 1 measured: its choice, on both
    assert "agreed across ranks" in out[0]["later_reason"]
    host1 = tuning.TuningDB(tmp_path / "host1.json")
    stored = {key: e["backend"] for _, _, key, e in host1.entries()}
    assert stored == {"4 float32 c | ": "triton", "16 float32 c | ": "aten"}


def test_agreement_points():
    assert [s for s in range(1, 40) if tuning.agreement_due(s)] == [2, 3, 5, 9, 17, 33]
    assert tuning.agreement_due(513) and tuning.agreement_due(1025) and not tuning.agreement_due(600)


def test_a_database_that_cannot_be_read_never_stops_a_run(tmp_path):
    """A path that is a directory reads as empty (left where it is); malformed entries read as empty, and the next
    write moves the file aside; all warn. ``read_only`` (the CLI's ``show``) raises instead and touches nothing."""
    with pytest.warns(UserWarning, match="cannot be read"):
        assert tuning.TuningDB(tmp_path).get("cpu", "rms_norm", "k") is None
    bad = tmp_path / "db.json"
    bad.write_text(json.dumps({"format": tuning.FORMAT, "version": tuning.VERSION, "environments": {"cpu": {"x": []}}}))
    with pytest.raises(ValueError, match="malformed entries"):
        tuning.TuningDB(bad, read_only=True).get("cpu", "x", "k")
    assert bad.exists()
    with pytest.warns(UserWarning, match="malformed entries"):
        assert tuning.TuningDB(bad).get("cpu", "x", "k") is None
    assert bad.exists()
    with pytest.warns(UserWarning, match="malformed entries.*moved to"):
        tuning.TuningDB(bad).put("cpu", "x", "k", "aten", {})
    assert any(p.name.startswith("db.json.corrupt-") for p in tmp_path.iterdir())
