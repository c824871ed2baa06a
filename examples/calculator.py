"""The agent demo's tool (make agent): rollout.multi_turn.tools=[examples/calculator.py:calc].

A tool is a plain function; the model calls it by its name, here as <calc>347 + 589</calc> (rollout.multi_turn.format
=tag: the text between the tags is the one argument) or, in the hermes format,
<tool_call>{"name": "calc", "arguments": {"expression": "347 + 589"}}</tool_call>.
"""
import ast
import operator
from fractions import Fraction

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    """The exact value of an arithmetic expression of numbers, + − × / and parentheses: "347 + 589" → "936",
    "1 / 4" → "1/4". Read with ast, never eval: anything else raises ValueError, which the model reads as an error."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    return str(value(tree.body))
