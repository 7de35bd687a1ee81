#!/usr/bin/env bash
# Run apps/llama_fl_hsdp in local simulation with `flwr run ... --stream` in a private Flower home, then stop the
# local SuperLink that `flwr run` started (it would keep running otherwise). Leaves no process behind, and exits
# non-zero unless the run completed (`flwr run` itself exits 0 whatever the run did).
#
#   apps/llama_fl_hsdp/run_simulation.sh [more `flwr run` options, e.g. --run-config 'num-server-rounds=2']
#
# The plain command works too: `flwr run apps/llama_fl_hsdp --stream` (Flower's default federation of 2 simulated
# SuperNodes); this script adds `--federation-config` so that the groups start in parallel (one ClientApp per CPU).
#
# Environment (all optional):
#   FLWR_SHARDED_GROUPS   number of groups = simulated SuperNodes (default 2)
#   FLWR_SHARDED_DATA     prepared data directory (default: the group's default, ~/.cache/flwr_sharded)
#   FLWR_HOME             Flower's home (default: a fresh temporary directory, removed at the end)
#   FLWR_LOCAL_SUPERLINK_HTTP_API_PORT, FLWR_LOCAL_CONTROL_API_PORT   (default: free ports)
# Needs `flwr` and `flwr-sharded` of the environment of flwr_sharded on PATH (e.g. PATH=.venv/bin:$PATH).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
groups="${FLWR_SHARDED_GROUPS:-2}"
python="$(command -v python3 || command -v python)"
for tool in flwr flwr-sharded; do
  command -v "$tool" >/dev/null || {
    echo "run_simulation.sh: $tool is not on PATH (try PATH=.venv/bin:\$PATH)" >&2
    exit 2
  }
done

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

own_home=0
if [[ -z "${FLWR_HOME:-}" ]]; then
  FLWR_HOME="$(mktemp -d "${TMPDIR:-/tmp}/flwr-home.XXXXXX")"
  own_home=1
fi
export FLWR_HOME
mkdir -p "$FLWR_HOME"
[[ -f "$FLWR_HOME/config.toml" ]] || cat > "$FLWR_HOME/config.toml" <<'EOF'
[superlink]
default = "local"

[superlink.local]
address = ":local:"
EOF
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT="${FLWR_LOCAL_SUPERLINK_HTTP_API_PORT:-$(free_port)}"
export FLWR_LOCAL_CONTROL_API_PORT="${FLWR_LOCAL_CONTROL_API_PORT:-$(free_port)}"

cleanup() {  # the SuperLink started for this FLWR_HOME and its SuperExec, by pid (other homes' are left alone)
  flwr-sharded stop-superlink --flwr-home "$FLWR_HOME"
  ((own_home)) && rm -rf "$FLWR_HOME"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cpus="$(nproc 2>/dev/null || echo 1)"
extra=()
if [[ -n "${FLWR_SHARDED_DATA:-}" ]]; then  # absolute: the groups do not run in this directory
  FLWR_SHARDED_DATA="$(cd "$FLWR_SHARDED_DATA" 2>/dev/null && pwd || echo "$FLWR_SHARDED_DATA")"
  export FLWR_SHARDED_DATA
  extra+=(--run-config "data-dir=\"${FLWR_SHARDED_DATA}\"")
fi
log="$(mktemp "${TMPDIR:-/tmp}/flwr-run.XXXXXX")"
flwr run "$here" --stream \
  --federation-config "num-supernodes=$groups client-resources-num-cpus=1 init-args-num-cpus=$((groups > cpus ? groups : cpus))" \
  --run-config "num-groups=$groups" "${extra[@]}" "$@" 2>&1 | tee "$log"
if grep -q "flwr_sharded: the run COMPLETED" "$log"; then
  rm -f "$log"
  exit 0
fi
rm -f "$log"
echo "run_simulation.sh: the run did not complete (see the log above)" >&2
exit 1
