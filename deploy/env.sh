# shellcheck shell=bash
# Shared environment for the deploy/ scripts: source it (the sbatch scripts do). Every variable can be set
# before sourcing (in the job's environment, `sbatch --export=ALL,VAR=...`, or a site file named by
# FLWR_SHARDED_SITE_ENV) and is only defaulted here.

# --- where things are -------------------------------------------------------------------------------------------
: "${FLWR_SHARDED_REPO:=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
if [[ -n "${FLWR_SHARDED_SITE_ENV:-}" ]]; then
    # shellcheck source=/dev/null
    source "$FLWR_SHARDED_SITE_ENV"
fi
: "${FLWR_SHARDED_VENV:=$FLWR_SHARDED_REPO/.venv}"         # virtualenv with flwr_sharded (same path on every node)
: "${FLWR_SHARDED_SHARED:=$HOME/flwr_sharded-deploy}"      # shared filesystem: certs, keys, addresses, logs
: "${FLWR_SHARDED_CERTS:=$FLWR_SHARDED_SHARED/certs}"      # ca.crt, server.pem, server.key (deploy/tls/make-certs.sh)
: "${FLWR_SHARDED_KEYS:=$FLWR_SHARDED_SHARED/keys}"        # SuperNode auth keys (deploy/auth/make-supernode-keys.sh)
: "${FLWR_SHARDED_INSECURE:=0}"                            # 1: plaintext Flower, refused off loopback
if [[ -d "$FLWR_SHARDED_VENV/bin" ]]; then
    export PATH="$FLWR_SHARDED_VENV/bin:$PATH"
fi
export FLWR_SHARDED_REPO FLWR_SHARDED_VENV FLWR_SHARDED_SHARED FLWR_SHARDED_CERTS FLWR_SHARDED_KEYS
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED="${FLWR_TELEMETRY_ENABLED:-0}"

# --- ports (all configurable; open only what docs/security.md lists) ---------------------------------------------
: "${FLWR_SUPERLINK_PORT:=9093}"          # SuperLink: Fleet + Control + Runtime API, one HTTPS port
: "${FLWR_SUPERNODE_PORT:=9094}"          # SuperNode's local API (binds 127.0.0.1)
: "${FLWR_GROUP_PORT:=7100}"              # group endpoint on rank 0, binds 127.0.0.1 (the ClientApp's only peer)
: "${FLWR_TORCHRUN_PORT:=29500}"          # torchrun static rendezvous inside one group (MASTER_PORT)
: "${FLWR_RENDEZVOUS_PORT_BASE:=29600}"   # shard-sync stores on rank 0: S ports from here, one per shard index
                                          # (or FLWR_RENDEZVOUS_PORTS=p0,p1,... exactly S of them)
export FLWR_SUPERLINK_PORT FLWR_SUPERNODE_PORT FLWR_GROUP_PORT FLWR_TORCHRUN_PORT FLWR_RENDEZVOUS_PORT_BASE
# Host firewall (deploy/firewall/make-rules.sh): FLWR_FEDERATION_NODES = addresses/CIDRs of every node of every group
# (they alone may reach the torchrun, rendezvous and gloo/NCCL ports), FLWR_SUPERLINK_CLIENTS = who may reach the
# SuperLink (default: the federation's nodes), FLWR_EPHEMERAL_PORTS = the range gloo/NCCL listen in (default: the
# kernel's net.ipv4.ip_local_port_range).

# --- liveness --------------------------------------------------------------------------------------------------------
: "${FLWR_GROUP_IDLE_TIMEOUT:=7200}"      # group.sbatch: a group that gets no instruction for this long (no run,
                                          # the SuperLink gone for good) exits and ends its job; 0: wait forever
export FLWR_GROUP_IDLE_TIMEOUT

# --- threads -------------------------------------------------------------------------------------------------------
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"

# --- NCCL / gloo: which network the collectives use -------------------------------------------------------------------
# Pin both to the fast fabric and keep them off management/public interfaces (their traffic is NOT encrypted):
#   NCCL_SOCKET_IFNAME  interface(s) for NCCL's bootstrap and socket transport, e.g. "ib0", "hsn0", "^lo,docker"
#   GLOO_SOCKET_IFNAME  interface for gloo (CPU collectives, the control group, cross-facility sync), e.g. "ib0"
#   NCCL_IB_HCA         InfiniBand/RoCE adapters to use, e.g. "mlx5_0,mlx5_1" ("=mlx5_0" for an exact match)
#   NCCL_IB_GID_INDEX   RoCE v2 usually needs 3
#   NCCL_NET_GDR_LEVEL  GPUDirect RDMA distance (e.g. PHB); NCCL_CROSS_NIC=1 on rail-optimised fabrics
#   NCCL_DEBUG          WARN by default; INFO shows the chosen transport (look for "NET/IB" vs "NET/Socket")
#   NCCL_DEBUG_SUBSYS   e.g. INIT,NET with NCCL_DEBUG=INFO
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a failed or timed-out collective tears the process down instead of hanging
#                                      (the static engine; a Flower group's processes set mode 2 when they start:
#                                      a failed sync aborts its communicator and rolls back)
#   TORCH_NCCL_BLOCKING_WAIT           leave unset (1 makes every wait a host sync)
#   NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT  raise on large or lossy fabrics (e.g. 22 / 10)
# Cross-facility shard syncs cannot use NCCL's IB transport between sites: run the groups with --sync-backend gloo
# (deploy/slurm/cross-facility/) and route gloo over an encrypted tunnel (docs/security.md).
if [[ -n "${FLWR_FABRIC_IFNAME:-}" ]]; then
    : "${NCCL_SOCKET_IFNAME:=$FLWR_FABRIC_IFNAME}"
    : "${GLOO_SOCKET_IFNAME:=$FLWR_FABRIC_IFNAME}"
fi
: "${NCCL_DEBUG:=WARN}"
: "${TORCH_NCCL_ASYNC_ERROR_HANDLING:=1}"
export NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING
for _v in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX; do
    if [[ -n "${!_v:-}" ]]; then export "${_v?}"; fi
done
unset _v

# --- helpers --------------------------------------------------------------------------------------------------------
# The S rendezvous ports of a group: FLWR_RENDEZVOUS_PORTS if set, else S ports from FLWR_RENDEZVOUS_PORT_BASE.
rendezvous_ports() {
    local shards="$1"
    if [[ -n "${FLWR_RENDEZVOUS_PORTS:-}" ]]; then
        echo "$FLWR_RENDEZVOUS_PORTS"
    else
        seq -s, "$FLWR_RENDEZVOUS_PORT_BASE" "$((FLWR_RENDEZVOUS_PORT_BASE + shards - 1))"
    fi
}

# The job's first node (rank 0's node: torchrun master, group endpoint, SuperNode, rendezvous stores).
leader_node() {
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
    else
        hostname
    fi
}

# The address other nodes reach HOST at, on the fabric interface if one is named (FLWR_FABRIC_IFNAME).
fabric_address() {
    local host="${1:-$(hostname)}"
    if [[ -n "${FLWR_FABRIC_ADDRESS:-}" ]]; then
        echo "$FLWR_FABRIC_ADDRESS"
    elif [[ -n "${FLWR_FABRIC_IFNAME:-}" && "$host" == "$(hostname)" ]] && command -v ip >/dev/null; then
        ip -4 -o addr show dev "$FLWR_FABRIC_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}'
    else
        getent hosts "$host" | awk '{print $1; exit}'
    fi
}

# is_loopback ADDRESS: whether ADDRESS (a host, host:port, [v6]:port) is 127.0.0.0/8, ::1 or localhost.
is_loopback() {
    local host="$1"
    if [[ "$host" == \[* ]]; then host="${host#[}"; host="${host%%]*}";   # [::1]:9093
    elif [[ "$host" == *:*:* ]]; then :;                                   # ::1, a bare IPv6 address
    else host="${host%%:*}"; fi                                            # 127.0.0.1:9093, localhost
    [[ "$host" == localhost || "$host" == ::1 || "$host" =~ ^127\.[0-9]+\.[0-9]+\.[0-9]+$ ]]
}

# plaintext_on_loopback_only WHAT ADDRESS: with FLWR_SHARDED_INSECURE=1, stop (exit 2, before anything starts)
# unless ADDRESS is a loopback address: plaintext Flower carries the model and the run's secrets unencrypted.
plaintext_on_loopback_only() {
    if [[ "$FLWR_SHARDED_INSECURE" == 1 ]] && ! is_loopback "$2"; then
        echo "FLWR_SHARDED_INSECURE=1 (plaintext Flower) is for loopback addresses only (127.0.0.0/8, ::1), and $1" \
             "is $2: use TLS and SuperNode authentication instead (deploy/tls/make-certs.sh," \
             "deploy/auth/make-supernode-keys.sh; docs/security.md)" >&2
        exit 2
    fi
}

# Flower's TLS + SuperNode-auth options as arrays (plaintext only with FLWR_SHARDED_INSECURE=1, and only on loopback):
#   superlink_tls_args BIND_HOST; flower-superlink "${TLS_ARGS[@]}" --host BIND_HOST ...
#   supernode_tls_args KEY SUPERLINK; flower-supernode "${TLS_ARGS[@]}" --superlink SUPERLINK ...
# shellcheck disable=SC2034  # TLS_ARGS is read by the caller
superlink_tls_args() {
    plaintext_on_loopback_only "the SuperLink's bind address" "$1"
    if [[ "$FLWR_SHARDED_INSECURE" == 1 ]]; then
        TLS_ARGS=(--insecure)
    else
        TLS_ARGS=(--ssl-ca-certfile "$FLWR_SHARDED_CERTS/ca.crt" --ssl-certfile "$FLWR_SHARDED_CERTS/server.pem"
                  --ssl-keyfile "$FLWR_SHARDED_CERTS/server.key" --enable-supernode-auth)
    fi
}
# shellcheck disable=SC2034
supernode_tls_args() {
    plaintext_on_loopback_only "the SuperLink's address" "$2"
    if [[ "$FLWR_SHARDED_INSECURE" == 1 ]]; then
        TLS_ARGS=(--insecure)
    else
        TLS_ARGS=(--root-certificates "$FLWR_SHARDED_CERTS/ca.crt" --auth-supernode-private-key "$1")
    fi
}
