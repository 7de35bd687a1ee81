#!/usr/bin/env bash
# Make a CA and a SuperLink server certificate (with SANs) for Flower's TLS, or check given ones.
#
#   deploy/tls/make-certs.sh OUT_DIR [SAN ...]
#     SAN: DNS names or IP addresses the SuperNodes and `flwr` use to reach the SuperLink
#          (default: localhost 127.0.0.1 and this host's name).
#   Writes OUT_DIR/ca.crt, ca.key (keep private, off the SuperLink if you can), server.pem, server.key.
#   Existing files are kept (re-running is safe); delete them to renew. To use certificates from your own CA,
#   put ca.crt, server.pem and server.key in OUT_DIR: the script only verifies them.
#
#   SuperLink: flower-superlink --ssl-ca-certfile OUT/ca.crt --ssl-certfile OUT/server.pem --ssl-keyfile OUT/server.key
#   SuperNode: flower-supernode --root-certificates OUT/ca.crt ...
#   flwr CLI:  [superlink.NAME] address = "host:port"  root-certificates = "OUT/ca.crt"
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0
    exit 2
fi
out="$1"
shift
sans=("$@")
if [[ ${#sans[@]} -eq 0 ]]; then
    sans=(localhost 127.0.0.1 "$(hostname)")
fi
days="${CERT_DAYS:-365}"

command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }
mkdir -p "$out"
umask 077

if [[ ! -f "$out/ca.crt" ]]; then
    openssl req -x509 -newkey rsa:4096 -sha256 -nodes -days "$days" \
        -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=flwr_sharded CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

if [[ ! -f "$out/server.pem" ]]; then
    [[ -f "$out/ca.key" ]] || { echo "make-certs.sh: $out/ca.crt exists without ca.key: cannot sign" >&2; exit 1; }
    alt=""
    for san in "${sans[@]}"; do
        if [[ "$san" =~ ^[0-9.]+$ || "$san" == *:* ]]; then
            alt+="${alt:+,}IP:$san"
        else
            alt+="${alt:+,}DNS:$san"
        fi
    done
    ext="$(mktemp)"
    trap 'rm -f "$ext" "$out/server.csr"' EXIT
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
        "$alt" > "$ext"
    openssl req -new -newkey rsa:4096 -nodes -keyout "$out/server.key" -out "$out/server.csr" \
        -subj "/CN=${sans[0]}" 2>/dev/null
    openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
        -out "$out/server.pem" -days "$days" -sha256 -extfile "$ext" 2>/dev/null
    echo "make-certs.sh: server certificate for ${alt}"
fi

chmod 600 "$out"/*.key 2>/dev/null || true
chmod 644 "$out/ca.crt" "$out/server.pem"
openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null
echo "make-certs.sh: $out/ca.crt, $out/server.pem, $out/server.key ok"
