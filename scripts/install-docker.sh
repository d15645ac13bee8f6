#!/usr/bin/env bash
# Installs and starts a Docker engine for the DockerSandbox tests (tests/test_docker.py) and the Dockerfile
# workload; `scripts/stop-docker.sh` stops it again. CI runs both around the engine tests (.ci/run).
#
# What: Debian's docker.io (dockerd 20.10 with its containerd and runc), started with the overlay2 storage
# driver and --experimental (which `docker checkpoint` needs). When scripts/install-criu.sh has installed a
# CRIU >= 4.1 (bookworm's 3.17 fails on kernels >= 6.13), its directory goes first on dockerd's PATH, so runc
# finds that criu and checkpoints work; without it tvcache declines checkpoints (they are optional).
# With TVCACHE_PODMAN=1, Debian's podman is installed too (the same backend drives it: DockerSandbox with
# engine="podman").
#
# Idempotent: when an engine already answers (a developer's own, or one this script started), it is left as it
# is and nothing is installed (~0.1 s). Only a dockerd this script started (its pid file, below) is ever stopped
# by scripts/stop-docker.sh.
#
# Exit status: 0 when an engine answers, or when one cannot be installed here for a reason that is not a
# failure (not root, no apt-get: the engine tests then skip, naming why, unless TVCACHE_REQUIRE_DOCKER=1);
# 1 when the install fails or the engine does not come up (a real fault, which CI must see).
set -euo pipefail

pidfile=${TVCACHE_DOCKERD_PIDFILE:-/run/tvcache-dockerd.pid}
log=${TVCACHE_DOCKERD_LOG:-/var/log/tvcache-dockerd.log}
criu_dir=$(dirname "${TVCACHE_CRIU:-${TVCACHE_CRIU_DIR:-/var/cache/tvcache/criu}/criu}")
say() { echo "install-docker: $*" >&2; }
answers() { timeout 20 docker info --format '{{.ServerVersion}}' >/dev/null 2>&1; }

install_podman() {
    if [ "${TVCACHE_PODMAN:-0}" = 1 ] && ! command -v podman >/dev/null 2>&1; then
        say "installing podman (apt-get)"
        apt-get install -y -qq --no-install-recommends podman >/dev/null
    fi
}

if command -v docker >/dev/null 2>&1 && answers; then
    say "a Docker engine already answers ($(docker info --format '{{.ServerVersion}}' 2>/dev/null)); leaving it"
    install_podman
    exit 0
fi
if [ "$(uname -s)" != Linux ] || [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "not root on a Debian-like Linux; skipping (the Docker engine tests will be skipped)"
    exit 0
fi

started=$(date +%s%N)
export DEBIAN_FRONTEND=noninteractive
if ! command -v dockerd >/dev/null 2>&1; then
    say "installing docker.io (apt-get)"
    # No service manager runs here, and the package must not try to start one: dockerd is started below.
    if ! apt-get install -y -qq --no-install-recommends docker.io >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends docker.io >/dev/null
    fi
fi
install_podman

engine_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if [ -x "$criu_dir/criu" ]; then
    engine_path=$criu_dir:$engine_path
    say "runc will use the criu in $criu_dir (docker checkpoint enabled)"
fi

say "starting dockerd (overlay2, --experimental); its log: $log"
# setsid: the engine must outlive this script and the CI step's process group until stop-docker.sh.
PATH=$engine_path setsid dockerd --storage-driver=overlay2 --experimental --pidfile "$pidfile" \
    </dev/null >>"$log" 2>&1 &
for _ in $(seq 1 300); do  # up to 30 s
    if answers; then
        ms=$(( ($(date +%s%N) - started) / 1000000 ))
        say "Docker engine $(docker info --format '{{.ServerVersion}}') answers after $((ms / 1000)).$(printf %03d $((ms % 1000))) s"
        exit 0
    fi
    if ! kill -0 $! 2>/dev/null; then
        say "dockerd exited; the end of its log:"
        tail -n 20 "$log" >&2
        exit 1
    fi
    sleep 0.1
done
say "dockerd did not answer within 30 s; the end of its log:"
tail -n 20 "$log" >&2
exit 1
