"""commit_step's agreement beside the save pipeline's threads (cluster/mpi_gate.py), on real
ranks of the ULFM MPI with MPI_THREAD_MULTIPLE, the ULFM launch's default.

Open MPI 5's agreement, with another thread of the rank inside MPI, returns outcomes no rank
gave (0, once an unrelated integer): 13 and 23 rounds in 20,000 of this very script with the
gate turned into a no-op. Each such round in a job is a recovery from a failure that never
happened, or, where the outcome is uneven, ranks left waiting in an agreement."""

from __future__ import annotations

import json

from conftest import REPO, run_ulfm_script

AGREE_BESIDE_THREADS = REPO / "perf" / "agree_beside_threads.py"


def test_no_agreement_outcome_goes_wrong_while_the_library_s_threads_exchange_beside_it(tmp_path):
    proc = run_ulfm_script(4, AGREE_BESIDE_THREADS, ["20000", "--gated"], tmp_path, timeout=180,
                           env={"MPI4PY_RC_THREAD_LEVEL": "multiple"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # The threads were inside MPI throughout: thousands of exchanges beside the agreements.
    assert result["traffic_rounds"] >= 200, result
    assert result["rounds_bad"] == 0 and result["bad_by_rank"] == [0, 0, 0, 0], result
