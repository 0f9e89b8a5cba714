"""What a run keeps about itself, below both the save (save/) and the restore (restore/): its
identity (run_identity.py), its lease (lease.py: one job at a time), its directories and level
stack (job_storage.py), the restart ledger (ledger.py), the settings its versions were written
with (settings_record.py), and how a commit record is read, a damaged one set aside (records.py)."""
