#!/usr/bin/env bash
# The CPU sbatch example on a real SLURM, started on this machine (run by .ci/run; as root).
#
# 1. Installs Debian's slurmctld, slurmd, slurm-client and munge when missing.
# 2. Starts munged, slurmctld and slurmd with a generated slurm.conf; everything lives in a
#    temporary folder (MinJobAge of a few seconds and batch_sched_delay=0 keep sbatch --wait
#    fast). The daemons it started are stopped by pid on exit, whatever happens.
# 3. Submits examples/slurm/pretrain_gpt_cpu.sbatch with sbatch --wait and checks its log
#    (one loss line per iteration, a saved checkpoint).
# 4. Preemption: submits it again, and once it has trained a few iterations runs
#    `scontrol requeue`: SIGTERM reaches the tasks, --exit-signal-handler saves and exits,
#    the requeued job resumes from that checkpoint, and every loss after the resume equals
#    the uninterrupted run's.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
ITERS=300  # long enough (a few seconds) for the requeue to land mid-run
fail() { echo "slurm test FAILED: $*" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || \
        ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || fail "slurm and munge are missing and installing them needs root"
    echo "> installing slurmctld slurmd slurm-client munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

TMP="$(mktemp -d /tmp/megatron_cp_slurm.XXXXXX)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT
mkdir -p "$TMP/state" "$TMP/spool" "$TMP/logs"
HOST="$(hostname -s)"
CPUS="$(nproc)"
PORT=$(( 20000 + RANDOM % 20000 ))

# munge: a fresh key and its own socket
dd if=/dev/urandom of="$TMP/munge.key" bs=1024 count=1 status=none
chmod 400 "$TMP/munge.key"
munged --force --key-file="$TMP/munge.key" --socket="$TMP/munge.sock" \
    --pid-file="$TMP/munged.pid" --log-file="$TMP/munged.log" --seed-file="$TMP/munge.seed"
for _ in $(seq 50); do [ -s "$TMP/munged.pid" ] && break; sleep 0.1; done
PIDS+=("$(cat "$TMP/munged.pid")")

cat > "$TMP/slurm.conf" <<CONF
ClusterName=megatroncp
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$(( PORT + 1 ))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$TMP/munge.sock
StateSaveLocation=$TMP/state
SlurmdSpoolDir=$TMP/spool
SlurmctldPidFile=$TMP/slurmctld.pid
SlurmdPidFile=$TMP/slurmd.pid
SlurmctldLogFile=$TMP/slurmctld.log
SlurmdLogFile=$TMP/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=5
KillWait=20
SchedulerParameters=batch_sched_delay=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=ci Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$TMP/slurm.conf"
slurmctld -i
for _ in $(seq 100); do [ -s "$TMP/slurmctld.pid" ] && break; sleep 0.1; done
[ -s "$TMP/slurmctld.pid" ] || { cat "$TMP/slurmctld.log" >&2; fail "slurmctld did not start"; }
PIDS+=("$(cat "$TMP/slurmctld.pid")")
slurmd -N "$HOST"
for _ in $(seq 100); do [ -s "$TMP/slurmd.pid" ] && break; sleep 0.1; done
[ -s "$TMP/slurmd.pid" ] || { cat "$TMP/slurmd.log" >&2; fail "slurmd did not start"; }
PIDS+=("$(cat "$TMP/slurmd.pid")")
for _ in $(seq 100); do
    sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix)' && break
    sleep 0.2
done
sinfo -h -o %t | grep -qE '^(idle|mix)' || { sinfo >&2; fail "the node did not come up"; }
echo "> SLURM is up: $(sinfo -h -o '%P %D %t %C')"

losses() {  # iteration -> loss lines of a job log: "12 6.123456E+00"
    sed -n 's/.*iteration *\([0-9]*\)\/.*lm loss: \([0-9.E+-]*\).*/\1 \2/p' "$1"
}

# 3. an uninterrupted run, submitted and waited for
sbatch --wait --output="$TMP/logs/straight-%j.out" --export=ALL,ITERS=$ITERS,RUN_DIR=$TMP/straight \
    examples/slurm/pretrain_gpt_cpu.sbatch >/dev/null || {
    cat "$TMP"/logs/straight-*.out >&2; fail "the sbatch job failed"; }
STRAIGHT="$(ls "$TMP"/logs/straight-*.out)"
[ "$(losses "$STRAIGHT" | wc -l)" = "$ITERS" ] || { cat "$STRAIGHT" >&2; fail "expected $ITERS loss lines"; }
[ "$(cat "$TMP/straight/checkpoints/latest_checkpointed_iteration.txt")" = "$ITERS" ] || \
    fail "no checkpoint at iteration $ITERS"
echo "> sbatch --wait: $ITERS loss lines and a checkpoint at iteration $ITERS"

# 4. preemption: requeue mid-run; the job saves on SIGTERM and the requeued job resumes
JOB="$(sbatch --parsable --output="$TMP/logs/requeued-%j.out" \
    --export=ALL,ITERS=$ITERS,RUN_DIR=$TMP/requeued examples/slurm/pretrain_gpt_cpu.sbatch)"
LOG="$TMP/logs/requeued-$JOB.out"
for _ in $(seq 600); do
    [ -f "$LOG" ] && [ "$(losses "$LOG" | wc -l)" -ge 4 ] && break
    sleep 0.2
done
[ "$(losses "$LOG" | wc -l)" -ge 4 ] || { cat "$LOG" >&2; fail "the job did not start training"; }
scontrol requeue "$JOB"
echo "> scontrol requeue $JOB after $(losses "$LOG" | wc -l) iterations ($(date +%T))"
# A requeued job waits about two minutes before it may start again; let it start at once.
for _ in $(seq 300); do
    [ "$(squeue -h -j "$JOB" -o %T 2>/dev/null || true)" = PENDING ] && break
    sleep 0.2
done
scontrol update JobId="$JOB" StartTime=now 2>/dev/null || true
for _ in $(seq 900); do
    state="$(squeue -h -j "$JOB" -o %T 2>/dev/null || true)"
    [ -z "$state" ] && break
    sleep 0.2
done
[ -z "$(squeue -h -j "$JOB" -o %T 2>/dev/null || true)" ] || fail "job $JOB did not finish"
grep -q "restart 1" "$LOG" || { cat "$LOG" >&2; fail "the job was not requeued"; }
# --save-interval is 1000: a checkpoint before iteration $ITERS can only be the SIGTERM save
SAVED="$(sed -n 's/.*loaded checkpoint from .* at iteration \([0-9]*\).*/\1/p' "$LOG" | head -1)"
[ -n "$SAVED" ] && [ "$SAVED" -ge 4 ] && [ "$SAVED" -lt "$ITERS" ] || {
    cat "$LOG" >&2; fail "the requeued job did not resume from a checkpoint saved on SIGTERM"; }
grep -q "received SIGTERM: saving and exiting after iteration $SAVED" "$LOG" || {
    cat "$LOG" >&2; fail "no save on SIGTERM in the log"; }
AFTER="$(losses "$LOG" | awk -v s="$SAVED" '$1 > s' | sort -n | uniq)"
EXPECTED="$(losses "$STRAIGHT" | awk -v s="$SAVED" '$1 > s' | sort -n)"
[ -n "$AFTER" ] && [ "$AFTER" = "$EXPECTED" ] || {
    echo "after the resume:"; echo "$AFTER"; echo "uninterrupted:"; echo "$EXPECTED"
    fail "the requeued job's losses differ from the uninterrupted run's"; } >&2
echo "> requeued job done ($(date +%T))"
echo "> preemption: saved at iteration $SAVED on SIGTERM, requeued, resumed; losses of" \
     "iterations $((SAVED + 1))..$ITERS equal the uninterrupted run's"
echo "slurm test passed"
