"""Evaluate an arithmetic expression exactly."""

import argparse
import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        result: Fraction = OPS[type(node.op)](value(node.left), value(node.right))
        return result
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        negated: Fraction = OPS[type(node.op)](value(node.operand))
        return negated
    raise SystemExit(f"error: unsupported expression element {ast.dump(node)[:40]}")


parser = argparse.ArgumentParser(description="Evaluate an arithmetic expression (+ - * / ** and parentheses) exactly.")
parser.add_argument("expression", help="the expression, e.g. '7*8' or '2**100'")
args = parser.parse_args()
result = value(ast.parse(args.expression, mode="eval").body)
print(result if result.denominator != 1 else result.numerator)
