#!/usr/bin/env bash
# Brings the up.sh cluster back to all nodes idle after a test failed some: cancels what is
# left of its jobs, starts again the slurmd of each node fail-node.sh killed (its pid file
# gone), in a namespace of its own as up.sh starts it (ReturnToService=2 lets it back in once
# it registers), and resumes nodes Slurm drained. Much quicker than up.sh, which restarts
# every daemon. Exit 1 if the nodes are not all idle within 30 s (then run up.sh).
#
#   bash tests/slurm/revive.sh [NODES]
set -u
NODES=${1:-${SLURM_TEST_NODES:-4}}
RUN=/run/hpcckpt-slurm
# shellcheck source=tests/slurm/common.sh
. "$(dirname "$0")/common.sh"
scancel --quiet --full -u root 2>/dev/null || true
for n in $(seq 1 "$NODES"); do
    pidfile="$RUN/slurmd-n$n.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then continue; fi
    rm -f "$pidfile"
    start_slurmd "n$n"
    scontrol update nodename="n$n" state=resume 2>/dev/null || true
done
wait_nodes_idle "$NODES" 150 0.2 && exit 0
sinfo -N -R >&2
exit 1
