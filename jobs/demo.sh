#!/bin/bash
# Demo: lose two of four nodes in the middle of a training run and come back.
#
#   bash jobs/demo.sh
#
# 4 ranks on 4 simulated nodes run the default job (jobs/local.toml: checkpoints every 50
# steps on L1 local, L2 partner, L3 erasure, L4 every 2nd). As the checkpoint of step 350
# begins, nodes 1 and 2 die: their ranks are killed and their node-local directories deleted. The restart loop of the
# job scripts (jobs/restart-loop.sh) starts the job again; the ranks on the lost nodes get
# their shards back from a partner copy or an erasure rebuild, the run finishes, and
# `hpcckpt report` tells the story. Everything goes to ./run-demo (replaced on each demo).
#
# Settings (environment): HPCCKPT (default: hpcckpt), MPIEXEC (default: mpiexec), RUN_DIR.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
# shellcheck source=jobs/restart-loop.sh
. jobs/restart-loop.sh

RUN_DIR=${RUN_DIR:-run-demo}
MPIEXEC=${MPIEXEC:-mpiexec}
read -r -a MPIEXEC_CMD <<< "$MPIEXEC"
CONFIG=jobs/local.toml
MAX_RESTARTS=2
RESTART_DELAY=0
if [ -e "$RUN_DIR" ]; then
    if [ ! -f "$RUN_DIR/.hpcckpt-demo" ]; then
        echo "demo: $RUN_DIR exists and was not made by this demo; set RUN_DIR to another directory" >&2
        exit 2
    fi
    rm -rf "$RUN_DIR"
fi
mkdir -p "$RUN_DIR" && touch "$RUN_DIR/.hpcckpt-demo"
export HPCCKPT_RUN_DIR=$RUN_DIR
# The loss happens on the first attempt only (attempt=1): the restarted run passes step 350 in
# peace. At the snapshot phase the checkpoint of step 300 is durable on every level by then
# (at most one is in flight), so the demo tells the same story however busy the machine is.
TRAIN_ARGS="--inject node-loss:node=1:step=350:phase=snapshot:attempt=1"
TRAIN_ARGS+=" --inject node-loss:node=2:step=350:phase=snapshot:attempt=1"

hpcckpt_launch() { exec "${MPIEXEC_CMD[@]}" -n 4 "${HPCCKPT_CMD[@]}" "$@"; }
hpcckpt_replan() { hpcckpt_say "nodes 1 and 2 come back empty (replacement nodes)"; }

hpcckpt_restart_loop
status=$?
echo
echo "== summary (hpcckpt report) =="
"${HPCCKPT_CMD[@]}" report -c "$CONFIG" || status=$?
exit $status
