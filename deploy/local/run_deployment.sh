#!/usr/bin/env bash
# A Flower deployment on one machine, on loopback: a SuperLink, then per Flower client a federation group (a
# torchrun job) and its SuperNode, then `flwr run apps/llama_fl_hsdp` against them. It ends by stopping what it
# started, by pid (on failure too); the groups stop themselves at the end of the run (stop-groups=true).
# docs/flower.md (Deployment) shows the part between the recipe marks; tests/flower/test_deployment.py runs it.
#
#   deploy/local/run_deployment.sh [options] [-- more `flwr run` options, e.g. --run-config 'lr=0.001']
#
# Options (the defaults make a short run of the tiny model):
#   --groups N             Flower clients, one group + SuperNode each (2)
#   --shards S             ranks per group, each holding 1/S of the model (2)
#   --model NAME           run config `model` (tiny)
#   --rounds N             run config `num-server-rounds` (2)
#   --work-dir DIR         Flower home, keys, logs, the SuperLink's database and runs/ (default: a new directory
#                          under $TMPDIR, kept: the run directory is in it)
#   --data-dir DIR         the groups' prepared data (default: $FLWR_SHARDED_DATA, else ~/.cache/flwr_sharded)
#   --superlink-port P     the SuperLink's port (default: a free one)
#   --supernode-ports P,.. one port per SuperNode (default: free ones)
#   --timeout SECONDS      bound on `flwr run`: stopped after this long (default 1800)
# Exits 0 if the run completed and every group stopped at its end (130/143 if interrupted). Needs flwr,
# flower-superlink, flower-supernode, torchrun and python of flwr_sharded's environment on PATH (PATH=.venv/bin:$PATH).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export FLWR_SHARDED_REPO="${FLWR_SHARDED_REPO:-$REPO}"
# shellcheck source=/dev/null
source "$REPO/deploy/env.sh"
APP="$REPO/apps/llama_fl_hsdp"
NUM_GROUPS=2 SHARDS=2 MODEL=tiny ROUNDS=2 WORK="" DATA_DIR="${FLWR_SHARDED_DATA:-}" SUPERLINK_PORT="" TIMEOUT=1800
SUPERNODE_PORTS=()

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
die() { echo "run_deployment.sh: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --groups | --shards | --model | --rounds | --work-dir | --data-dir | --superlink-port | --supernode-ports \
      | --timeout)
      (($# >= 2)) || die "$1 needs a value" ;;
  esac
  case "$1" in
    --groups) NUM_GROUPS="$2"; shift 2 ;;
    --shards) SHARDS="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --work-dir) WORK="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --superlink-port) SUPERLINK_PORT="$2"; shift 2 ;;
    --supernode-ports) IFS=, read -r -a SUPERNODE_PORTS <<< "$2"; shift 2 ;;
    --timeout) TIMEOUT="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (--help lists them; \`flwr run\` options go after --)" ;;
  esac
done
for option in groups:NUM_GROUPS shards:SHARDS rounds:ROUNDS timeout:TIMEOUT; do
  name="${option#*:}" && value="${!name}"
  [[ "$value" =~ ^[1-9][0-9]*$ ]] || die "--${option%%:*} must be a positive integer, got '$value'"
done
if ((${#SUPERNODE_PORTS[@]})) && ((${#SUPERNODE_PORTS[@]} != NUM_GROUPS)); then
  die "--supernode-ports needs $NUM_GROUPS ports, got ${#SUPERNODE_PORTS[@]}"
fi
for port in "$SUPERLINK_PORT" "${SUPERNODE_PORTS[@]}"; do
  [[ -z "$port" || "$port" =~ ^[1-9][0-9]{0,4}$ ]] || die "a port must be a number, got '$port'"
done
for tool in flwr flower-superlink flower-supernode torchrun python; do
  command -v "$tool" >/dev/null || die "$tool is not on PATH (try PATH=.venv/bin:\$PATH)"
done
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SUPERLINK_PORT="${SUPERLINK_PORT:-$(free_port)}"
while ((${#SUPERNODE_PORTS[@]} < NUM_GROUPS)); do SUPERNODE_PORTS+=("$(free_port)"); done
WORK="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/flwr-deployment.XXXXXX")}"
mkdir -p "$WORK/runs" && chmod 700 "$WORK" && WORK="$(cd "$WORK" && pwd)"
RUN_DIR="$WORK/runs/$(date +%Y-%m-%d_%H-%M-%S)"
group_data=()
if [[ -n "$DATA_DIR" ]]; then group_data=(--data-dir "$(cd "$DATA_DIR" && pwd)"); fi

# --- processes: each in a session of its own (its process group id is its pid), stopped by pid -------------------
pids=() group_pids=()
start() {  # start NAME COMMAND...: run COMMAND in WORK, logging to WORK/NAME.log (there before this returns)
  local name="$1"; shift
  : > "$WORK/$name.log"
  (cd "$WORK" && exec setsid "$@" >> "$WORK/$name.log" 2>&1 < /dev/null) &
  pids+=("$!")
  echo "run_deployment.sh: started $name (pid $!, log $WORK/$name.log)"
}
alive() { local state; state="$(ps -o stat= -p "$1" 2>/dev/null)" && [[ "$state" != Z* ]]; }
descendants() {  # every process below $1, by parent pid
  local child
  for child in $(ps -o pid= --ppid "$1" 2> /dev/null); do echo "$child" && descendants "$child"; done
}
# shellcheck disable=SC2317  # called by the trap
stop_all() {  # SIGTERM to every started process group and what they spawned elsewhere, SIGKILL after 15 s
  local pid all=() deadline=$((SECONDS + 15))
  for pid in "${pids[@]}"; do mapfile -t -O "${#all[@]}" all < <(echo "$pid"; descendants "$pid"); done
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2> /dev/null || true; done
  for pid in "${all[@]}"; do kill -TERM "$pid" 2> /dev/null || true; done
  for pid in "${all[@]}"; do while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done; done
  for pid in "${all[@]}"; do if alive "$pid"; then kill -KILL "$pid" 2> /dev/null || true; fi; done
  wait 2> /dev/null || true
  ((${#pids[@]})) && echo "run_deployment.sh: stopped pids ${all[*]}"
  pids=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
wait_for() {  # wait_for SECONDS WHAT PID TEST...: until TEST succeeds; fails once PID is gone or time is up
  local seconds="$1" what="$2" pid="$3" deadline=$((SECONDS + $1)); shift 3
  until "$@"; do
    alive "$pid" || { echo "run_deployment.sh: $what: its process exited (log in $WORK)" >&2; return 1; }
    ((SECONDS < deadline)) || { echo "run_deployment.sh: $what: not within $seconds s" >&2; return 1; }
    sleep 0.5
  done
}
follow() {  # follow NAME SECONDS: show NAME's log until its process (the last started) exits; fail after SECONDS
  local pid="${pids[-1]}" deadline=$((SECONDS + $2))
  tail -n +1 -f --pid "$pid" "$WORK/$1.log" &
  pids+=("$!")
  while alive "$pid"; do
    if ((SECONDS >= deadline)); then echo "run_deployment.sh: $1 did not finish within $2 s" >&2; return 1; fi
    sleep 1
  done
  wait "${pids[-1]}" || true
}
listening() {  # something accepts connections on 127.0.0.1:$1
  python -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])))' "$1" 2> /dev/null
}
new_authkey() { (umask 077 && python -c 'import secrets; print(secrets.token_hex(32))' > "$1"); }

# >>> recipe (docs/flower.md shows these lines)
export FLWR_HOME="$WORK/flwr-home"  # `flwr run`'s connection to this SuperLink
mkdir -p "$FLWR_HOME" && cat > "$FLWR_HOME/config.toml" << EOF
[superlink]
default = "local-deployment"

[superlink.local-deployment]
address = "127.0.0.1:$SUPERLINK_PORT"
insecure = true
EOF

# the SuperLink, on loopback; the ServerApp runs in its working directory (WORK: start() runs everything there)
start superlink flower-superlink --insecure --host 127.0.0.1 --port "$SUPERLINK_PORT" \
    --database "$WORK/state.db" --disable-runtime-dependency-installation
wait_for 120 "the SuperLink on port $SUPERLINK_PORT" "${pids[-1]}" listening "$SUPERLINK_PORT"

# one group per Flower client: a torchrun job whose endpoint listens on a free loopback port (in its address file)
for ((i = 0; i < NUM_GROUPS; i++)); do
  new_authkey "$WORK/group$i.key"
  start "group$i" torchrun --standalone --nproc-per-node "$SHARDS" -m flwr_sharded.flower.group \
      --authkey-file "$WORK/group$i.key" --address 127.0.0.1:0 --address-file "$WORK/group$i.address" \
      --method fl-fsdp --replicas 1 --shards "$SHARDS" --rendezvous-host 127.0.0.1 --watch-pid $$ "${group_data[@]}"
  group_pids+=("${pids[-1]}")
done

# one SuperNode per group, each on its own port; a run may write the final model under WORK/runs only
for ((i = 0; i < NUM_GROUPS; i++)); do
  wait_for 300 "group$i listening" "${group_pids[i]}" test -s "$WORK/group$i.address"
  node_config="group-address=\"$(< "$WORK/group$i.address")\" group-authkey-file=\"$WORK/group$i.key\""
  node_config+=" partition-id=$i num-partitions=$NUM_GROUPS allowed-save-root=\"$WORK/runs\""
  start "supernode$i" flower-supernode --insecure --superlink "127.0.0.1:$SUPERLINK_PORT" \
      --host 127.0.0.1 --port "${SUPERNODE_PORTS[i]}" --node-config "$node_config"
done

# the run: its run-dir under allowed-save-root (by default it would lie under WORK/outputs, which the groups
# refuse), and the groups stopped at its end
start flwr-run flwr run "$APP" local-deployment --stream --run-config \
    "num-groups=$NUM_GROUPS shards=$SHARDS model=\"$MODEL\" num-server-rounds=$ROUNDS run-dir=\"$RUN_DIR\"" \
    --run-config stop-groups=true "$@"
follow flwr-run "$TIMEOUT"
# <<< recipe

grep -q "flwr_sharded: the run COMPLETED" "$WORK/flwr-run.log" \
  || { echo "run_deployment.sh: the run did not complete (logs in $WORK)" >&2; exit 1; }
for ((i = 0; i < NUM_GROUPS; i++)); do  # stop-groups=true: each group exits once the run has finished
  deadline=$((SECONDS + 60))
  while alive "${group_pids[i]}" && ((SECONDS < deadline)); do sleep 0.5; done
  if alive "${group_pids[i]}"; then echo "run_deployment.sh: group$i still runs after the run" >&2; exit 1; fi
done
stop_all
run_dir="$(sed -n 's/.*flwr_sharded: run directory \([^ ]*\).*/\1/p' "$WORK/flwr-run.log" | tail -n 1)"
echo "run_deployment.sh: the run COMPLETED and its groups stopped; run directory $run_dir"
