#!/usr/bin/env bash
# Builds the local base image the Docker engine tests and the Dockerfile workload start from, without a
# registry (none is reachable from CI): a minimal Debian bookworm root from debootstrap, imported into the
# engine as $TVCACHE_DOCKER_IMAGE (default tvcache-base:bookworm), with bash, coreutils and a PATH.
#
# The root's tarball is kept in $TVCACHE_BASE_DIR (default /var/cache/tvcache/base), outside the checkout: it
# survives clean checkouts and CI runs on one machine; a fresh machine builds it (~30 s, network-bound).
# Idempotent: when the engine already has the image, nothing happens; when only the tarball exists, it is
# imported (~2 s). With ENGINE=podman the image is imported into podman instead.
#
# Exit status: 0 when the image exists afterwards, or when no engine answers (nothing to import into: the engine
# tests then skip, naming why); 1 when debootstrap or the import fails.
set -euo pipefail

image=${TVCACHE_DOCKER_IMAGE:-tvcache-base:bookworm}
dir=${TVCACHE_BASE_DIR:-/var/cache/tvcache/base}
suite=${TVCACHE_BASE_SUITE:-bookworm}
engine=${ENGINE:-docker}
tarball=$dir/$suite-minbase.tar
say() { echo "build-base-image: $*" >&2; }

if ! command -v "$engine" >/dev/null 2>&1 || ! timeout 20 "$engine" info >/dev/null 2>&1; then
    say "no $engine engine answers; skipping (start one with scripts/install-docker.sh)"
    exit 0
fi
if "$engine" image inspect "$image" >/dev/null 2>&1; then
    say "$engine already has $image; nothing to do"
    exit 0
fi
started=$(date +%s%N)

if [ ! -s "$tarball" ]; then
    if ! command -v debootstrap >/dev/null 2>&1; then
        say "installing debootstrap (apt-get)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    fi
    # The Debian mirror apt already uses (deb822 sources or a one-line list), so no other network is needed.
    mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)\/\?$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    if [ -z "$mirror" ]; then
        mirror=$(sed -n 's/^deb \(\[[^]]*\] \)\?\([^ ]*\/debian\)\/\? .*/\2/p' /etc/apt/sources.list 2>/dev/null \
            | head -n1)
    fi
    mirror=${mirror:-http://deb.debian.org/debian}
    mkdir -p "$dir"
    build=$(mktemp -d "$dir/.build.XXXXXX")
    cleanup() {
        # debootstrap mounts proc and sys in the new root while it runs: an interrupted run must not leave them.
        { grep -o " $build/[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r target; do
            umount -l "$target" 2>/dev/null || true
        done
        rm -rf --one-file-system "$build"
    }
    trap cleanup EXIT
    say "building a minimal $suite root (debootstrap from $mirror)"
    if ! debootstrap --variant=minbase "$suite" "$build/root" "$mirror" >"$build/debootstrap.log" 2>&1; then
        say "debootstrap failed; the end of its log:"
        tail -n 20 "$build/debootstrap.log" >&2
        exit 1
    fi
    rm -rf "$build/root/var/lib/apt/lists/"* "$build/root/var/cache/apt/"*.bin
    tar -C "$build/root" --numeric-owner -cf "$build/root.tar" .
    mv "$build/root.tar" "$tarball"  # whole or not at all: an interrupted build leaves no tarball behind
fi

say "importing $tarball as $image into $engine"
"$engine" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    "$tarball" "$image" >/dev/null
ms=$(( ($(date +%s%N) - started) / 1000000 ))
say "$image ready in $((ms / 1000)).$(printf %03d $((ms % 1000))) s"
