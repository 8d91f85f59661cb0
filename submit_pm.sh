#!/bin/bash
#SBATCH -J dl-train
#SBATCH -o %x-%j.out
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -t 01:00:00
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
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
# GPU or CPU ranks follow the allocation: with GPUs on the node, each rank uses GPU LOCAL_RANK
# and NCCL; without (or with GPUS_PER_NODE=0), CPU and gloo.
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
#   ENABLE_PROFILING  1: wrap every rank in "nsys profile" (Nsight Systems must be installed)
#   PROFILE_OUTPUT    report name (profile); with several ranks, _rank<N> is appended per rank
#   GPUS_PER_NODE     0: CPU ranks even when the nodes have GPUs; unset: what Slurm allocated
#   MASTER_PORT       rendezvous port (29500); jobs sharing a node need different ones
#   SRUN_ARGS         extra srun options, e.g. "--kill-on-bad-exit=1"
set -euo pipefail

die() { echo "submit_pm.sh: error: $*" >&2; exit 1; }

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

# Optional container: shifter (NERSC) or apptainer/singularity.
container=()
if [[ -n ${SHIFTER_IMAGE:-} && -n ${APPTAINER_IMAGE:-} ]]; then
    die "both SHIFTER_IMAGE and APPTAINER_IMAGE are set: choose one"
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
echo "command:$(printf ' %q' "${profiler[@]}" "$PYTHON" "$SCRIPT" "$@")"

# Each task: set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, then replace the shell with
# the command; "$@" keeps every argument as given (spaces, quotes, $, *, ;).
srun "${srun_args[@]}" "${container[@]}" \
    bash -c 'source ./export_DDP_vars.sh && exec "$@"' ddp-rank \
    "${profiler[@]}" "$PYTHON" "$SCRIPT" "$@"
