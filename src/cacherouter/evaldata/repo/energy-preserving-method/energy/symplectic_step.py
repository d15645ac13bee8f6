"""Symplectic Euler steps of a harmonic oscillator."""

import argparse
import json

parser = argparse.ArgumentParser(description="Advance a harmonic oscillator with symplectic Euler steps.")
parser.add_argument("--q", type=float, default=1.0, help="initial position")
parser.add_argument("--p", type=float, default=0.0, help="initial momentum")
parser.add_argument("--dt", type=float, default=0.01, help="time step")
parser.add_argument("--steps", type=int, default=100, help="number of steps")
args = parser.parse_args()
q, p = args.q, args.p
for _ in range(args.steps):
    p -= args.dt * q
    q += args.dt * p
print(json.dumps({"q": round(q, 6), "p": round(p, 6)}))
