# shellcheck shell=bash
# The restart loop shared by jobs/slurm.sbatch and jobs/pbs.pbs (sourced, not run).
#
# It runs `hpcckpt train -c CONFIG`, or any application that checkpoints with the hpcckpt
# library (APP). The caller defines
#   hpcckpt_launch ARGS...   start `hpcckpt ARGS...` on every rank of the current node set; it runs
#                            in a background subshell and must `exec` the launcher (srun,
#                            mpiexec), so that signals passed on reach the launcher itself
#   hpcckpt_replan           before a restart: leave failed nodes out (may be a no-op); returns
#                            non-zero when the job cannot go on (the loop then stops)
# and may set, before calling hpcckpt_restart_loop:
#   APP             the application to run instead of `hpcckpt train`, a command line (e.g.
#                   "python examples/heat2d.py --run-dir run --nodes 0"), split at blanks like
#                   TRAIN_ARGS. Each attempt starts it as `hpcckpt exec APP...` (the MPI start-up
#                   settings first, then the application in the same process); it restarts from
#                   its newest version with Checkpointer.restart(), stops on the signal this loop
#                   passes on, and reports its exit code through hpcckpt.run_main (the exit record
#                   below), as `hpcckpt train` does. Its run directory and settings are its own;
#                   the storage paths (HPCCKPT_STORAGE_*) and run.end_time/halt_seconds reach it
#                   through the environment as they reach `hpcckpt train`
#   CONFIG          job TOML (hpcckpt train -c)
#   MAX_RESTARTS    restarts after failures within this allocation (default 3)
#   END_TIME        the allocation's end, seconds since the epoch (unknown: empty)
#   HALT_SECONDS    stop cleanly this long before END_TIME (default 120)
#   HPCCKPT         how to run hpcckpt (default: hpcckpt; e.g. "python -m hpcckpt"), split at blanks
#   TRAIN_ARGS      extra arguments for every attempt of `hpcckpt train` (e.g. --set or --inject ...:attempt=1),
#                   split at blanks and never glob-expanded (--set 'model.hidden=[64]' arrives
#                   as typed). Quotes in it are not honoured, so a value with a blank cannot be
#                   passed here: put it in the CONFIG file or an HPCCKPT_SECTION_KEY variable.
#   EXIT_DIR        where the ranks record why an attempt ended (default: the current
#                   directory, which must be on a file system every node sees)
#   EXIT_RECORD_REQUIRED  1: a launcher's exit code 0 counts only with the ranks' exit record of
#                   0; without one the ranks were ended from outside (Open MPI's runtime exits 0
#                   when it ends a job whose node daemon it lost) and the attempt is retried
#   START_TIMEOUT   seconds the ranks may take to get through MPI start-up (default 300); an
#                   attempt still starting then is stopped and counts as failed (a PMI server
#                   that dropped a request, a node that does not answer, or under ULFM a rank
#                   that died before the others were through hangs MPI_Init for good)
#   START_TIMEOUT_MIN  once an attempt of this job got through start-up, later attempts may
#                   take 4 times the longest start-up seen, but at least this many seconds
#                   (default 30), never more than START_TIMEOUT; doubled after each attempt
#                   stopped so, in case start-ups have grown slower
#
# Exit codes of `hpcckpt train` (and of an APP run through hpcckpt.run_main): 0 finished; 75
# stopped on request after a final checkpoint
# on the PFS (signal, allocation end); 2 bad config or data and 4 no loadable checkpoint,
# which another attempt cannot fix; anything else (a crashed rank, a lost node) is retried.
# The launcher's own exit code does not say which rank failed first (srun reports 143 when it
# killed the other ranks after one exited with 2), so the ranks record the code they agreed
# on in HPCCKPT_EXIT_FILE, and that record decides. Each attempt exports HPCCKPT_ATTEMPT=N;
# restarts resume with --restart auto from the newest version every rank can get.

HPCCKPT=${HPCCKPT:-hpcckpt}
MAX_RESTARTS=${MAX_RESTARTS:-3}
HALT_SECONDS=${HALT_SECONDS:-120}
TRAIN_ARGS=${TRAIN_ARGS:-}
# Commands given as one string ("python -m hpcckpt"), split once into words here.
read -r -a HPCCKPT_CMD <<< "$HPCCKPT"
_hpcckpt_child=""
_hpcckpt_stop_signal=""
_hpcckpt_trapped=0
# The longest start-up (launch until every rank is through MPI_Init) an attempt of this job
# took, in seconds (empty before one got through), and the factor after stopped start-ups.
_hpcckpt_longest_start=""
_hpcckpt_start_backoff=1

_hpcckpt_start_timeout() {
    # How long this attempt may take to get through start-up. The first attempt of a job has
    # START_TIMEOUT (a cold start at scale may be slow); after that the job knows what its
    # start-up takes, and one that takes far longer is stuck: under ULFM a rank that died
    # before the others were through MPI_Init leaves them there, which would otherwise cost
    # the whole START_TIMEOUT at every such crash.
    local limit=${START_TIMEOUT:-300} measured
    if [ -n "$_hpcckpt_longest_start" ]; then
        measured=$(( 4 * _hpcckpt_longest_start ))
        [ "$measured" -ge "${START_TIMEOUT_MIN:-30}" ] || measured=${START_TIMEOUT_MIN:-30}
        measured=$(( measured * _hpcckpt_start_backoff ))
        [ "$measured" -ge "$limit" ] || limit=$measured
    fi
    echo "$limit"
}

hpcckpt_say() { echo "hpcckpt-job: $*"; }

_hpcckpt_on_signal() {
    # The scheduler's warning (or time limit): pass it on as SIGUSR1, which every launcher
    # forwards to the ranks (Open MPI's mpirun ends the job on SIGTERM instead); the ranks
    # agree, take a final checkpoint, drain it to the PFS and exit 75.
    _hpcckpt_stop_signal=$1
    _hpcckpt_trapped=1
    hpcckpt_say "got SIG$1: asking the job to checkpoint, drain to the PFS and stop"
    if [ -n "$_hpcckpt_child" ]; then
        kill -USR1 "$_hpcckpt_child" 2>/dev/null
    fi
}

_hpcckpt_watch_startup() {
    # $1: the marker rank 0 writes once every rank is through MPI start-up; $2: the launcher;
    # $3: the flag this writes when it stopped an attempt that never got through; $4: seconds.
    local waited=0
    while [ "$waited" -lt "$4" ]; do
        [ -e "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || return 0
        sleep 1
        waited=$((waited + 1))
    done
    [ -e "$1" ] && return 0
    : > "$3"
    kill -TERM "$2" 2>/dev/null
    sleep 10
    kill -KILL "$2" 2>/dev/null
    return 0
}

_hpcckpt_clean_shm() {
    # Killed ranks leave MPICH's shared-memory segments in /dev/shm (RAM) until reboot; only
    # this host's can be reached from here (other nodes: run `hpcckpt clean-shm` on each).
    # Only segments created since the failed attempt began, so no other job's are judged.
    # Not in the attempt's exit file (it records why the attempt ended, and is read already).
    HPCCKPT_EXIT_FILE="" "${HPCCKPT_CMD[@]}" clean-shm --newer-than "$1" 2>&1 | tail -n 1 | sed 's/^/hpcckpt-job: /'
}

hpcckpt_place_nodes() {
    # Nodes for the next attempt, in rank order: every node of HPCCKPT_PLACEMENT (the last
    # attempt's, an array) that is still usable keeps its place, so its ranks find their
    # node-local files again; a spare (a usable node not placed) takes the place of a failed
    # one; with no spare left the failed node's place goes (ALLOW_SHRINK=1, the default) or
    # the job stops (returns 1). $1: the usable nodes, one per line. Sets HPCCKPT_PLACEMENT,
    # and HPCCKPT_SPARE_HOSTS to the spares left.
    local usable=$1 node spare
    local -a placed=() spares=() failed=()
    while read -r node; do
        [ -n "$node" ] || continue
        printf '%s\n' "${HPCCKPT_PLACEMENT[@]}" | grep -qxF -- "$node" || spares+=("$node")
    done <<< "$usable"
    for node in "${HPCCKPT_PLACEMENT[@]}"; do
        if grep -qxF -- "$node" <<< "$usable"; then
            placed+=("$node")
            continue
        fi
        failed+=("$node")
        if [ "${#spares[@]}" -gt 0 ]; then
            spare=${spares[0]}
            spares=("${spares[@]:1}")
            placed+=("$spare")
            hpcckpt_say "node $node failed or left the allocation: spare node $spare takes its place"
        elif [ "${ALLOW_SHRINK:-1}" = 1 ]; then
            hpcckpt_say "node $node failed or left the allocation and no spare node is left: going on without it"
        else
            hpcckpt_say "node $node failed or left the allocation, no spare node is left and ALLOW_SHRINK=0: stopping;" \
                        "submit the job again (it resumes from the surviving checkpoint levels)"
            return 1
        fi
    done
    if [ "${#placed[@]}" -eq 0 ]; then
        hpcckpt_say "no usable node is left in the allocation; stopping"
        return 1
    fi
    HPCCKPT_PLACEMENT=("${placed[@]}")
    # shellcheck disable=SC2034  # read by jobs/slurm.sbatch's launch (where spare ranks go)
    HPCCKPT_SPARE_HOSTS=(${spares[@]+"${spares[@]}"})
    [ "${#failed[@]}" -eq 0 ] || hpcckpt_say "next attempt on ${#placed[@]} node(s): ${placed[*]}"
    return 0
}

_hpcckpt_recorded_exit() {
    # The exit code the ranks recorded for this attempt, if any (see HPCCKPT_EXIT_FILE).
    local file=$1
    [ -f "$file" ] || return 1
    sed -n 's/^exit_code=\([0-9][0-9]*\)$/\1/p' "$file" | head -n 1 | grep .
}

hpcckpt_restart_loop() {
    trap '_hpcckpt_on_signal TERM' TERM
    trap '_hpcckpt_on_signal USR1' USR1
    trap '_hpcckpt_on_signal USR2' USR2
    if [ -n "${END_TIME:-}" ]; then
        export HPCCKPT_RUN_END_TIME=$END_TIME HPCCKPT_RUN_HALT_SECONDS=$HALT_SECONDS
        hpcckpt_say "the allocation ends at $(date -d "@$END_TIME" 2>/dev/null || echo "$END_TIME"); runs stop cleanly ${HALT_SECONDS} s before"
    fi
    local attempt=0 status=0 attempt_started recorded exit_file watcher start_timeout launched started_in why
    local job=${SLURM_JOB_ID:-${PBS_JOBID:-pid$$}}
    local -a train_args=() command=()
    # read -a splits at blanks without pathname expansion, which an unquoted $TRAIN_ARGS would
    # do: [64] or * in a --set value would turn into names of files in the current directory.
    IFS=$' \t\n' read -r -d '' -a train_args <<< "$TRAIN_ARGS" || :
    IFS=$' \t\n' read -r -d '' -a command <<< "${APP:-}" || :
    if [ "${#command[@]}" -gt 0 ]; then
        command=(exec -- "${command[@]}")
    else
        command=(train -c "$CONFIG" --restart auto ${train_args[@]+"${train_args[@]}"})
    fi
    while :; do
        attempt=$((attempt + 1))
        export HPCCKPT_ATTEMPT=$attempt
        if [ -n "$_hpcckpt_stop_signal" ]; then
            hpcckpt_say "SIG$_hpcckpt_stop_signal arrived after attempt $((attempt - 1)) failed; not starting another (a new job restarts from the surviving levels)"
            return "$status"
        fi
        if [ -n "${END_TIME:-}" ] && [ $(( END_TIME - $(date +%s) )) -lt "$HALT_SECONDS" ]; then
            hpcckpt_say "less than ${HALT_SECONDS} s left in the allocation; not starting attempt $attempt"
            return 0
        fi
        exit_file="${EXIT_DIR:-$PWD}/.hpcckpt-exit.${job%%.*}.$attempt"
        rm -f "$exit_file" "$exit_file.started" "$exit_file.hung"
        export HPCCKPT_EXIT_FILE=$exit_file
        hpcckpt_say "attempt $attempt (at most $((MAX_RESTARTS + 1))): $HPCCKPT ${command[*]}"
        attempt_started=$(( $(date +%s) - 1 ))
        start_timeout=$(_hpcckpt_start_timeout)
        launched=$(date +%s)
        # In the background, so a signal reaches the trap while we wait.
        hpcckpt_launch "${command[@]}" &
        _hpcckpt_child=$!
        _hpcckpt_watch_startup "$exit_file.started" "$_hpcckpt_child" "$exit_file.hung" "$start_timeout" &
        watcher=$!
        while :; do
            _hpcckpt_trapped=0
            wait "$_hpcckpt_child"
            status=$?
            # A trapped signal ends `wait` early: wait again, for the drain and the real status.
            [ "$_hpcckpt_trapped" = 1 ] || break
        done
        _hpcckpt_child=""
        # The record is this attempt's: a command the script runs after the loop (the demo's
        # report) would write its own there, after the loop has read and removed it.
        unset HPCCKPT_EXIT_FILE
        kill "$watcher" 2>/dev/null
        wait "$watcher" 2>/dev/null
        if [ -e "$exit_file.hung" ]; then
            why="a PMI request lost at start-up, or a node that does not answer"
            if [ -n "$_hpcckpt_longest_start" ]; then
                why="its longest so far took ${_hpcckpt_longest_start} s; a rank that died before the others were through, $why"
                _hpcckpt_start_backoff=$(( _hpcckpt_start_backoff * 2 ))
            fi
            hpcckpt_say "attempt $attempt did not get through MPI start-up in $start_timeout s ($why): stopped it"
        elif [ -e "$exit_file.started" ]; then
            # From the launch to the marker, rounded up: whole seconds are what both clocks give.
            # (A shared file system's clock may differ from this host's: never under a second.)
            started_in=$(( $(stat -c %Y "$exit_file.started" 2>/dev/null || echo "$launched") - launched + 1 ))
            [ "$started_in" -ge 1 ] || started_in=1
            if [ -z "$_hpcckpt_longest_start" ] || [ "$started_in" -gt "$_hpcckpt_longest_start" ]; then
                _hpcckpt_longest_start=$started_in
            fi
        fi
        rm -f "$exit_file.started" "$exit_file.hung"
        if [ "$status" = 0 ] && [ "${EXIT_RECORD_REQUIRED:-0}" = 1 ] && [ ! -f "$exit_file" ]; then
            hpcckpt_say "the launcher returned 0 but no rank recorded how attempt $attempt ended: its ranks were ended from outside (a lost node's daemon)"
            status=1
        fi
        if recorded=$(_hpcckpt_recorded_exit "$exit_file"); then
            [ "$recorded" = "$status" ] || hpcckpt_say "the launcher returned $status; the ranks recorded exit code $recorded"
            status=$recorded
            # The launcher may have killed the rank that prints an error before it could:
            # say it here, from the record of the rank that met it first.
            [ "$status" = 0 ] || [ "$status" = 75 ] || hpcckpt_say "rank $(sed -n 's/^rank=//p' "$exit_file" | head -n 1) recorded: $(sed -n 's/^message=//p' "$exit_file" | head -n 1)"
        fi
        rm -f "$exit_file"
        [ "$status" = 0 ] || [ "$status" = 75 ] || _hpcckpt_clean_shm "$attempt_started"
        case $status in
            0)
                hpcckpt_say "finished after $attempt attempt(s)"
                return 0 ;;
            75)
                hpcckpt_say "stopped cleanly after a final checkpoint on the PFS; submit the job again to continue"
                return 0 ;;
            2|4)
                hpcckpt_say "attempt $attempt failed with exit code $status (bad input or no loadable checkpoint); not retrying: see the messages above"
                return "$status" ;;
        esac
        if [ -n "$_hpcckpt_stop_signal" ]; then
            hpcckpt_say "attempt $attempt ended with exit code $status after SIG$_hpcckpt_stop_signal; not restarting"
            return "$status"
        fi
        if [ "$attempt" -gt "$MAX_RESTARTS" ]; then
            hpcckpt_say "attempt $attempt failed with exit code $status; giving up after $MAX_RESTARTS restart(s)"
            return "$status"
        fi
        hpcckpt_say "attempt $attempt failed with exit code $status; restarting from the surviving checkpoint levels"
        hpcckpt_replan || return "$status"
        sleep "${RESTART_DELAY:-2}"
    done
}
