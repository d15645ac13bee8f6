"""Helpers shared by the cacherouter tests: a small tool repository on disk."""

from pathlib import Path

TOOL = '''"""{doc}"""
import argparse
p = argparse.ArgumentParser(description="{doc}")
p.add_argument("--text", default="hi", help="text to echo")
print("{name}:" + p.parse_args().text)
'''


def add_tool(root: Path, package: str, skill: str, name: str, doc: str = "Echo some text.") -> Path:
    skill_dir = root / package / skill
    skill_dir.mkdir(parents=True, exist_ok=True)
    (skill_dir / "SKILL.md").write_text(f"---\nname: {skill}\ndescription: {doc}\n---\nSkill {skill}.\n")
    path = skill_dir / f"{name}.py"
    path.write_text(TOOL.format(doc=doc, name=name))
    return path


def make_repo(root: Path) -> Path:
    add_tool(root, "base", "echo", "echo_text", "Echo some text back.")
    add_tool(root, "base", "clock", "show_time", "Show the current time.")
    add_tool(root, "tail", "weather", "city_weather", "Weather report for a city.")
    add_tool(root, "tail", "stocks", "stock_price", "Stock price for a ticker symbol.")
    return root


def replies_since_query(messages) -> int:
    """Assistant replies since the user's query; the notes the agent adds ([RE-PLAN], [FINAL]...) are not queries."""
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user" and not str(m["content"]).startswith("["))
    return sum(1 for m in messages[last_query:] if m["role"] == "assistant")
