#!/usr/bin/env bash
# Submit this facility's groups of a cross-facility federation: one group.sbatch job per group.
#
#   deploy/slurm/cross-facility/submit-groups.sh SITE_ENV FIRST_PARTITION COUNT NUM_PARTITIONS [sbatch options ...]
#   e.g. on facility A:  submit-groups.sh deploy/slurm/cross-facility/site-a.env 0 8 16 --nodes 8 -A proj
#        on facility B:  submit-groups.sh deploy/slurm/cross-facility/site-b.env 8 8 16 --nodes 8 -A other
#   Group i runs partition i with the SuperNode key $FLWR_SHARDED_KEYS/group-i (register every key.pub first).
set -euo pipefail
if [[ $# -lt 4 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0
    exit 2
fi
site_env="$(realpath "$1")"
first="$2"
count="$3"
total="$4"
shift 4
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
for ((i = first; i < first + count; i++)); do
    sbatch --export="ALL,FLWR_SHARDED_REPO=$repo,FLWR_SHARDED_SITE_ENV=$site_env,FLWR_PARTITION_ID=$i,FLWR_NUM_PARTITIONS=$total,FLWR_GROUP_NAME=group-$i" \
        --job-name "flwr-group-$i" "$@" "$repo/deploy/slurm/group.sbatch"
done
