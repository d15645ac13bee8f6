# ledger.awk: balances per account from CSV lines "date,account,kind,amount" (kind: credit or debit; amount
# in euros with two decimals). Prints "account transactions balance", one account a line, in no set order.
BEGIN { FS = "," }
/^#/ || NF == 0 { next }
NF != 4 { printf("line %d: expected 4 fields, got %d\n", NR, NF) > "/dev/stderr"; bad = 1; next }
$3 != "credit" && $3 != "debit" { printf("line %d: unknown kind %s\n", NR, $3) > "/dev/stderr"; bad = 1; next }
{
    cents = int($4 * 100 + 0.5)  # 0.29 * 100 is 28.999...: round, never truncate
    balance[$2] += $3 == "debit" ? -cents : cents
    count[$2]++
}
END {
    for (account in balance) {
        cents = balance[account]
        sign = cents < 0 ? "-" : ""
        if (cents < 0) cents = -cents
        printf("%s %d %s%d.%02d\n", account, count[account], sign, int(cents / 100), cents % 100)
    }
    exit bad
}
