"""The restart ledger (run/ledger.py): which versions a run's crashed restarts count against."""

import json


def test_restart_ledger_marks_a_version_failed_only_after_two_crashed_restarts_in_a_row(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    ledger = RestartLedger(tmp_path / "restarts.json")
    assert ledger.settle_pending() is None and ledger.failed_steps() == {}
    ledger.begin(300)
    settled = ledger.settle_pending()  # one restart from 300 never confirmed: a node may have died
    assert (settled.step, settled.failed, settled.crashes) == (300, False, 1) and "crashed" in settled.reason
    assert ledger.failed_steps() == {}
    ledger.begin(300)
    ledger.confirm()  # the next one from 300 worked: the crash before is forgotten
    ledger.begin(300)
    assert ledger.settle_pending()[2] is False
    ledger.begin(300)
    settled = ledger.settle_pending()  # a second crash in a row: failed
    assert settled.failed and settled.reason.startswith("2 restarts from it in a row")
    assert list(ledger.failed_steps()) == [300]
    assert ledger.settle_pending() is None  # settled only once
    ledger.begin(250)
    ledger.confirm()
    assert ledger.settle_pending() is None and list(ledger.failed_steps()) == [300]
    # Its files set aside, version 300 no longer counts as failed: a new writing of step 300
    # must be loadable; the reason stays on record.
    ledger.set_aside(300, "v000000000300.failed")
    assert ledger.failed_steps() == {}
    assert "crashed" in json.loads((tmp_path / "restarts.json").read_text())["set_aside"]["v000000000300.failed"]
    # The ranks' own verdict marks a version at once.
    ledger.begin(400)
    ledger.mark_failed(400, "its loss is not finite")
    assert ledger.failed_steps() == {400: "its loss is not finite"} and ledger.settle_pending() is None


def test_a_damaged_restart_ledger_is_set_aside_with_a_warning_and_restarts_go_on(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    said = []
    ledger = RestartLedger(tmp_path / "restarts.json", said.append)
    (tmp_path / "restarts.json").write_text('{"pending": {"step": 3')  # cut short
    assert ledger.settle_pending() is None and ledger.failed_steps() == {}
    assert len(said) == 1 and "restarts.json is damaged" in said[0] and "set aside as restarts.json.damaged" in said[0]
    assert (tmp_path / "restarts.json.damaged").read_text() == '{"pending": {"step": 3'
    ledger.begin(20)
    assert json.loads((tmp_path / "restarts.json").read_text())["pending"]["step"] == 20


def test_a_crashed_restart_under_which_a_node_was_lost_is_not_counted_against_its_version(tmp_path):
    from hpcckpt.run.ledger import RestartLedger

    ledger = RestartLedger(tmp_path / "restarts.json")
    for nodes in (4, 3, 2):  # nodes dying under restarts one after the other
        ledger.begin(300, nodes_with_files=nodes)
        settled = ledger.settle_pending(nodes_with_files=nodes - 1)
        assert (settled.step, settled.failed, settled.counted) == (300, False, False)
        assert "1 node(s) of" in settled.reason and "not counted" in settled.reason
    assert ledger.failed_steps() == {}
    # As many nodes with files as before: the crash is the version's to answer for, twice.
    ledger.begin(300, nodes_with_files=3)
    assert ledger.settle_pending(nodes_with_files=3).counted
    ledger.begin(300, nodes_with_files=3)
    assert ledger.settle_pending(nodes_with_files=4).failed  # a node more (a spare) explains nothing
    assert list(ledger.failed_steps()) == [300]


def test_where_failures_are_frequent_crashed_restarts_mark_a_version_only_once_chance_cannot_explain_them(
        tmp_path, monkeypatch):
    """With failures every 15 s (as configured), restarts that each ran 2 s before the next
    one began are each met by a failure with a chance of 1 - exp(-2/15) = 12.5 %: two crashes
    in a row (1.6 %) and three (0.19 %) do not yet mark the version, four (0.024 %) do.
    Failures every 10 h: two."""
    import time as real_time

    import hpcckpt.run.ledger as ledger_module
    from hpcckpt.run.ledger import RestartLedger

    clock = [1_000_000.0]
    monkeypatch.setattr(ledger_module, "time", type("Clock", (), {
        "time": staticmethod(lambda: clock[0]), "strftime": staticmethod(real_time.strftime),
        "localtime": staticmethod(real_time.localtime)}))
    ledger = RestartLedger(tmp_path / "restarts.json")

    def crashed_restart(rate, step=300):
        ledger.begin(step)
        clock[0] += 2.0
        return ledger.settle_pending(failures_per_second=rate)

    frequent = 1 / 15
    settled = [crashed_restart(frequent) for _ in range(3)]
    assert not any(s.failed for s in settled) and [s.crashes for s in settled] == [1, 2, 3]
    assert "one every 15 s" in settled[1].reason and "chance of 1.6 %" in settled[1].reason, settled[1].reason
    assert "chance of 0.19 %" in settled[2].reason, settled[2].reason
    fourth = crashed_restart(frequent)
    assert fourth.failed and fourth.reason.startswith("4 restarts from it in a row") and "0.024 %" in fourth.reason
    assert list(ledger.failed_steps()) == [300]
    # A confirmed restart forgets the crashes and their chance.
    crashed_restart(frequent, step=200)
    ledger.begin(200)
    ledger.confirm()
    assert "200" not in json.loads((tmp_path / "restarts.json").read_text())["chance"]
    rare = 1 / (10 * 3600)
    assert not crashed_restart(rare, step=100).failed
    assert crashed_restart(rare, step=100).failed


def test_the_failure_rate_the_settings_state():
    from types import SimpleNamespace

    from hpcckpt.config import failures_per_second

    checkpoint = SimpleNamespace(mtbf_hours=0.0)
    none = SimpleNamespace(mtbf_crash_hours=0.0, mtbf_node_hours=0.0, mtbf_two_nodes_hours=0.0)
    assert failures_per_second(checkpoint, none) == 0.0
    assert failures_per_second(SimpleNamespace(mtbf_hours=2.0), none) == 1 / 7200
    by_class = SimpleNamespace(mtbf_crash_hours=1.0, mtbf_node_hours=0.0, mtbf_two_nodes_hours=4.0)
    assert failures_per_second(SimpleNamespace(mtbf_hours=2.0), by_class) == 1 / 3600 + 1 / (4 * 3600)
