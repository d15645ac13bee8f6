#!/bin/bash
# Builds the ledger: checks the awk program, generates the build/ledger tool from it, computes
# build/balances.txt from data/transactions.csv and checks the result against the recorded checksum.
set -euo pipefail
export LC_ALL=C
cd "$(dirname "$0")"
mkdir -p build
echo "check: awk -f ledger.awk"
awk -f ledger.awk </dev/null
echo "generate: build/ledger"
{ echo '#!/usr/bin/awk -f'; cat ledger.awk; } >build/ledger.new
chmod +x build/ledger.new
mv build/ledger.new build/ledger
echo "compute: build/balances.txt"
build/ledger data/transactions.csv | sort >build/balances.new
mv build/balances.new build/balances.txt
echo "built: $(wc -l <build/balances.txt) accounts from $(grep -vc '^#' data/transactions.csv) transactions"
if [ -f balances.sha256 ]; then
    sha256sum --quiet --check balances.sha256 && echo "verify: balances match balances.sha256"
fi
