#!/usr/bin/env bash
# Installs a working CRIU (>= 4.2) for the persistent shell's process snapshots and tests/test_criu.py.
#
# Why not `apt-get install criu`: Debian bookworm's criu 3.17 fails `criu check` on kernels >= 6.13 ("Unexpected
# rt vDSO area bounds", upstream criu issue 2532, fixed in 4.1), and trixie's 4.1.1 fails to dump any TCP socket
# on kernels >= 6.16 ("Can't get 1:16 opt", criu issue 2705, fixed in 4.2). Debian forky's criu 4.2.1 works, but
# needs a newer glibc than bookworm's. So this script builds a minimal trixie root with debootstrap (from the
# Debian mirror apt is already configured with), installs forky's criu package into it with that root's own apt
# (4 packages come from forky: criu, libcompel1, libnet9, libnl-3-200), and writes a wrapper that runs the root's
# dynamic loader on its criu with its libraries. Nothing on the host changes except the debootstrap package.
# Programs criu itself runs (ip) are the host's.
#
# Where: $TVCACHE_CRIU_DIR (default /var/cache/tvcache/criu): the root in root/, the wrapper at criu. It lives
# outside the checkout, so it survives clean checkouts and CI runs on one machine; a fresh machine builds it
# (~30-40 s, network-bound). tvcache finds the wrapper there (or at $TVCACHE_CRIU, or `criu` on PATH).
#
# Idempotent: when the wrapper exists, reports criu >= 4.2 and `criu check` passes, it does nothing (~0.1 s).
# Exit status: 0 when criu works, or when it cannot be installed here for a reason that is not a failure (not
# root, no apt-get, or this kernel fails `criu check` even so: the CRIU tests then skip, naming why);
# 1 when the download or the install fails (a real fault, which CI must see).
set -euo pipefail

dir=${TVCACHE_CRIU_DIR:-/var/cache/tvcache/criu}
suite=${TVCACHE_CRIU_SUITE:-trixie}   # the root's own release
from=${TVCACHE_CRIU_FROM:-forky}       # the release criu comes from
wrapper=$dir/criu
say() { echo "install-criu: $*" >&2; }

# The version criu reports ("Version: 4.1.1"), or nothing when it does not run.
version_of() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n1; }
# True when version $1 is at least 4.2.
recent_enough() { [ -n "$1" ] && [ "$(printf '%s\n4.2\n' "$1" | sort -V | head -n1)" = "4.2" ]; }

if [ -x "$wrapper" ]; then
    installed=$(version_of "$wrapper")
    if recent_enough "$installed"; then
        if report=$("$wrapper" check 2>&1); then
            say "criu $installed already installed at $wrapper; criu check: ${report##*$'\n'}"
            exit 0
        fi
        say "criu $installed is installed at $wrapper but 'criu check' fails on this kernel (the CRIU tests" \
            "will be skipped):"
        printf '%s\n' "$report" | tail -n 5 >&2
        exit 0
    fi
    say "the criu at $wrapper does not run or is older than 4.2 (${installed:-no version}); rebuilding it"
fi

if [ "$(uname -s)" != Linux ] || [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "not root on a Debian-like Linux; skipping (tests needing CRIU will be skipped; see 'make criu')"
    exit 0
fi
case "$(uname -m)" in
    x86_64) triplet=x86_64-linux-gnu loader=usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 ;;
    aarch64) triplet=aarch64-linux-gnu loader=usr/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1 ;;
    *) say "no known dynamic loader name for $(uname -m); skipping"; exit 0 ;;
esac

started=$(date +%s%N)
export DEBIAN_FRONTEND=noninteractive
if ! command -v debootstrap >/dev/null 2>&1; then
    say "installing debootstrap (apt-get)"
    if ! apt-get install -y -qq --no-install-recommends debootstrap >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    fi
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
    if [ -n "${build:-}" ] && [ -d "$build" ]; then
        { grep -o " $build/[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r target; do
            umount -l "$target" 2>/dev/null || true
        done
        rm -rf --one-file-system "$build"
    fi
}
trap cleanup EXIT

say "building a minimal $suite root in $dir (debootstrap from $mirror)"
if ! debootstrap --variant=minbase "$suite" "$build/root" "$mirror" >"$build/debootstrap.log" 2>&1; then
    say "debootstrap failed; the end of its log:"
    tail -n 20 "$build/debootstrap.log" >&2
    exit 1
fi
say "installing $from's criu package into it (chroot apt-get -t $from)"
# $from's index only for this install. The mirror here may be a dated snapshot whose testing Release has passed
# its Valid-Until date; the signatures are still checked.
mkdir -p "$build/root/etc/apt/sources.list.d"
echo "deb $mirror $from main" >"$build/root/etc/apt/sources.list.d/tvcache-criu.list"
apt_options=(-o Acquire::Check-Valid-Until=false -y -qq --no-install-recommends)
if ! { chroot "$build/root" apt-get "${apt_options[@]}" update &&
    chroot "$build/root" apt-get "${apt_options[@]}" install -t "$from" criu; } >"$build/apt.log" 2>&1; then
    say "apt-get install criu failed in the $suite root; the end of its log:"
    tail -n 20 "$build/apt.log" >&2
    exit 1
fi
rm -f "$build/root/etc/apt/sources.list.d/tvcache-criu.list"
chroot "$build/root" apt-get clean
rm -rf "$build/root/var/lib/apt/lists/"*

# The root moves to its final place before the wrapper that names it is written; a wrapper left from an older
# build goes first, so no wrapper ever points at a half-replaced root.
rm -f "$wrapper"
rm -rf --one-file-system "$dir/root"
mv "$build/root" "$dir/root"
cat >"$build/criu" <<EOF
#!/bin/sh
# Written by scripts/install-criu.sh: $from's criu in a $suite root, run by that root's dynamic loader on its
# libraries (the host's glibc is too old for it).
root='$dir/root'
exec "\$root/$loader" --library-path "\$root/usr/lib/$triplet:\$root/lib/$triplet" "\$root/usr/sbin/criu" "\$@"
EOF
chmod 755 "$build/criu"
mv "$build/criu" "$wrapper"

installed=$(version_of "$wrapper")
if ! recent_enough "$installed"; then
    say "the installed criu does not run or reports version '${installed}', not >= 4.2"
    exit 1
fi
ms=$(( ($(date +%s%N) - started) / 1000000 ))
elapsed=$((ms / 1000)).$(printf %03d $((ms % 1000)))
if report=$("$wrapper" check 2>&1); then
    say "criu $installed installed at $wrapper in ${elapsed} s; criu check: ${report##*$'\n'}"
else
    say "criu $installed installed at $wrapper in ${elapsed} s, but 'criu check' fails on this kernel:"
    printf '%s\n' "$report" | tail -n 5 >&2
fi
