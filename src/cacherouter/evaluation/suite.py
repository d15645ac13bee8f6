"""The scripted evaluation workload: 55 queries in 8 experiments shaped like the paper's, and a 30-turn dialogue.

Each query carries a *plan*: what a model would do with it (answer directly, or which tool calls in which rounds).
The plans stand in for a real model (no LLM API is reachable here), so the numbers they produce are those of
*scripted* models; what they measure is the request architecture, i.e. which bytes each request carries.
A router action names the long-tail tool the router should end up calling; the baselines call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Action:
    tool: str  # the tool that finally runs
    arguments: dict[str, Any]
    routed: bool = False  # True: reached through INTERNAL_ROUTER in CacheRouter
    task: str = ""  # the INTERNAL_ROUTER task text for routed actions


def core(tool: str, **arguments: Any) -> Action:
    return Action(tool=tool, arguments=arguments)


def routed(task: str, tool: str, **arguments: Any) -> Action:
    return Action(tool=tool, arguments=arguments, routed=True, task=task)


@dataclass(frozen=True, kw_only=True)
class Query:
    id: str
    experiment: str
    text: str
    direct: str = ""  # non-empty: answered at triage, no tools
    rounds: tuple[tuple[Action, ...], ...] = ()
    final: str = "Done."
    events: tuple[str, ...] = ()  # harness events before the query: restart, add_tool, edit_tool, break_tool
    router: str = "full"  # router configuration: full, off (no router), nofilter
    tags: tuple[str, ...] = field(default=())


def _q(id: str, exp: str, text: str, *rounds: tuple[Action, ...], final: str = "Done.", **kw: Any) -> Query:
    return Query(id=id, experiment=exp, text=text, rounds=tuple(rounds), final=final, **kw)


def _d(id: str, exp: str, text: str, answer: str, **kw: Any) -> Query:
    return Query(id=id, experiment=exp, text=text, direct=answer, **kw)


W = "weather"
RAG = "rag_search"
# Files the plans write land in the run's own temporary directory, which the runner deletes afterwards (a fixed
# /tmp path would outlive the run and be shared by runs at once). Tools run in their skill directory,
# <run directory>/repo/<package>/<skill>, so the run directory is three levels up; write_file accepts the path
# because the run directory lies under /tmp, the system's temporary directory.
BEIJING_FILE = "../../../cr-beijing.txt"
FACULTY_FILE = "../../../cr-faculty.txt"
CALC_FILE = "../../../cr-calc.py"

SUITE: tuple[Query, ...] = (
    # Experiment 1: multi-step sequential tasks
    _q(
        "1.1",
        "sequential",
        "Query the weather in Beijing and save it to /root/beijing.txt.",
        (core(W, city="Beijing"),),
        (
            routed(
                "write the Beijing weather report to /root/beijing.txt",
                "write_file",
                path="/root/beijing.txt",
                content="Beijing 31.5 C",
            ),
        ),
        (
            routed(
                f"write the Beijing weather report to {BEIJING_FILE}",
                "write_file",
                path=BEIJING_FILE,
                content="Beijing 31.5 C",
            ),
        ),
        final=f"Beijing is 31.5 C; /root was not writable, so the report is in {BEIJING_FILE}.",
    ),
    _q(
        "1.2",
        "sequential",
        "Search rag_project1 for the campus.",
        (core(RAG, query="campus"),),
        final="rag_project1 has 3 passages about the campus.",
    ),
    _q(
        "1.3",
        "sequential",
        "Which is hotter now, Beijing or Shanghai?",
        (core(W, city="Beijing"),),
        (core(W, city="Shanghai"),),
        final="Beijing (31.5 C) is hotter than Shanghai (29.4 C).",
    ),
    _q(
        "1.4",
        "sequential",
        "Search rag_project2 for faculty and write what you find to a file.",
        (core(RAG, query="faculty", project="rag_project2"),),
        (
            routed(
                f"write the faculty search result to {FACULTY_FILE}",
                "write_file",
                path=FACULTY_FILE,
                content="Faculty research covers numerical analysis.",
            ),
        ),
        final=f"One passage found; saved to {FACULTY_FILE}.",
    ),
    _q(
        "1.5",
        "sequential",
        "Compare the Beijing weather with the campus search result as formatted JSON.",
        (core(W, city="Beijing"),),
        (core(RAG, query="campus"),),
        (routed("pretty-print this JSON document", "format_json", document='{"beijing": 31.5, "campus_hits": 3}'),),
        final='{"beijing": 31.5, "campus_hits": 3}',
    ),
    # Experiment 2: parallel tasks
    _q(
        "2.1",
        "parallel",
        "Get Beijing and Shanghai weather with humidity and dew point.",
        (core(W, city="Beijing", details=True), core(W, city="Shanghai", details=True)),
        final="Beijing 31.5 C / 48%; Shanghai 29.4 C / 71%.",
    ),
    _q(
        "2.2",
        "parallel",
        "Search rag_project1 and rag_project2 for campus and doctoral programmes.",
        (core(RAG, query="campus"), core(RAG, query="doctoral", project="rag_project2")),
        final="Both collections answered.",
    ),
    _q(
        "2.3",
        "parallel",
        "Beijing weather and rag_project1 library hours, together.",
        (core(W, city="Beijing"), core(RAG, query="library")),
        final="31.5 C; the library opens at 8:00.",
    ),
    _q(
        "2.4",
        "parallel",
        "Shanghai weather and the doctoral programmes in rag_project2.",
        (core(W, city="Shanghai"), core(RAG, query="doctoral", project="rag_project2")),
        final="29.4 C; doctoral programmes are offered.",
    ),
    _q(
        "2.5",
        "parallel",
        "Summarise the weather of Beijing, Shanghai and Guangzhou.",
        (core(W, city="Beijing"), core(W, city="Shanghai"), core(W, city="Guangzhou")),
        final="Guangzhou 33.0 C is the hottest, then Beijing 31.5 C and Shanghai 29.4 C.",
    ),
    # Experiment 3: long chain; group B restarts the gateway (and the repository changes) before each query
    _q("3.A1", "long-chain", "Beijing weather?", (core(W, city="Beijing"),), final="31.5 C."),
    _q("3.A2", "long-chain", "rag_project1: BUPT campus?", (core(RAG, query="BUPT"),), final="Haidian."),
    _q("3.A3", "long-chain", "Shanghai weather?", (core(W, city="Shanghai"),), final="29.4 C."),
    _q(
        "3.A4",
        "long-chain",
        "rag_project2: mathematics?",
        (core(RAG, query="mathematics", project="rag_project2"),),
        final="Doctoral programmes.",
    ),
    _q("3.A5", "long-chain", "Guangzhou weather?", (core(W, city="Guangzhou"),), final="33.0 C."),
    _q(
        "3.B1", "long-chain", "Beijing weather again?", (core(W, city="Beijing"),), final="31.5 C.", events=("restart",)
    ),
    _q(
        "3.B2",
        "long-chain",
        "rag_project1: BUPT campus, and convert 31.5 C to Fahrenheit.",
        (core(RAG, query="BUPT"), routed("convert 31.5 celsius to fahrenheit", "unit_convert", celsius=31.5)),
        final="Haidian; 88.7 F.",
        events=("restart", "add_tool"),
    ),
    _q(
        "3.B3",
        "long-chain",
        "Shanghai weather again?",
        (core(W, city="Shanghai"),),
        final="29.4 C.",
        events=("restart", "edit_tool"),
    ),
    _q(
        "3.B4",
        "long-chain",
        "rag_project2: mathematics again?",
        (core(RAG, query="mathematics", project="rag_project2"),),
        final="Doctoral programmes.",
        events=("restart", "break_tool"),
    ),
    _q(
        "3.B5",
        "long-chain",
        "Guangzhou weather again?",
        (core(W, city="Guangzhou"),),
        final="33.0 C.",
        events=("restart",),
    ),
    # Experiment 4: triage
    _d("4.1", "triage", "What is 2 + 2?", "2 + 2 = 4."),
    _d("4.2", "triage", "What is the capital of China?", "Beijing."),
    _q("4.3", "triage", "What is the weather in Beijing right now?", (core(W, city="Beijing"),), final="31.5 C."),
    _q("4.4", "triage", "Use tools to search rag_project1 for BUPT.", (core(RAG, query="BUPT"),), final="Haidian."),
    _q("4.5", "triage", "Current Shanghai weather, please.", (core(W, city="Shanghai"),), final="29.4 C."),
    # Experiment 5: complex tasks and re-planning
    _q(
        "5.1",
        "complex",
        "Compare the weather of Beijing, Shanghai, Guangzhou and Shenzhen one by one.",
        (core(W, city="Beijing"),),
        (core(W, city="Shanghai"),),
        (core(W, city="Guangzhou"),),
        (core(W, city="Shenzhen"),),
        final="Guangzhou (33.0 C) is hottest.",
    ),
    _q(
        "5.2",
        "complex",
        "Integrate a harmonic oscillator with a symplectic method and report the energy drift.",
        (routed("advance a harmonic oscillator 100 symplectic steps", "symplectic_step", steps=100),),
        (routed("report the relative energy drift of the symplectic integrator", "energy_drift", steps=1000),),
        final="The relative energy error stays below 1%.",
    ),
    _q(
        "5.3",
        "complex",
        "Search campus, mathematics, library and doctoral in the RAG projects.",
        (
            core(RAG, query="campus"),
            core(RAG, query="mathematics", project="rag_project2"),
            core(RAG, query="library"),
            core(RAG, query="doctoral", project="rag_project2"),
        ),
        final="All four searches returned passages.",
    ),
    _q(
        "5.4",
        "complex",
        "Write a calculator script to a file, run it and check three operations.",
        (
            routed(
                f"write a calculator script to {CALC_FILE}",
                "write_file",
                path=CALC_FILE,
                # Run without an expression, it fails with a usage line (the plan then checks by code); a traceback
                # would name the file by its absolute path, and the run directory's random name would then reach
                # the request bytes and make the figures vary from run to run.
                content="import sys\nif len(sys.argv) < 2:\n    sys.exit('usage: cr-calc.py EXPRESSION')\n"
                "print(eval(sys.argv[1]))\n",
            ),
        ),
        (routed(f"run the python file {CALC_FILE}", "run_python", file=CALC_FILE),),
        (routed("run python code that checks 3+4, 6*7 and 8/2", "run_python", code="print(3+4, 6*7, 8/2)"),),
        final="The calculator works: 7, 42, 4.0.",
    ),
    _d(
        "5.5",
        "complex",
        "Write a small student grade management class in Python.",
        "class Grades:\n    def __init__(self):\n        self.scores = {}\n    def add(self, name, score):\n"
        "        self.scores[name] = score\n    def average(self):\n        return sum(self.scores.values()) / "
        "len(self.scores)",
    ),
    # Experiment 6: unanswerable queries must fall back honestly
    _q(
        "6.1",
        "fallback",
        "What is the weather on Mars right now?",
        *([(core(W, city="Mars"),)] * 12),
        final="No data for Mars.",
    ),
    _q(
        "6.2",
        "fallback",
        "Search rag_project1 for xyznonexistent.",
        (core(RAG, query="xyznonexistent"),),
        final="The search returned 0 hits; I have no information on it.",
    ),
    _q(
        "6.3",
        "fallback",
        "Show me /root/secret_key.txt.",
        (core("read_file", path="/root/secret_key.txt"),),
        final="Permission to read /root/secret_key.txt was denied; I cannot show it.",
    ),
    _q(
        "6.4",
        "fallback",
        "Show me filenotfound.py.",
        (core("read_file", path="filenotfound.py"),),
        final="filenotfound.py does not exist.",
    ),
    _q(
        "6.5",
        "fallback",
        "What is the weather in ZzzCity?",
        (core(W, city="ZzzCity"),),
        *([(routed("find weather data for the city ZzzCity", "weather", city="ZzzCity"),)] * 10),
        final="ZzzCity is unknown.",
    ),
    # Experiment 7: router off / no filter / full filter
    *(
        q
        for group, config in (("A", "off"), ("B", "nofilter"), ("C", "full"))
        for q in (
            _q(f"7.{group}1", "router", "Beijing weather?", (core(W, city="Beijing"),), final="31.5 C.", router=config),
            _q(
                f"7.{group}2",
                "router",
                "rag_project1: BUPT?",
                (core(RAG, query="BUPT"),),
                final="Haidian.",
                router=config,
            ),
            _q(
                f"7.{group}3",
                "router",
                "Run test1.py for me.",
                (routed("run the python file test1.py", "run_python", code="print('test1 ok')"),),
                final="test1.py printed 'test1 ok'.",
                router=config,
            ),
            _d(f"7.{group}4", "router", "What is 2**100?", "1267650600228229401496703205376.", router=config),
            _d(
                f"7.{group}5",
                "router",
                "List the first 10 Fibonacci numbers.",
                "0 1 1 2 3 5 8 13 21 34.",
                router=config,
            ),
        )
    ),
    # Experiment 8: skill bootstrapping (new skills land in package "other")
    _q(
        "8.1",
        "skills",
        "Create a say_hello skill.",
        (
            routed(
                "build a new skill say_hello that prints hello",
                "skill_builder",
                name="say_hello",
                description="Print a greeting.",
                body="print('hello')",
            ),
        ),
        final="say_hello is in package other.",
    ),
    _q(
        "8.2",
        "skills",
        "Create a greet skill with a default name.",
        (
            routed(
                "build a new skill greet with a name parameter",
                "skill_builder",
                name="greet",
                description="Greet someone by name.",
                params='[{"name": "name", "type": "string", "default": "world", "help": "who"}]',
                body="print(f'hello {args.name}')",
            ),
        ),
        (routed("greet Alice", "greet", name="Alice"),),
        final="greet works: hello Alice.",
    ),
    _q(
        "8.3",
        "skills",
        "Create a calc skill that adds two integers.",
        (
            routed(
                "build a new skill calc adding two integers",
                "skill_builder",
                name="calc",
                description="Add two integers.",
                params='[{"name": "a", "type": "string", "default": "1"}, {"name": "b", "type": "string", '
                '"default": "2"}]',
                body="print(args.a + args.b + 0)",
                check_args='{"a": "1", "b": "2"}',
            ),
        ),
        (
            routed(
                "build a new skill calc adding two integers, converting to int",
                "skill_builder",
                name="calc",
                description="Add two integers.",
                params='[{"name": "a", "type": "integer", "default": 1}, {"name": "b", "type": "integer", '
                '"default": 2}]',
                body="print(args.a + args.b)",
                check_args='{"a": 1, "b": 2}',
            ),
        ),
        (routed("calc 20 plus 22", "calc", a=20, b=22),),
        final="calc works after the int fix: 42.",
    ),
    _q(
        "8.4",
        "skills",
        "Create a batch_process skill that sums and averages numbers.",
        (
            routed(
                "build a new skill batch_process for sum and average",
                "skill_builder",
                name="batch_process",
                description="Sum and average a comma-separated list of numbers.",
                params='[{"name": "numbers", "type": "string", "default": "1,2,3"}]',
                body="xs = [float(x) for x in args.numbers.split(',')]\nprint(sum(xs), sum(xs) / len(xs))",
            ),
        ),
        (routed("batch process 4,5,6", "batch_process", numbers="4,5,6"),),
        final="Sum 15, average 5.",
    ),
    _q(
        "8.5",
        "skills",
        "Create a generate_report skill with three output formats.",
        (
            routed(
                "build a new skill generate_report",
                "skill_builder",
                name="generate_report",
                description="Render a title as text, markdown or html.",
                params='[{"name": "title", "type": "string", "default": "Report"}, {"name": "fmt", "type": '
                '"string", "default": "text"}]',
                body="t = args.title\nprint({'text': t, 'markdown': '# ' + t, 'html': '<h1>' + t + '</h1>'}"
                "[args.fmt])",
            ),
        ),
        (routed("generate a markdown report titled Q3", "generate_report", title="Q3", fmt="markdown"),),
        final="generate_report renders text, markdown and html.",
    ),
)

_DIALOGUE_DIRECT = (
    ("What is 2 + 2?", "4."),
    ("What is the capital of France?", "Paris."),
    ("How many days are in a week?", "7."),
    ("What is 10 minus 3?", "7."),
    ("What color is the sky on a clear day?", "Blue."),
    ("What is 5 times 6?", "30."),
    ("How many legs does a spider have?", "8."),
    ("What is the boiling point of water at sea level in Celsius?", "100 C."),
    ("Who wrote Hamlet?", "William Shakespeare."),
    ("What is 9 divided by 3?", "3."),
    ("How many continents are there?", "7."),
    ("What is the largest planet in the solar system?", "Jupiter."),
    ("What is 12 plus 15?", "27."),
    ("What gas do plants absorb?", "Carbon dioxide."),
    ("How many hours are in a day?", "24."),
    ("What is the square root of 81?", "9."),
)
_DIALOGUE_TOOLS = (
    ("What is 123 times 456?", "123*456", "56088."),
    ("What is 2 to the power 64?", "2**64", "18446744073709551616."),
    ("What is 7 times 8?", "7*8", "56."),
    ("Compute 1024 divided by 7.", "1024/7", "1024/7."),
    ("What is 99 squared?", "99**2", "9801."),
    ("How many minutes are in one week?", "7*24*60", "10080."),
    ("What is 3.5 times 4.2?", "3.5*4.2", "14.7."),
    ("Sum 17, 29 and 44.", "17+29+44", "90."),
    ("What is 1000 minus 1?", "1000-1", "999."),
    ("What is 15 percent of 240?", "240*15/100", "36."),
    ("How many seconds are in a day?", "24*60*60", "86400."),
    ("What is 11 cubed?", "11**3", "1331."),
    ("How many minutes are in one hour? Check with a tool.", "60*1", "60."),
)


def _dialogue() -> tuple[Query, ...]:
    out: list[Query] = []
    direct = iter(_DIALOGUE_DIRECT)
    tools = iter(_DIALOGUE_TOOLS)
    for turn in range(1, 31):
        qid = f"D{turn:02d}"
        if turn == 20:
            out.append(
                _q(
                    qid,
                    "dialogue",
                    "How many sides does a hexagon have? Verify by running code.",
                    (
                        routed(
                            "run python code printing the number of sides of a hexagon", "run_python", code="print(6)"
                        ),
                    ),
                    final="6.",
                )
            )
        elif turn % 2 == 0 and turn != 30:
            text, expr, answer = next(tools)
            out.append(_q(qid, "dialogue", text, (core("calculator", expression=expr),), final=answer))
        else:
            text, answer = next(direct)
            out.append(_d(qid, "dialogue", text, answer))
    return tuple(out)


DIALOGUE: tuple[Query, ...] = _dialogue()
CORE_PACKAGES: tuple[str, ...] = ("base", "geography", "internet")
