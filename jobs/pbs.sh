#!/bin/bash
# PBS Pro / Torque job script: train with multi-level checkpoints, restarting after failures.
# Submit: qsub jobs/pbs.sh   (edit select/ncpus/mpiprocs, the config and paths for your site)
#PBS -N hpcckpt
#PBS -l select=4:ncpus=4:mpiprocs=4
#PBS -l walltime=02:00:00
#PBS -j oe

set -u
cd "${PBS_O_WORKDIR:-.}"
CONFIG=${CONFIG:-jobs/cluster.toml}
MAX_ATTEMPTS=${MAX_ATTEMPTS:-5}
RANKS=$(wc -l < "$PBS_NODEFILE")
export HPCCKPT_STORAGE_LOCAL_DIR=${HPCCKPT_STORAGE_LOCAL_DIR:-/tmp/hpcckpt-{job}/node{node}}
export HPCCKPT_STORAGE_PFS_DIR=${HPCCKPT_STORAGE_PFS_DIR:-$PWD/run/pfs}

for attempt in $(seq 1 "$MAX_ATTEMPTS"); do
    echo "attempt $attempt of $MAX_ATTEMPTS, $RANKS ranks"
    mpiexec -n "$RANKS" -hostfile "$PBS_NODEFILE" hpcckpt train -c "$CONFIG" --restart auto
    status=$?
    [ $status -eq 0 ] && exit 0
    if [ $status -eq 2 ] || [ $status -eq 4 ]; then
        echo "hpcckpt failed with exit code $status; not retrying"
        exit $status
    fi
    echo "attempt $attempt failed with exit code $status; restarting from the last checkpoint"
    sleep 5
done
exit 1
