#!/usr/bin/env bash
# Build the node side of the local test cluster's real node: kubelet, kube-scheduler and kube-controller-manager
# 1.20.2 (CGO_ENABLED=0), plus the static pause binary from the source's build/pause, from the same Debian bookworm
# `kubernetes` source package as scripts/build-kube-apiserver.sh, offline (GOPROXY=off). Used by
# tests/cluster/real_node.py. Recipe and reasons: ../shared/notes/kube-apiserver-from-debian.md and
# ../shared/notes/real-node.md.
#
# Idempotent and non-interactive: when the cached binaries exist and run, it only prints their folder.
# The LAST line of stdout is always the folder holding kubelet, kube-scheduler, kube-controller-manager and pause
# (callers do `... | tail -1`); progress goes to stderr, and the whole build's output is kept in
# $CACHE_DIR/kube-node-$KUBE_VERSION.build.log. A cold build takes about 13 minutes on 2 loaded cores; the compile
# runs under `nice -n 19`.
#
# Env:
#   TORCHELASTIC_KUBE_CACHE  cache dir (default: $HOME/.cache/airflow-provider-torchelastic)
#   TORCHELASTIC_BUILD_DIR   parent dir for the temporary build tree (default: $TMPDIR or /tmp); needs ~2.5 GB
set -euo pipefail

export DEBIAN_FRONTEND=noninteractive CI=true
exec </dev/null  # never wait for input (apt, make)

KUBE_VERSION=1.20.2
CACHE_DIR="${TORCHELASTIC_KUBE_CACHE:-$HOME/.cache/airflow-provider-torchelastic}"
OUT_DIR="$CACHE_DIR/kube-node-$KUBE_VERSION"
BUILD_LOG="$CACHE_DIR/kube-node-$KUBE_VERSION.build.log"
GO_BINARIES=(kubelet kube-scheduler kube-controller-manager)

log() { printf '[build-kube-node] %s\n' "$*" >&2; }

cached_ok() {
    local b
    for b in "${GO_BINARIES[@]}"; do
        [[ -x "$OUT_DIR/$b" ]] && "$OUT_DIR/$b" --version >/dev/null 2>&1 || return 1
    done
    # pause prints its version with -v and exits 0.
    [[ -x "$OUT_DIR/pause" ]] && "$OUT_DIR/pause" -v >/dev/null 2>&1
}

# Fast path: cached binaries that actually run (a truncated copy from an interrupted run would not).
if cached_ok; then
    echo "$OUT_DIR"
    exit 0
fi

SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || { log "need root or sudo to install Debian packages"; exit 1; }
    SUDO=(sudo -n)
fi

mkdir -p "$CACHE_DIR"
: >"$BUILD_LOG"
log "build log: $BUILD_LOG"
# Everything below also goes to the build log; stderr keeps showing it as progress.
exec 2> >(tee -a "$BUILD_LOG" >&2)

# --- 1. tool packages (apt-get update only when something is missing) --------------------------------------
# gcc + libc6-dev for the static pause binary.
PACKAGES=(golang-go rsync golang-github-modern-go-reflect2-dev gcc libc6-dev)
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
WORK="$(mktemp -d "${TORCHELASTIC_BUILD_DIR:-${TMPDIR:-/tmp}}/kube-node-build.XXXXXX")"
SRC_LIST=/etc/apt/sources.list.d/torchelastic-kube-node-src.sources
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
    ((rc == 0)) || log "FAILED (exit $rc); see $BUILD_LOG"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Same Signed-By as the stock deb822 debian.sources, or apt refuses the second entry ("Conflicting values").
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
apt-get source --download-only kubernetes >&2
ORIG=(kubernetes_*.orig.tar.gz)
[[ -f "${ORIG[0]}" ]] || { log "no orig tarball downloaded"; exit 1; }
log "unpacking ${ORIG[0]}"
tar xzf "${ORIG[0]}"
SRC_DIR="$WORK/kubernetes-$KUBE_VERSION"
[[ -d "$SRC_DIR/cmd/kubelet" ]] || { log "unexpected tarball layout: $SRC_DIR/cmd/kubelet missing"; exit 1; }
cd "$SRC_DIR"

# --- 3. replace the vendored reflect2 (see build-kube-apiserver.sh) -----------------------------------------
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
log "replacing vendor/github.com/modern-go/reflect2 with Debian's $REFLECT2_SRC"
rm -r vendor/github.com/modern-go/reflect2
mkdir vendor/github.com/modern-go/reflect2
cp "$REFLECT2_SRC"/*.go "$REFLECT2_SRC"/*.s vendor/github.com/modern-go/reflect2/

# --- 4. pause (static C, as build/pause/Makefile does it) ---------------------------------------------------
PAUSE_C=build/pause/pause.c
[[ -f "$PAUSE_C" ]] || PAUSE_C=build/pause/linux/pause.c
[[ -f "$PAUSE_C" ]] || { log "no build/pause/pause.c in the source"; exit 1; }
PAUSE_TAG="$(sed -n 's/^TAG[[:space:]]*?\{0,1\}=[[:space:]]*//p' build/pause/Makefile | head -1)"
log "building pause ${PAUSE_TAG:-?} from $PAUSE_C (gcc -static)"
mkdir -p _output/pause
nice -n 19 gcc -Os -Wall -Werror -static -DVERSION="v${PAUSE_TAG:-3}-torchelastic" -o _output/pause/pause "$PAUSE_C" >&2
_output/pause/pause -v >&2

# --- 5. Go binaries (GOPATH layout as in debian/rules) ------------------------------------------------------
mkdir -p .go/src/k8s.io
ln -s ../../.. .go/src/k8s.io/kubernetes
WHAT=""
for b in "${GO_BINARIES[@]}"; do WHAT+="cmd/$b "; done
log "building ${WHAT}(offline, nice -n 19; a cold build takes ~13 min on 2 loaded cores)"
start=$SECONDS
# make prints one "+++ [...] Building go targets" line, then is silent for minutes: print a heartbeat.
(while sleep 60; do log "... still compiling ($(((SECONDS - start) / 60)) min)"; done) &
HEARTBEAT=$!
set +e
env GOPATH="$SRC_DIR/.go" CGO_ENABLED=0 GOPROXY=off nice -n 19 make WHAT="${WHAT% }" >&2
rc=$?
set -e
kill "$HEARTBEAT" 2>/dev/null || true
wait "$HEARTBEAT" 2>/dev/null || true
((rc == 0)) || { log "make failed (exit $rc)"; exit "$rc"; }
log "compiled in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"

# --- 6. cache atomically (a concurrent reader never sees a half-written folder) -----------------------------
STAGE="$CACHE_DIR/.kube-node-$KUBE_VERSION.tmp.$$"
rm -rf "$STAGE"
mkdir -p "$STAGE"
for b in "${GO_BINARIES[@]}"; do
    "$SRC_DIR/_output/bin/$b" --version >&2
    cp "$SRC_DIR/_output/bin/$b" "$STAGE/$b"
done
cp _output/pause/pause "$STAGE/pause"
chmod 0755 "$STAGE"/*
rm -rf "$OUT_DIR.old"
[[ -d "$OUT_DIR" ]] && mv "$OUT_DIR" "$OUT_DIR.old"
mv "$STAGE" "$OUT_DIR"
rm -rf "$OUT_DIR.old"
log "cached $OUT_DIR"
echo "$OUT_DIR"
