from argparse import ArgumentParser as AP
from argparse import BooleanOptionalAction

p = AP(description=__doc__)
p.add_argument("--flag", action=BooleanOptionalAction)
p.add_argument("value", type=int, nargs="?", default=5)
print(p.parse_args())
