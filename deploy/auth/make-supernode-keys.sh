#!/usr/bin/env bash
# Make EC key pairs for Flower 1.42 SuperNode authentication (OpenSSH format, NIST curve P-384).
#
#   deploy/auth/make-supernode-keys.sh OUT_DIR NAME [NAME ...]
#   Writes OUT_DIR/NAME (private key, mode 600: stays on the SuperNode's machine) and OUT_DIR/NAME.pub.
#   Existing keys are kept. Then, with the SuperLink running with --enable-supernode-auth (TLS required):
#     flwr supernode register OUT_DIR/NAME.pub CONNECTION     # the operator, through the Control API
#     flower-supernode --auth-supernode-private-key OUT_DIR/NAME --root-certificates ca.crt ...
#   A SuperNode whose public key is not registered is refused.
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0
    exit 2
fi
out="$1"
shift
mkdir -p "$out"
umask 077
for name in "$@"; do
    [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "make-supernode-keys.sh: bad name '$name'" >&2; exit 2; }
    key="$out/$name"
    if [[ ! -f "$key" ]]; then
        if command -v ssh-keygen >/dev/null; then
            ssh-keygen -q -t ecdsa -b 384 -N "" -C "$name" -f "$key"
        else
            # no OpenSSH client: openssl makes the key, Python's cryptography (a Flower dependency) converts it
            openssl ecparam -name secp384r1 -genkey -noout | python3 -c '
import sys
from cryptography.hazmat.primitives import serialization as s
k = s.load_pem_private_key(sys.stdin.buffer.read(), None)
open(sys.argv[1], "wb").write(k.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
pub = k.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH)
open(sys.argv[1] + ".pub", "wb").write(pub + b" " + sys.argv[2].encode() + b"\n")' "$key" "$name"
        fi
    fi
    chmod 600 "$key"
    chmod 644 "$key.pub"
    echo "make-supernode-keys.sh: $key, $key.pub"
done
