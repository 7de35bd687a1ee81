#!/usr/bin/env bash
# Host firewall rules for a flwr_sharded deployment, from the ports in deploy/env.sh:
#
#   FLWR_FEDERATION_NODES="10.0.0.0/24 10.1.0.7" deploy/firewall/make-rules.sh nft [S] > flwr_sharded.nft
#   sudo nft -f flwr_sharded.nft
#   FLWR_FEDERATION_NODES=... deploy/firewall/make-rules.sh iptables [S] > rules.v4    # and ip6tables > rules.v6
#   sudo iptables-restore --noflush rules.v4
#   sudo iptables -C INPUT -j FLWR_SHARDED || sudo iptables -I INPUT -j FLWR_SHARDED
#
# S: shard indices of the groups on this host (the rendezvous ports FLWR_RENDEZVOUS_PORT_BASE.. or
# FLWR_RENDEZVOUS_PORTS; default 8). Variables: FLWR_FEDERATION_NODES (required: addresses/CIDRs of every node of
# every group, space- or comma-separated), FLWR_SUPERLINK_CLIENTS (who may reach the SuperLink port: the SuperNodes'
# and operators' hosts; default FLWR_FEDERATION_NODES), FLWR_EPHEMERAL_PORTS (the range gloo and NCCL listen in:
# default this host's net.ipv4.ip_local_port_range). Rules: deploy/firewall/nftables.conf.in; docs/security.md.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || $# -lt 1 ]]; then usage; exit $(( $# < 1 ? 2 : 0 )); fi
format="$1"
shards="${2:-8}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=/dev/null
source "$here/../env.sh"

if [[ -z "${FLWR_FEDERATION_NODES:-}" ]]; then
    echo "make-rules.sh: set FLWR_FEDERATION_NODES (the federation's node addresses or CIDRs)" >&2
    exit 2
fi
: "${FLWR_SUPERLINK_CLIENTS:=$FLWR_FEDERATION_NODES}"
if [[ -z "${FLWR_EPHEMERAL_PORTS:-}" ]]; then
    if [[ -r /proc/sys/net/ipv4/ip_local_port_range ]]; then
        read -r low high < /proc/sys/net/ipv4/ip_local_port_range
        FLWR_EPHEMERAL_PORTS="$low-$high"
    else
        FLWR_EPHEMERAL_PORTS="32768-60999"
    fi
fi
if [[ ! "$FLWR_EPHEMERAL_PORTS" =~ ^[0-9]+-[0-9]+$ ]]; then
    echo "make-rules.sh: FLWR_EPHEMERAL_PORTS must be LOW-HIGH, got '$FLWR_EPHEMERAL_PORTS'" >&2
    exit 2
fi

# addresses of one family from a space/comma-separated list
family() {
    local want="$1" a
    for a in ${2//,/ }; do
        if [[ "$a" == *:* ]]; then [[ "$want" == 6 ]] && echo "$a"; else [[ "$want" == 4 ]] && echo "$a"; fi
    done
    return 0
}
# "elements = { a, b }" for an nft set, or nothing (an empty set)
elements() {
    local list
    list="$(family "$1" "$2" | paste -sd, - | sed 's/,/, /g')"
    [[ -n "$list" ]] && echo "elements = { $list }"
    return 0
}

rendezvous="$(rendezvous_ports "$shards")"
federation_ports="$FLWR_TORCHRUN_PORT, ${rendezvous//,/, }, $FLWR_EPHEMERAL_PORTS"
local_ports="$FLWR_SUPERNODE_PORT, $FLWR_GROUP_PORT"

case "$format" in
    nft)
        sed -e "s|@FEDERATION4@|$(elements 4 "$FLWR_FEDERATION_NODES")|" \
            -e "s|@FEDERATION6@|$(elements 6 "$FLWR_FEDERATION_NODES")|" \
            -e "s|@CLIENTS4@|$(elements 4 "$FLWR_SUPERLINK_CLIENTS")|" \
            -e "s|@CLIENTS6@|$(elements 6 "$FLWR_SUPERLINK_CLIENTS")|" \
            -e "s|@SUPERLINK_PORT@|$FLWR_SUPERLINK_PORT|g" -e "s|@LOCAL_PORTS@|$local_ports|g" \
            -e "s|@FEDERATION_PORTS@|$federation_ports|g" "$here/nftables.conf.in"
        ;;
    iptables|ip6tables)
        v=4; [[ "$format" == ip6tables ]] && v=6
        echo "# flwr_sharded host firewall ($format-restore --noflush), rendered by deploy/firewall/make-rules.sh"
        echo "# from deploy/env.sh; then: $format -C INPUT -j FLWR_SHARDED || $format -I INPUT -j FLWR_SHARDED"
        echo "*filter"
        echo ":FLWR_SHARDED - [0:0]"
        echo "-A FLWR_SHARDED -i lo -j RETURN"
        echo "-A FLWR_SHARDED -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"
        for a in $(family "$v" "$FLWR_SUPERLINK_CLIENTS"); do
            echo "-A FLWR_SHARDED -p tcp --dport $FLWR_SUPERLINK_PORT -s $a -j RETURN"
        done
        echo "-A FLWR_SHARDED -p tcp --dport $FLWR_SUPERLINK_PORT -j DROP"
        echo "-A FLWR_SHARDED -p tcp -m multiport --dports ${local_ports// /} -j DROP"
        # multiport takes at most 15 ports (a range counts twice): rules of 7 entries each
        read -r -a entries <<< "${federation_ports//,/ }"
        for ((i = 0; i < ${#entries[@]}; i += 7)); do
            ports="$(printf '%s\n' "${entries[@]:i:7}" | paste -sd, - | tr - :)"
            for a in $(family "$v" "$FLWR_FEDERATION_NODES"); do
                echo "-A FLWR_SHARDED -p tcp -m multiport --dports $ports -s $a -j RETURN"
            done
            echo "-A FLWR_SHARDED -p tcp -m multiport --dports $ports -j DROP"
        done
        echo "COMMIT"
        ;;
    *)
        echo "make-rules.sh: format must be nft, iptables or ip6tables, got '$format'" >&2
        exit 2
        ;;
esac
