#!/bin/bash
# Starts the service (serve.pl) on its own loopback port, checks its answers against build/balances.txt,
# and stops it again.
set -uo pipefail
export LC_ALL=C
cd "$(dirname "$0")"
port=${LEDGER_PORT:-8080}
if [ ! -f build/balances.txt ]; then
    echo "build/balances.txt is missing: run ./build.sh first"
    exit 2
fi
perl serve.pl >build/serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
get() {  # path -> "status body" (the body's lines joined by spaces)
    local reply
    exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
    printf 'GET %s HTTP/1.0\r\n\r\n' "$1" >&3
    reply=$(tr -d '\r' <&3)
    exec 3<&-
    echo "$(head -n 1 <<<"$reply" | cut -d ' ' -f 2) $(sed '1,/^$/d' <<<"$reply" | paste -s -d ' ')"
}
for _ in $(seq 1 100); do  # up to 5 s for the server to listen
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    if ! kill -0 $server 2>/dev/null; then
        echo "the service did not start:"
        cat build/serve.log
        exit 1
    fi
    sleep 0.05
done
passed=0
failed=0
expect() {  # name, path, expected "status body"
    local got
    got=$(get "$2")
    if [ "$got" == "$3" ]; then
        passed=$((passed + 1))
        echo "ok - $1"
    else
        failed=$((failed + 1))
        echo "not ok - $1: GET $2 gave '$got', expected '$3'"
    fi
}
expect "health" /health "200 ok"
expect "accounts" /accounts "200 $(cut -d ' ' -f 1 build/balances.txt | paste -s -d ' ')"
for account in acct-00 acct-17 acct-39; do
    expect "balance of $account" "/balance/$account" "200 $(awk -v a=$account '$1 == a { print $3 }' build/balances.txt)"
done
expect "unknown account" /balance/nobody "404 no account nobody"
expect "unknown route" /nothing "404 no route /nothing"
echo "service: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
