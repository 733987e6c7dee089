#!/usr/bin/env bash
# The GPU figures on a bare GPU machine (Python 3.12 with torch, no network), in one command of a fixed length.
#   bash bench/gpu_session.sh wheels DIR             here, with network: the wheels that machine lacks, into DIR
#   bash bench/gpu_session.sh run DIR SECONDS CMD... there: install DIR's wheels and tuneline, then each CMD (a
#       figure name for `python bench/gpu.py --only NAME`, or `rms_norm` for bench/rms_norm.py --device cuda)
#       in turn, each stopped where it would run past SECONDS from the start; logs in $OUT when it is set;
#       BENCH_FLAGS (e.g. --compile, --trace DIR) go to each bench/gpu.py command.
# DIR/diffusers/ is sdxl_lora_step_vs_diffusers' folder: `wheels` puts there what diffusers' script imports beyond
# the figures' own site (torchvision, built for the GPU machine's torch 2.11); diffusers' own
# examples/dreambooth/train_dreambooth_lora_sdxl.py goes beside it by hand (a public repository, never copied into
# this one). Where the script is there, `run` installs those wheels into DIR/diffusers/site, which only the script's
# process reads (bench/gpu_diffusers.py), and passes --diffusers-examples DIR/diffusers to each figure.
# One --work for all the figures of a run (models built once); before each figure the models that neither it nor a
# figure still to come builds are removed (--keep-for), an earlier command's too; the last figure's stay for the
# next command, which removes them before its first figure if it has no use for them.
set -u
cd "$(dirname "$0")/.."
mode=${1:?wheels DIR | run DIR SECONDS FIGURE...}
dir=${2:?the wheels folder}
if [ "$mode" = wheels ]; then
  # bench/README.md lists why each is here; --no-deps: the machine's image holds the rest (huggingface_hub too).
  get=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  "${get[@]}" -d "$dir" diffusers==0.42.1 transformers==5.23.0 tokenizers==0.23.3 peft==0.21.2 torchao==0.18.0 \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated_types typing_inspection typing_extensions zarr==3.1.6 \
    numcodecs donfig google-crc32c || exit 1
  # PyPI's torchvision 0.26.0 is the +cu130 build of torch 2.11.0+cu130's release; another torch's ends the script
  exec "${get[@]}" -d "$dir/diffusers" torchvision==0.26.0
fi
[ "$mode" = run ] || { echo "unknown mode $mode: wheels or run" >&2; exit 2; }
budget=${3:?seconds for the whole run}
shift 3
start=$SECONDS
site=/tmp/tuneline-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$dir"/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$site" . >/dev/null || exit 1
examples=()
if [ -f "$dir/diffusers/train_dreambooth_lora_sdxl.py" ]; then
  examples=(--diffusers-examples "$dir/diffusers")
  # without its wheels the script's own figure fails, not the run: the other figures never read this site
  compgen -G "$dir/diffusers/*.whl" >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile \
    --upgrade --target "$dir/diffusers/site" "$dir"/diffusers/*.whl
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
logs=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
figures=("$@")
for i in "${!figures[@]}"; do
  name=${figures[$i]}
  # the figures still to come: each bench/gpu.py command first removes the models it and they don't build (64 GiB disk)
  later=()
  for next in "${figures[@]:$((i + 1))}"; do [ "$next" = rms_norm ] || later+=("$next"); done
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then echo "=== $name not run: ${left} s left"; continue; fi
  echo "=== $name at $((SECONDS - start)) s, at most ${left} s"
  if [ "$name" = rms_norm ]; then cmd=(python3 bench/rms_norm.py --device cuda)
  else cmd=(python3 bench/gpu.py --only "$name" --work /tmp/tuneline-gpu-work --keep-for "${later[@]}" "${examples[@]}"
    ${BENCH_FLAGS:-}); fi
  timeout "$left" "${cmd[@]}" 2>&1 | grep -v "Writing model shards\|Loading weights\|Loading checkpoint" | tee "$logs/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]} at $((SECONDS - start)) s"
done
