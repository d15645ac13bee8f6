#!/bin/bash
# The ledger's test suite: each case feeds build/ledger a few lines and compares its sorted output.
set -uo pipefail
export LC_ALL=C
cd "$(dirname "$0")"
if [ ! -x build/ledger ]; then
    echo "build/ledger is missing: run ./build.sh first"
    exit 2
fi
passed=0
failed=0
check() {  # name, input lines, expected output
    local got
    got=$(printf '%s\n' "$2" | build/ledger 2>&1 | sort)
    if [ "$got" == "$3" ]; then
        passed=$((passed + 1))
        echo "ok - $1"
    else
        failed=$((failed + 1))
        echo "not ok - $1"
        printf '  expected: %s\n  got:      %s\n' "${3//$'\n'/ | }" "${got//$'\n'/ | }"
    fi
}
check "one credit" "2024-01-02,cash,credit,10.00" "cash 1 10.00"
check "credit and debit" $'2024-01-02,cash,credit,10.00\n2024-01-03,cash,debit,2.50' "cash 2 7.50"
check "cents are rounded" $'2024-01-02,cash,credit,0.29\n2024-01-02,cash,credit,1.13' "cash 2 1.42"
check "negative balance" $'2024-01-02,bank,debit,3.07\n2024-01-05,bank,credit,1.01' "bank 2 -2.06"
check "two accounts" $'2024-01-02,a,credit,1.00\n2024-01-02,b,debit,1.00' $'a 1 1.00\nb 1 -1.00'
check "comments and blank lines" $'# header\n\n2024-02-01,cash,credit,5.55' "cash 1 5.55"
check "unknown kind" "2024-01-02,cash,refund,1.00" "line 1: unknown kind refund"
check "short line" "2024-01-02,cash,1.00" "line 1: expected 4 fields, got 3"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
