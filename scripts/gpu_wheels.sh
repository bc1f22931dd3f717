#!/usr/bin/env bash
# Wheels for running the engine and benchmarks/ on a GPU machine that has python3.12 with CUDA torch,
# Triton and numpy but no package index: download here, carry DIR there, then there
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/hydra_console      # this checkout as the package
#   export PYTHONPATH=/tmp/pp:/tmp/site PYTHONPYCACHEPREFIX=/tmp/pyc # bytecode kept: warm starts measure as on an install
#   python3 -m hydra_console.engine.synth /tmp/q35.gguf             # the users' 27B shape, 1-2 min
# Usage: scripts/gpu_wheels.sh DIR [PYTHON_VERSION]
set -euo pipefail
dir=${1:?usage: gpu_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
# The runtime's dependencies beyond torch/triton/numpy, what the openai client and Textual bring, and pytest
# (the CUDA tests).
names=(gguf pyyaml tqdm jinja2 markupsafe regex fastapi starlette pydantic pydantic-core annotated-types
       typing-inspection annotated-doc typing-extensions uvicorn h11 click uvloop prometheus-client psutil
       nvidia-ml-py textual rich markdown-it-py mdurl mdit-py-plugins pygments platformdirs tomli-w httpx
       httpcore anyio sniffio idna certifi llguidance zlib-ng openai httpx2 httpcore2 truststore distro
       jiter opentelemetry-api importlib-metadata zipp pytest pluggy iniconfig packaging)
plat=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do plat+=(--platform "${p}_x86_64"); done
for n in "${names[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
    -d "$dir" "$n"
done
ls "$dir" | wc -l
