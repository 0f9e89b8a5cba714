"""What a run keeps about itself, below both the save (ckpt/) and the restore (restore/flow.py,
restore/): its identity (run_identity.py), the restart ledger (ledger.py), the settings its
versions were written with (settings_record.py), and how a commit record is read, a damaged
one set aside (records.py)."""
