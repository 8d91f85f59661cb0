#!/bin/bash
#SBATCH -J dl-train
#SBATCH -o %x-%j.out
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -t 01:00:00
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
##SBATCH -A m0000_g
##SBATCH --reservation=my_reservation
#
# Data-parallel training under Slurm: one rank per task, each task one GPU (4 per Perlmutter
# node), started by srun; every task sources export_DDP_vars.sh, then runs the entry script with
# all the arguments given after submit_pm.sh, unchanged.
#
#   sbatch -n 8 submit_pm.sh --yaml_config config/UNet.yaml --config bs512_opt    # 2 nodes
#   sbatch -N 4 -t 30 submit_pm.sh --config bs256_opt                              # ViT, 16 GPUs
#   SCRIPT=train_mp.py sbatch -N 1 submit_pm.sh --config mp --tensor_parallel 4
#   ENABLE_PROFILING=1 PROFILE_OUTPUT=4gpu sbatch -n 4 submit_pm.sh --config bs64_opt \
#       --num_epochs 4 --local_batch_size 16 --enable_manual_profiling
#
# Options given to sbatch override the #SBATCH lines above (delete a second "#" to enable a
# line). Account and reservation can also come from the environment: SBATCH_ACCOUNT,
# SBATCH_RESERVATION, SBATCH_QOS.
#
# Clusters without GPUs: the #SBATCH lines ask for GPUs, a "gpu" node feature and 32 CPUs per
# task; turn these off on the command line, and the ranks run on CPUs (gloo) with this same script:
#
#   sbatch --gpus-per-node=0 --constraint= --cpus-per-task=1 -n 2 submit_pm.sh --config quickstart
#
# Time limits and preemption: Slurm sends this script USR1 SECONDS before the time limit
# (--signal=B:USR1@SECONDS above, 120; #SBATCH lines cannot read variables, so change SECONDS
# on the command line: sbatch --signal=B:USR1@300 ...). The script passes it on to the ranks,
# which write a checkpoint at their next log point and exit with code 3; the job then requeues
# itself (--requeue) and the requeued job (SLURM_RESTART_COUNT above 0) runs with --resume auto:
# it continues from the newest checkpoint of its run directory. A run that finished (exit 0) or
# failed (exit 1 or 2) is not requeued. Choose SECONDS above log_every steps plus a checkpoint
# write; --open-mode=append keeps every attempt's output in one file.
#
# GPU or CPU ranks follow the allocation: with GPUs on the node, each rank uses GPU LOCAL_RANK
# and NCCL; without (or with GPUS_PER_NODE=0), CPU and gloo.
#
# Software: a container (SHIFTER_IMAGE, PODMAN_IMAGE or APPTAINER_IMAGE below; docker/README.md
# builds one from this repository) or the site's PyTorch module, loaded before sbatch so that
# the job inherits it. On Perlmutter, "module avail pytorch" lists the versions:
#
#   module load pytorch && sbatch -n 8 submit_pm.sh --config bs256_opt
#
# Environment (export before sbatch; the job inherits it):
#   SCRIPT            entry script (train.py)
#   PYTHON            interpreter inside the task (python)
#   ERA5_DATA_ROOT    ERA5 directory the ViT configs read ($SCRATCH/era5, else /data/era5)
#   COSMO_DATA_ROOT   cosmology directory the U-Net configs read ($SCRATCH/cosmo, else /data/cosmo)
#   EXPDIR            root of the run directories ($SCRATCH/dl-at-scale/logs, else ./logs)
#   SHIFTER_IMAGE     run every rank in this shifter image, e.g. nersc/pytorch:24.06.01
#   SHIFTER_MODULES   shifter modules for it, e.g. gpu,nccl-plugin on Perlmutter
#   APPTAINER_IMAGE   run every rank in this apptainer (or singularity) image file; bind data
#                     directories with APPTAINER_BIND=/pscratch
#   PODMAN_IMAGE      run every rank in this podman-hpc (else podman) image, e.g. one built
#                     with podman-hpc build and podman-hpc migrate; it sees the submit
#                     directory, $SCRATCH and the host network, and --gpu with GPUs
#   PODMAN_ARGS       extra podman-hpc run options, e.g. "--nccl" or "-v /global/cfs:/global/cfs"
#   HDF5_USE_FILE_LOCKING  FALSE (the data are only read; locks fail on parallel file systems)
#   FI_MR_CACHE_MONITOR    userfaultfd (libfabric's memory cache monitor for multi-node NCCL
#                          over Slingshot)
#   ENABLE_PROFILING  1: wrap every rank in "nsys profile" (Nsight Systems must be installed)
#   PROFILE_OUTPUT    report name (profile); with several ranks, _rank<N> is appended per rank
#   GPUS_PER_NODE     0: CPU ranks even when the nodes have GPUs; unset: what Slurm allocated
#   MASTER_PORT       rendezvous port (29500); jobs sharing a node need different ones
#   SRUN_ARGS         extra srun options, e.g. "--kill-on-bad-exit=1"
set -euo pipefail

die() { echo "submit_pm.sh: error: $*" >&2; exit 1; }

# The time limit's warning (USR1) may come at any moment, even before the ranks run (Slurm may
# send it up to 60 s early): note it here; it is passed on to the ranks once srun runs.
stop_requested=0
trap 'stop_requested=1' USR1

[[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job: submit with 'sbatch -n N submit_pm.sh ARGS'"
[[ -f export_DDP_vars.sh ]] || die "export_DDP_vars.sh is not in $PWD: submit from the repository root"
SCRIPT=${SCRIPT:-train.py}
PYTHON=${PYTHON:-python}
[[ -f $SCRIPT ]] || die "SCRIPT=$SCRIPT not found in $PWD"

# Data and run locations: the configs read these variables.
export ERA5_DATA_ROOT=${ERA5_DATA_ROOT:-${SCRATCH:-/data}/era5}
export COSMO_DATA_ROOT=${COSMO_DATA_ROOT:-${SCRATCH:-/data}/cosmo}
if [[ -z ${EXPDIR:-} ]]; then
    if [[ -n ${SCRATCH:-} ]]; then EXPDIR=$SCRATCH/dl-at-scale/logs; else EXPDIR=./logs; fi
fi
export EXPDIR
export PYTHONUNBUFFERED=1  # the job's output file follows the run as it goes
# Every rank opens the same read-only HDF5 files; file locking on Lustre/NFS scratch fails or
# serializes the opens, so it is off unless set otherwise.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
# Multi-node NCCL over libfabric (Slingshot): the default memory-registration cache monitor
# can miss freed buffers and hang or corrupt transfers; userfaultfd tracks them.
export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
# One thread per allocated CPU of the task (torch would otherwise use every core of the node).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# GPUs per node of this allocation (0 on a CPU-only cluster or with GPUS_PER_NODE=0).
gpus=${GPUS_PER_NODE:-}
if [[ -z $gpus ]]; then
    gpus=${SLURM_GPUS_ON_NODE:-}
    if [[ -z $gpus && -n ${SLURM_JOB_GPUS:-} ]]; then
        IFS=, read -ra ids <<<"$SLURM_JOB_GPUS"
        gpus=${#ids[@]}
    fi
    if [[ -z $gpus && ${SLURM_GPUS_PER_NODE:-} =~ ([0-9]+)$ ]]; then gpus=${BASH_REMATCH[1]}; fi
    gpus=${gpus:-0}
fi
[[ $gpus =~ ^[0-9]+$ ]] || die "GPUS_PER_NODE=$gpus is not a number"

srun_args=(-u)
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && srun_args+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
if ((gpus > 0)); then
    srun_args+=(--gpu-bind=none)  # every rank sees the node's GPUs and picks GPU LOCAL_RANK
else
    export CUDA_VISIBLE_DEVICES=""  # CPU ranks: gloo, even where GPUs exist
fi
read -ra extra <<<"${SRUN_ARGS:-}"
srun_args+=("${extra[@]}")

# Optional container: shifter (NERSC), apptainer/singularity or podman-hpc/podman.
container=()
images=()
for var in SHIFTER_IMAGE APPTAINER_IMAGE PODMAN_IMAGE; do
    if [[ -n ${!var:-} ]]; then images+=("$var"); fi
done
if ((${#images[@]} > 1)); then
    die "${images[*]} are set: choose one"
elif [[ -n ${SHIFTER_IMAGE:-} ]]; then
    command -v shifter >/dev/null || die "SHIFTER_IMAGE is set but shifter is not on this system"
    container=(shifter "--image=$SHIFTER_IMAGE")
    [[ -n ${SHIFTER_MODULES:-} ]] && container+=("--module=$SHIFTER_MODULES")
elif [[ -n ${APPTAINER_IMAGE:-} ]]; then
    runtime=$(command -v apptainer || command -v singularity) ||
        die "APPTAINER_IMAGE is set but neither apptainer nor singularity is installed"
    container=("$runtime" exec)
    ((gpus > 0)) && container+=(--nv)
    container+=("$APPTAINER_IMAGE")
elif [[ -n ${PODMAN_IMAGE:-} ]]; then
    runtime=$(command -v podman-hpc || command -v podman) ||
        die "PODMAN_IMAGE is set but neither podman-hpc nor podman is installed"
    # podman passes no environment by default: the variables the ranks read, by name.
    container=("$runtime" run --rm --net host -v "$PWD:$PWD" -w "$PWD")
    if [[ -n ${SCRATCH:-} ]]; then container+=(-v "$SCRATCH:$SCRATCH"); fi
    for var in 'SLURM_*' 'NCCL_*' 'FI_*' EXPDIR ERA5_DATA_ROOT COSMO_DATA_ROOT PYTHONUNBUFFERED \
               OMP_NUM_THREADS HDF5_USE_FILE_LOCKING CUDA_VISIBLE_DEVICES MASTER_PORT; do
        container+=(-e "$var")
    done
    if ((gpus > 0)) && [[ $runtime == */podman-hpc ]]; then container+=(--gpu); fi
    read -ra podman_args <<<"${PODMAN_ARGS:-}"
    container+=("${podman_args[@]}" "$PODMAN_IMAGE")
fi

# Optional Nsight Systems profile of each rank, recording the window the run brackets with the
# CUDA profiler API (--enable_manual_profiling).
profiler=()
if [[ ${ENABLE_PROFILING:-0} == 1 ]]; then
    "${container[@]}" bash -c 'command -v nsys' >/dev/null 2>&1 ||
        die "ENABLE_PROFILING=1 but nsys (Nsight Systems) is not on PATH${container:+ in the container}: load its module or use an image that has it, or unset ENABLE_PROFILING"
    output=${PROFILE_OUTPUT:-profile}
    ((${SLURM_NTASKS:-1} > 1)) && output+="_rank%q{SLURM_PROCID}"
    profiler=(nsys profile --trace=cuda,nvtx -c cudaProfilerApi --kill none -f true -o "$output")
fi

echo "job $SLURM_JOB_ID: ${SLURM_NTASKS:-1} rank(s) on ${SLURM_JOB_NODELIST:-?}," \
     "$( ((gpus > 0)) && echo "$gpus GPU(s) per node" || echo "CPU only")," \
     "${OMP_NUM_THREADS} thread(s) per rank${container:+, in ${container[*]}}"
echo "data: ERA5_DATA_ROOT=$ERA5_DATA_ROOT COSMO_DATA_ROOT=$COSMO_DATA_ROOT; runs: EXPDIR=$EXPDIR"

# A requeued job continues its run; a first submission starts as its arguments say (a fresh run
# is not started over a run directory that holds checkpoints, nor one resumed by accident).
# Without --run_num the run is named after the job (job<id>): a requeued job keeps its id, so
# it continues its own run and never another job's.
resume=()
((${SLURM_RESTART_COUNT:-0} > 0)) && resume=(--resume auto)
run_name=("--run_num" "job$SLURM_JOB_ID")
for arg in "$@"; do
    [[ $arg == --run_num || $arg == --run_num=* ]] && run_name=()
done

# Each task: set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, then replace the shell with
# the command; "$@" keeps every argument as given (spaces, quotes, $, *, ;). A rank ignores USR1
# until train.py installs its handler (a default USR1 would kill it while it starts up), and
# this shell, with srun in the background, repeats a warning every 2 s until the ranks end: srun
# forwards it to every task.
stopped=3  # the ranks' exit code after a stop signal: checkpoint written, resumable
srun "${srun_args[@]}" "${container[@]}" \
    bash -c 'trap "" USR1; source ./export_DDP_vars.sh && exec "$@"' ddp-rank \
    "${profiler[@]}" "$PYTHON" "$SCRIPT" "${run_name[@]}" "$@" "${resume[@]}" &
srun_pid=$!
echo "command:$(printf ' %q' "${profiler[@]}" "$PYTHON" "$SCRIPT" "${run_name[@]}" "$@" \
    "${resume[@]}")"
announced=0
while kill -0 "$srun_pid" 2>/dev/null; do
    if ((stop_requested)); then
        if ((!announced)); then
            echo "job $SLURM_JOB_ID: USR1 (time limit near): stopping the ranks"
            announced=1
        fi
        kill -USR1 "$srun_pid" 2>/dev/null || true
    fi
    sleep 2 &
    wait $! || true  # a USR1 ends this wait at once
done
status=0
wait "$srun_pid" || status=$?
if ((status == stopped)); then
    restart=$((${SLURM_RESTART_COUNT:-0} + 1))
    echo "job $SLURM_JOB_ID: stopped with a checkpoint; requeueing (restart $restart)"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
