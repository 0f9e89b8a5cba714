"""The README's library example, run as written on real ranks, then resumed after a crash."""

import re

from conftest import REPO, assert_ok, run_script


def _readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it as a library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _target(example: str, last: int) -> str:
    return example.replace('range(loop["step"] + 1, 41)', f'range(loop["step"] + 1, {last + 1})').replace(
        "last=step == 40", f"last=step == {last}")


def test_readme_library_example_runs_and_resumes(tmp_path):
    example = _readme_example()
    script = tmp_path / "loop.py"
    script.write_text(example)
    first = run_script(4, script, [], cwd=tmp_path)
    assert_ok(first)
    assert "finished at step 40" in first.stdout
    expected_sum = sum(range(1, 41)) * 512 * 64 * 1.0
    assert f"weights sum {expected_sum}" in first.stdout
    assert f"field sum {sum(range(1, 41)) * 1000.0}" in first.stdout
    assert re.search(r"checkpoint interval now \d+ steps", first.stdout), first.stdout  # "auto" chose one
    assert (tmp_path / "example-run" / "pfs" / "v000000000040" / "manifest.json").is_file()  # close() left it on L4
    # Started again with nothing left to do, twice: the clean close() confirms each restart, so
    # version 40 is never marked failed (it used to be, and then moved aside).
    for _ in range(2):
        again = run_script(4, script, [], cwd=tmp_path)
        assert_ok(again)
        assert f"finished at step 40 weights sum {expected_sum}" in again.stdout
    ledger = tmp_path / "example-run" / "restarts.json"
    assert not ledger.exists() or '"failed": {}' in ledger.read_text(), ledger.read_text()

    # Crash at step 55 of a run that resumed at 40 with a higher target: it resumes from its
    # newest version (40 or later) and must end with the numbers of an uninterrupted run.
    crashing = tmp_path / "crash.py"
    crashing.write_text(_target(example, 60).replace(
        '            loop["step"] = step\n',
        '            loop["step"] = step\n            if step == 55 and comm.rank == 1:\n'
        '                import os; os._exit(9)\n'))
    crashed = run_script(4, crashing, [], cwd=tmp_path)
    assert crashed.returncode != 0
    finishing = tmp_path / "finish.py"
    finishing.write_text(_target(example, 60))
    done = run_script(4, finishing, [], cwd=tmp_path)
    assert_ok(done)
    assert f"weights sum {sum(range(1, 61)) * 512 * 64 * 1.0} field sum {sum(range(1, 61)) * 1000.0}" in done.stdout
    assert "finished at step 60" in done.stdout
