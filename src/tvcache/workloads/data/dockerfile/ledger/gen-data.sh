#!/bin/bash
# Writes the ledger's data set: $1 transactions over 40 accounts, the same every time (no randomness).
set -euo pipefail
awk -v n="$1" 'BEGIN {
    print "# date,account,kind,amount"
    for (i = 1; i <= n; i++) {
        x = (i * 7919) % 100003
        printf("2024-%02d-%02d,acct-%02d,%s,%d.%02d\n", 1 + x % 12, 1 + x % 28, x % 40, x % 3 ? "credit" : "debit",
               x % 500, (i * 37) % 100)
    }
}'
