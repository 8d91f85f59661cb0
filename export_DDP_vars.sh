# Source in every task of a Slurm job step (one process per GPU, or per CPU rank) before
# starting python: it sets the variables torch.distributed reads at start-up.
#
#   srun bash -c 'source export_DDP_vars.sh && python train.py --config bs64_opt'
#
#   RANK         global rank of this task             <- SLURM_PROCID
#   WORLD_SIZE   number of tasks in the step          <- SLURM_NTASKS
#   LOCAL_RANK   rank of this task on its node        <- SLURM_LOCALID (picks the GPU)
#   MASTER_ADDR  host of rank 0: the first host of the step's node list
#                (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST)
#   MASTER_PORT  rendezvous port, 29500 unless MASTER_PORT is already set; jobs that share a
#                node need different ports (e.g. MASTER_PORT=$((29500 + SLURM_JOB_ID % 1000)))
#   CUDA_VISIBLE_DEVICES  <- DDP_GPU_ORDER, the GPU order submit_pm.sh chose for the ranks (e.g.
#                3,2,1,0 on Perlmutter, so that CUDA device LOCAL_RANK is the GPU next to the
#                task's cores): Slurm may have dropped the exported value in the task, or put its
#                own listing of the step's GPUs there (0,1,2,3). A task given fewer GPUs than
#                the order names (srun --gpus-per-task, --gpu-bind=single:1) keeps Slurm's.
#
# Node lists use Slurm's compressed form ("nid[001-004,007]", "gpu[01-02],cpu5", "a1,b2").
# `scontrol show hostnames` expands them when it is on PATH; otherwise a pure-bash parser takes
# the first host. Needs bash; returns non-zero (without ending the calling shell) outside Slurm.

_ddp_first_host() {
    # First host of a Slurm node list, without scontrol: the text up to the first comma that is
    # outside brackets, then every "[a-b,c]" replaced by its first value "a" (padding kept).
    local list=$1 item="" host="" group c i depth=0
    for ((i = 0; i < ${#list}; i++)); do
        c=${list:i:1}
        case $c in
            "[") depth=$((depth + 1)) ;;
            "]") depth=$((depth - 1)) ;;
            ",") ((depth == 0)) && break ;;
        esac
        item+=$c
    done
    while [[ $item == *"["*"]"* ]]; do
        host+=${item%%"["*}
        item=${item#*"["}
        group=${item%%"]"*}
        item=${item#*"]"}
        group=${group%%,*}
        host+=${group%%-*}
    done
    printf '%s\n' "$host$item"
}

_ddp_export() {
    local nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}} first=""
    if [[ -z ${SLURM_PROCID:-} || -z ${SLURM_NTASKS:-} || -z $nodelist ]]; then
        echo "export_DDP_vars.sh: SLURM_PROCID, SLURM_NTASKS or the node list is not set:" \
             "source it inside a job step (srun), or use torchrun outside Slurm" >&2
        return 1
    fi
    if command -v scontrol >/dev/null 2>&1; then
        { read -r first || true; } < <(scontrol show hostnames "$nodelist" 2>/dev/null)
    fi
    [[ -n $first ]] || first=$(_ddp_first_host "$nodelist")
    export RANK=$SLURM_PROCID
    export WORLD_SIZE=$SLURM_NTASKS
    export LOCAL_RANK=${SLURM_LOCALID:-0}
    export MASTER_ADDR=$first
    export MASTER_PORT=${MASTER_PORT:-29500}
    if [[ -n ${DDP_GPU_ORDER:-} ]]; then
        local -a order=() visible=()
        IFS=, read -ra order <<<"$DDP_GPU_ORDER"
        IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES-$DDP_GPU_ORDER}"
        if ((${#visible[@]} == ${#order[@]})) || [[ ${CUDA_VISIBLE_DEVICES:-} == NoDevFiles ]]; then
            export CUDA_VISIBLE_DEVICES=$DDP_GPU_ORDER
        fi
    fi
    return 0
}

_ddp_export
