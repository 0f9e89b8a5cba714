"""The project's own environment variables that are not configuration keys. Every other
HPCCKPT_* variable is read as a config override (HPCCKPT_<SECTION>_<KEY>, config.py), where a
misspelt one is an error rather than ignored, so each variable the project, its launchers or
its job scripts set for another purpose is named here (tests/test_config.py checks the
repository for any other)."""

ATTEMPT_VARIABLE = "HPCCKPT_ATTEMPT"  # the restart loop's attempt counter (faults.py)
EXIT_FILE_VARIABLE = "HPCCKPT_EXIT_FILE"  # where the ranks record their exit code (exit_record.py)
ULFM_PREFIX_VARIABLE = "HPCCKPT_ULFM_PREFIX"  # where the ULFM MPI is installed (cluster/launcher.py)
# Shell arrays of the job scripts (jobs/): never exported, named so that one never becomes a key.
JOB_SCRIPT_NAMES = ("HPCCKPT_CMD", "HPCCKPT_PLACEMENT", "HPCCKPT_SPARE_HOSTS")

NOT_CONFIG = (ATTEMPT_VARIABLE, EXIT_FILE_VARIABLE, ULFM_PREFIX_VARIABLE, *JOB_SCRIPT_NAMES)
