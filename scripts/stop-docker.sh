#!/usr/bin/env bash
# Stops the dockerd scripts/install-docker.sh started (and only that one: the pid in its pid file), after
# removing every container, snapshot image and checkpoint tvcache left in it (labelled tvcache.sandbox).
# The base image stays in the engine's data root, and its tarball in /var/cache/tvcache, for the next run.
# Idempotent; exit status 0 unless the engine refuses to stop within 30 s.
set -uo pipefail

pidfile=${TVCACHE_DOCKERD_PIDFILE:-/run/tvcache-dockerd.pid}
say() { echo "stop-docker: $*" >&2; }

if [ ! -s "$pidfile" ]; then
    say "no dockerd started by install-docker.sh is running; nothing to stop"
    exit 0
fi
pid=$(cat "$pidfile")
if ! kill -0 "$pid" 2>/dev/null; then
    say "dockerd $pid is gone already"
    rm -f "$pidfile"
    exit 0
fi

if timeout 20 docker info >/dev/null 2>&1; then
    containers=$(docker ps -aq --filter label=tvcache.sandbox=1)
    [ -n "$containers" ] && docker rm --force --volumes $containers >/dev/null 2>&1
    images=$(docker images -q --filter label=tvcache.sandbox=1 | sort -u)
    [ -n "$images" ] && docker image rm --force $images >/dev/null 2>&1
    docker image prune --force >/dev/null 2>&1
    say "removed $(echo $containers | wc -w) container(s) and $(echo $images | wc -w) image(s) left by tvcache"
fi

kill -TERM "$pid"
for _ in $(seq 1 300); do  # dockerd stops its containers and containerd, then exits: up to 30 s
    if ! kill -0 "$pid" 2>/dev/null; then
        rm -f "$pidfile"
        # containerd writes each `docker checkpoint` through a /tmp/ctrd-checkpoint* work directory it never
        # removes (~0.5 MB each): the engine that made them is ours and gone, so they go too.
        rm -rf /tmp/ctrd-checkpoint* 2>/dev/null || true
        say "dockerd $pid stopped"
        exit 0
    fi
    sleep 0.1
done
say "dockerd $pid did not stop within 30 s; killing it"
kill -KILL "$pid" 2>/dev/null
rm -f "$pidfile"
exit 1
