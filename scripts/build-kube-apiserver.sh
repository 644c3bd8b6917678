#!/usr/bin/env bash
# Build a real kube-apiserver 1.20.2 from Debian bookworm's `kubernetes` source package, offline (GOPROXY=off),
# and cache the binary. Used by the local test cluster (tests/cluster). Recipe and reasons:
# ../shared/notes/kube-apiserver-from-debian.md.
#
# Idempotent and non-interactive: when the cached binary exists and runs, it only prints its path.
# The LAST line of stdout is always the binary path (callers do `... | tail -1`); progress goes to stderr.
#
# Env:
#   TORCHELASTIC_KUBE_CACHE  cache dir (default: $HOME/.cache/airflow-provider-torchelastic)
#   TORCHELASTIC_BUILD_DIR   parent dir for the temporary build tree (default: $TMPDIR or /tmp); needs ~2.1 GB
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive CI=true
exec </dev/null  # never wait for input (apt, make)

KUBE_VERSION=1.20.2
CACHE_DIR="${TORCHELASTIC_KUBE_CACHE:-$HOME/.cache/airflow-provider-torchelastic}"
BINARY="$CACHE_DIR/kube-apiserver-$KUBE_VERSION"

log() { printf '[build-kube-apiserver] %s\n' "$*" >&2; }

# Fast path: a cached binary that actually runs (a truncated copy from an interrupted run would not).
if [[ -x "$BINARY" ]] && "$BINARY" --version >/dev/null 2>&1; then
    echo "$BINARY"
    exit 0
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { log "need root or sudo to install Debian packages"; exit 1; }
    SUDO=(sudo -n)
fi

# --- 1. tool packages (apt-get update only when something is missing) --------------------------------------
PACKAGES=(etcd-server golang-go rsync golang-github-modern-go-reflect2-dev)
missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$pkg")
    fi
done
if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    "${SUDO[@]}" apt-get update -q >&2
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

# --- 2. source tarball via a temporary deb-src entry --------------------------------------------------------
WORK="$(mktemp -d "${TORCHELASTIC_BUILD_DIR:-${TMPDIR:-/tmp}}/kube-apiserver-build.XXXXXX")"
SRC_LIST=/etc/apt/sources.list.d/torchelastic-kube-apiserver-src.sources
cleanup() {
    local rc=$?
    if [[ -f "$SRC_LIST" ]]; then
        "${SUDO[@]}" rm -f "$SRC_LIST"
        # Refresh the lists so apt no longer carries the deb-src indexes we fetched.
        "${SUDO[@]}" apt-get update -q >/dev/null 2>&1 || true
    fi
    # The Go build cache inside the tree is read-only (go mod cache style); make it deletable first.
    chmod -R u+w "$WORK" 2>/dev/null || true
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# apt refuses two entries for one URI/suite with different Signed-By values ("Conflicting values set for option
# Signed-By"), and the stock deb822 debian.sources names the archive keyring, so name it here too.
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
SIGNED_BY=""
[[ -f "$KEYRING" ]] && SIGNED_BY="Signed-By: $KEYRING"
log "adding temporary deb-src entry $SRC_LIST"
"${SUDO[@]}" tee "$SRC_LIST" >/dev/null <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
$SIGNED_BY

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
$SIGNED_BY
EOF
"${SUDO[@]}" apt-get update -q >&2

cd "$WORK"
log "downloading the kubernetes source package into $WORK"
# --download-only: no dpkg-source unpack (its quilt patches touch only kubectl printers; the orig tarball suffices).
apt-get source --download-only kubernetes >&2
ORIG=(kubernetes_*.orig.tar.gz)
[[ -f "${ORIG[0]}" ]] || { log "no orig tarball downloaded"; exit 1; }
log "unpacking ${ORIG[0]}"
tar xzf "${ORIG[0]}"
SRC_DIR="$WORK/kubernetes-$KUBE_VERSION"
[[ -d "$SRC_DIR/cmd/kube-apiserver" ]] || { log "unexpected tarball layout: $SRC_DIR/cmd/kube-apiserver missing"; exit 1; }
cd "$SRC_DIR"

# --- 3. replace the vendored reflect2 -----------------------------------------------------------------------
# The vendored modern-go/reflect2 v1.0.1 crashes Go >= 1.18 binaries (fatal error in mapiternext) as soon as a
# custom resource is written; Debian's 1.0.2 is API-compatible and has the Go >= 1.18 map iteration code.
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
log "replacing vendor/github.com/modern-go/reflect2 with Debian's $REFLECT2_SRC"
rm -r vendor/github.com/modern-go/reflect2
mkdir vendor/github.com/modern-go/reflect2
cp "$REFLECT2_SRC"/*.go "$REFLECT2_SRC"/*.s vendor/github.com/modern-go/reflect2/

# --- 4. build (GOPATH layout as in debian/rules) ------------------------------------------------------------
mkdir -p .go/src/k8s.io
ln -s ../../.. .go/src/k8s.io/kubernetes
log "building cmd/kube-apiserver (offline; a cold build takes ~4-5 min on 2 cores)"
env GOPATH="$SRC_DIR/.go" CGO_ENABLED=0 GOPROXY=off make WHAT=cmd/kube-apiserver >&2
BUILT="$SRC_DIR/_output/bin/kube-apiserver"
"$BUILT" --version >&2

# --- 5. cache atomically (a concurrent reader never sees a half-written binary) -----------------------------
mkdir -p "$CACHE_DIR"
cp "$BUILT" "$BINARY.tmp.$$"
chmod 0755 "$BINARY.tmp.$$"
mv -f "$BINARY.tmp.$$" "$BINARY"
log "cached $BINARY"
echo "$BINARY"
