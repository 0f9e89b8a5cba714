"""How a failure is described when ranks agree on it (cluster/collectives.py), without MPI."""


def test_only_storage_failures_degrade_a_level():
    import errno

    from hpcckpt.cluster.collectives import PeerFailure, StorageFailure, describe_failure, is_storage_failure
    from hpcckpt.errors import CheckpointError, StorageError
    from hpcckpt.io.atomic import ShardExistsError

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOENT):
        assert isinstance(describe_failure(OSError(code, "x")), StorageFailure)
    assert isinstance(describe_failure(StorageError("storage.local_dir is not writable")), StorageFailure)
    for other in (OSError(errno.ENOMEM, "x"), MemoryError(), RuntimeError("codec"), ShardExistsError("in the way")):
        failure = describe_failure(other)
        assert isinstance(failure, str) and not isinstance(failure, StorageFailure), other
    # Agreed: every rank's own failure must be the storage's; a peer's report does not count.
    full = describe_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert is_storage_failure(CheckpointError("...", {1: full, 2: PeerFailure("rank 1 failed")}))
    assert not is_storage_failure(CheckpointError("...", {1: full, 3: "MemoryError: "}))
    assert not is_storage_failure(CheckpointError("..."))
    # Agreed again on a larger communicator (an erasure group's failure), it stays the storage's.
    assert isinstance(describe_failure(CheckpointError("L3 ...", {1: full})), StorageFailure)
