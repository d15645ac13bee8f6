"""Print the date. Takes no arguments."""

print("2026-01-01")
