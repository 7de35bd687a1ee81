#!/usr/bin/env bash
# The GPU check on a machine that has torch and transformers but not the rest (the lent GPU machine's image), from
# the repository root, with the bundle `make gpu-bundle` wrote beside this script:
#
#     bash build/gpu-bundle/run_check.sh [gpu_check.py's options]        (PYTHON: default python3)
#
# installs the bundle's wheels, offline and without dependencies, into a directory of its own (SITE, default a new
# temporary one), puts it and the repository on PYTHONPATH and runs benchmarks/gpu_check.py on the bundle's corpus.
set -euo pipefail
bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
site="${SITE:-$(mktemp -d -t flwr-sharded-site.XXXXXX)}"
"$python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$site" \
    "$bundle"/wheels/*.whl
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" benchmarks/gpu_check.py --data-dir "$bundle/data" "$@"
