# Sourced first by every benchmarks/device_*.sh (run on the GPU machine from the repo root, carrying
# .device): $OUT and the start time T0, the carried packages (.device/activate), kvbuffer's
# subpackages by symlink (kvbuffer is not pip-installed there), the mamba_ssm peer if carried, and one
# line about the GPU.
OUT=${OUT:-out}; mkdir -p "$OUT"
T0=$(date +%s)
source .device/activate || exit 1
for sub in tiles autotune cli; do [ -e kvbuffer/$sub ] || ln -s ../$sub kvbuffer/$sub; done
if [ -d .whl/mamba_ssm_src ]; then export PYTHONPATH="$PWD/.whl/mamba_ssm_src:${PYTHONPATH:-}"; fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
