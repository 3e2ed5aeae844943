#!/usr/bin/env bash
# Build a real Kubernetes CRD API server (k8s.io/apiextensions-apiserver) and fetch etcd, offline
# from Debian sid's packages, for the real-API-server test stage (tests/operator/test_real_apiserver.py).
#
# Nothing is installed system-wide: apt runs against a private sources list and private state
# folders; packages are downloaded and unpacked with `dpkg-deb -x`; the Go build runs in GOPATH mode
# with no network. The result is cached OUTSIDE the checkout, keyed by the apiextensions version:
#
#   ${MERGEPIPE_APISERVER_CACHE:-~/.cache/mergepipe-apiserver}/<version>/bin/{apiextensions-apiserver,etcd}
#   ${MERGEPIPE_APISERVER_CACHE:-~/.cache/mergepipe-apiserver}/current -> <version>
#
# When `current` holds both binaries the script does nothing (no network). Set
# MERGEPIPE_APISERVER_REBUILD=1 to resolve sid's current version again and build it if new.
# Cold cost (measured; the figures quoted in several places live in docs/figures.json): it
# downloads ~324 MB of .debs, ~2.5 GB unpacked sources
# and a ~1.4 GB compile cache (both deleted after a successful build; the compile cache is kept
# when a build fails, so a retry resumes), 5-30 min of build on 2 cores. Prints the bin folder on
# its last line.
set -euo pipefail

CACHE="${MERGEPIPE_APISERVER_CACHE:-$HOME/.cache/mergepipe-apiserver}"
MIRROR="${MERGEPIPE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KEYRING="${MERGEPIPE_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"
mkdir -p "$CACHE"

if [[ -z "${MERGEPIPE_APISERVER_REBUILD:-}" && -x "$CACHE/current/bin/apiextensions-apiserver" \
      && -x "$CACHE/current/bin/etcd" ]]; then
  echo "$(cd "$CACHE/current/bin" && pwd -P)"
  exit 0
fi

for tool in apt-get apt-cache dpkg-deb; do
  command -v "$tool" >/dev/null || { echo "build.sh: '$tool' is required (a Debian/Ubuntu host)" >&2; exit 2; }
done

# One build at a time per cache folder (CI and a developer's pytest may race).
exec 9>"$CACHE/.lock"
flock 9

APT="$CACHE/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs"
echo "deb [signed-by=$KEYRING] $MIRROR sid main" > "$APT/sources.list"
: > "$APT/status"
APTOPT=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache" -o "Dir::State::status=$APT/status"
        -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)" -o "Acquire::Languages=none")

echo "build.sh: reading Debian sid's package index" >&2
apt-get "${APTOPT[@]}" -qq update

version_of() { apt-cache "${APTOPT[@]}" show "$1" 2>/dev/null | awk '/^Version:/{print $2; exit}'; }
APIEXT_VERSION="$(version_of golang-k8s-apiextensions-apiserver-dev)"
[[ -n "$APIEXT_VERSION" ]] || { echo "build.sh: sid has no golang-k8s-apiextensions-apiserver-dev" >&2; exit 1; }
KEY="${APIEXT_VERSION%%-*}"                       # 0.36.4-1 -> 0.36.4
OUT="$CACHE/$KEY"
if [[ -x "$OUT/bin/apiextensions-apiserver" && -x "$OUT/bin/etcd" ]]; then
  ln -sfn "$KEY" "$CACHE/current"
  echo "$OUT/bin"
  exit 0
fi

# The Go toolchain sid's golang-go points at (golang-1.NN-go + its -src), and etcd.
GOPKG="$(apt-cache "${APTOPT[@]}" depends golang-go | awk '/Depends: golang-1\.[0-9]+-go/{print $2; exit}')"
[[ -n "$GOPKG" ]] || { echo "build.sh: cannot find sid's Go toolchain package" >&2; exit 1; }
GOVER="${GOPKG#golang-}"; GOVER="${GOVER%-go}"  # golang-1.27-go -> 1.27
mapfile -t DEPS < <(apt-cache "${APTOPT[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances golang-k8s-apiextensions-apiserver-dev \
  | grep -v '^ ' | grep -E '^golang-.*-dev$' | sort -u)
echo "build.sh: apiextensions-apiserver $APIEXT_VERSION, Go $GOVER, ${#DEPS[@]} source packages" >&2

( cd "$APT/debs" && rm -f ./*.deb && apt-get "${APTOPT[@]}" -qq download \
    "${DEPS[@]}" "$GOPKG" "golang-$GOVER-src" etcd-server )
echo "build.sh: downloaded $(du -sm "$APT/debs" | cut -f1) MB of .debs" >&2

ROOT="$CACHE/root.$$"
rm -rf "$ROOT"; mkdir -p "$ROOT"
trap 'rm -rf "$ROOT"' EXIT
for deb in "$APT/debs"/*.deb; do dpkg-deb -x "$deb" "$ROOT"; done

mkdir -p "$OUT.tmp/bin" "$CACHE/gocache"
echo "build.sh: go build k8s.io/apiextensions-apiserver (5-30 min on 2 cores)" >&2
start=$(date +%s)
# Build from inside the cache, not from the caller's folder (a checkout may change under a long
# build); the compile cache survives a failed or interrupted build, so a retry resumes.
cd "$CACHE"
env -i PATH="$ROOT/usr/lib/go-$GOVER/bin:/usr/bin:/bin" HOME="$ROOT" \
  GOROOT="$ROOT/usr/lib/go-$GOVER" GOPATH="$ROOT/usr/share/gocode" GOCACHE="$CACHE/gocache" \
  GO111MODULE=off GOTOOLCHAIN=local GOPROXY=off CGO_ENABLED=0 \
  nice go build -trimpath -ldflags=-s -o "$OUT.tmp/bin/apiextensions-apiserver" k8s.io/apiextensions-apiserver
echo "build.sh: built in $(( $(date +%s) - start )) s" >&2
cp "$ROOT/usr/bin/etcd" "$OUT.tmp/bin/etcd"
{ echo "apiextensions-apiserver $APIEXT_VERSION (Debian sid, go $GOVER)"
  echo "etcd $(version_of etcd-server)"; } > "$OUT.tmp/VERSIONS"
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
ln -sfn "$KEY" "$CACHE/current"
rm -rf "$APT/debs"/*.deb "$CACHE/gocache"
echo "$OUT/bin"
