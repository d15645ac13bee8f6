"""Relative energy drift of the symplectic Euler method."""

import argparse
import json

parser = argparse.ArgumentParser(
    description="Report the relative energy error of symplectic Euler for a harmonic oscillator."
)
parser.add_argument("--dt", type=float, default=0.01, help="time step")
parser.add_argument("--steps", type=int, default=1000, help="number of steps")
args = parser.parse_args()
q, p = 1.0, 0.0
for _ in range(args.steps):
    p -= args.dt * q
    q += args.dt * p
print(json.dumps({"relative_energy_error": abs((q * q + p * p) / 2 - 0.5) / 0.5}))
