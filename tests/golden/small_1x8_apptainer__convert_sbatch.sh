#!/bin/bash

# Parameters
#SBATCH --account=myproject
#SBATCH --cpus-per-task=8
#SBATCH --dependency=afterok:1002
#SBATCH --job-name=hpcmeg-convert-codeparrot-small
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --open-mode=append
#SBATCH --output=/lustre/scratch/hpcmeg/runs/codeparrot-small/logs/convert/convert.%j.batch.log
#SBATCH --partition=cpu
#SBATCH --signal=TERM@30
#SBATCH --time=01:00:00

# setup
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=WARN
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# cluster.setup (shell by design: copied verbatim from the profile/recipe)
module load apptainer

# command
export SUBMITIT_EXECUTOR=slurm
/opt/hpcmeg/venv/bin/python -u -m submitit.core._submit /lustre/scratch/hpcmeg/runs/codeparrot-small/submitit/convert
