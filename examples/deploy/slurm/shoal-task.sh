#!/usr/bin/env bash
# One task of shoal.sbatch's job step (docs/deploy.md, "Slurm"): task 0 runs the front
# (`shoal serve -c JOB_SCRIPT`), task k + 1 the script's k-th worker node (`shoal node
# --name-from SHOAL_RANK`, SHOAL_RANK=k). Slurm restarts no single task, so this wrapper does:
# a node that exits is started again (at once after status 75, the front's memory drain; after
# 1 s otherwise; a front that gave up on a worker, status 3, too), except after status 2 (bad
# input: the task ends with 2 and srun --kill-on-bad-exit ends the step) or 5 exits in a row
# within 10 s of their start (status 1).
# Cancelling sends SIGTERM to every process of the step at once, the nodes included. The front
# drains; a worker must outlive it for the requests in flight to finish, so after SIGTERM this
# wrapper keeps its worker running (starting it again when the signal stopped it: the front's
# watchdog takes it back, --recover-timeout) until the front's HTTP port closes or
# SHOAL_DRAIN_TIMEOUT + 5 s pass, then stops it.
# Usage (by shoal.sbatch, under srun): shoal-task.sh JOB_SCRIPT [SERVE FLAGS...]
set -u
job=${1:?usage: shoal-task.sh JOB_SCRIPT [SERVE FLAGS]}
shift
bin=${SHOAL_BIN:-shoal}
rank=${SLURM_PROCID:?shoal-task.sh runs as a task of a Slurm job step}
drain=${SHOAL_DRAIN_TIMEOUT:-20}
recover=${SHOAL_RECOVER_TIMEOUT:-30}
say() { echo "shoal-task $rank: $*" >&2; }

# The job script placed task `rank` on one machine; make sure srun put it there.
read -ra where <<<"${SHOAL_TASK_NODES:-}"
if [ -n "${where[$rank]:-}" ] && [ -n "${SLURMD_NODENAME:-}" ] &&
    [ "${where[$rank]}" != "$SLURMD_NODENAME" ]; then
    say "runs on $SLURMD_NODENAME but the job's script places it on ${where[$rank]}" \
        "(run the step with --distribution=block over the whole allocation)"
    exit 2
fi

if [ "$rank" = 0 ]; then
    cmd=("$bin" serve -c "$job" --drain-timeout "$drain" --recover-timeout "$recover" "$@")
else
    export SHOAL_RANK=$((rank - 1))
    cmd=("$bin" node -c "$job" --name-from SHOAL_RANK -t "${SLURM_CPUS_PER_TASK:-1}")
fi

stopping=0 deadline=0 signals=0
trap 'stopping=1; signals=$((signals + 1)); deadline=$((SECONDS + ${drain%.*} + 5))' TERM INT

front_up() { # the front's HTTP port accepts connections (it does while it drains)
    local hp=${SHOAL_FRONT_HTTP:-}
    [ -n "$hp" ] && timeout 1 bash -c "exec 3<>/dev/tcp/${hp%:*}/${hp##*:}" 2>/dev/null
}

# Runs the node once; returns its exit status. A worker being stopped is stopped here once the
# front is gone.
run_once() {
    "${cmd[@]}" &
    local pid=$! rc=0 signalled=0
    while :; do
        if [ "$rank" != 0 ] && [ "$stopping" = 1 ]; then
            if ! kill -0 "$pid" 2>/dev/null; then
                rc=0
                wait "$pid" 2>/dev/null || rc=$?
                break
            fi
            if [ "$signalled" = 0 ] && { ! front_up || [ "$SECONDS" -ge "$deadline" ]; }; then
                kill -TERM "$pid" 2>/dev/null
                signalled=1
            fi
            sleep 0.2
        else
            rc=0
            local seen=$signals
            wait "$pid" 2>/dev/null || rc=$? # returns early when the trap runs
            kill -0 "$pid" 2>/dev/null && continue
            if [ "$seen" != "$signals" ]; then # rc may be the trap's: ask again
                local again=0
                wait "$pid" 2>/dev/null || again=$?
                [ "$again" = 127 ] || rc=$again # 127: the first wait had its status
            fi
            break
        fi
    done
    return "$rc"
}

quick=0
while :; do
    started=$SECONDS
    rc=0
    run_once || rc=$?
    if [ "$rank" = 0 ]; then
        [ "$stopping" = 1 ] && exit "$rc" # drained (0), or whatever the front said
    elif [ "$stopping" = 1 ]; then
        if front_up && [ "$SECONDS" -lt "$deadline" ]; then
            say "the node stopped (status $rc) while the front drains: starting it again"
            continue
        fi
        exit 0
    fi
    [ "$rc" = 2 ] && { say "the node refused its input (status 2)"; exit 2; }
    if [ $((SECONDS - started)) -lt 10 ]; then quick=$((quick + 1)); else quick=0; fi
    [ "$quick" -ge 5 ] && { say "the node exited $quick times in a row; giving up"; exit 1; }
    say "the node exited (status $rc): starting it again"
    [ "$rc" = 75 ] || sleep 1
done
