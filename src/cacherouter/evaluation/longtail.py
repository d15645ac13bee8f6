"""The long-tail workload: a generated repository of 200 extra tools in 25 packages, and 40 queries that need them.

The base evaluation repository has 12 tools, so "all tools always exposed" costs little there. This workload asks
whether CacheRouter's advantage appears when the registry is large and most queries need a tool outside the core
view. The repository is the evaluation repository (its core packages unchanged) plus 25 generated domain packages
of two skills each, four scripts per skill. Each generated script is a real argparse tool: its schema is read by
the AST extraction like any other, and it runs as a subprocess and prints a deterministic JSON result.

The generator is deterministic (no randomness, no clock): the same repository and the same queries every run.
The query plans were written from the tools' own words, before any numbers were seen, and are not tuned to them.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .suite import Action, Query, core, routed

# domain package -> (two skill names, eight nouns); a noun names one tool's subject.
DOMAINS: dict[str, tuple[tuple[str, str], tuple[str, ...]]] = {
    "astronomy": (
        ("orbits", "sky"),
        ("orbit", "eclipse", "comet", "parallax", "redshift", "meteor", "nebula", "pulsar"),
    ),
    "chemistry": (
        ("reactions", "compounds"),
        ("molarity", "reagent", "titration", "isotope", "catalyst", "polymer", "solvent", "enthalpy"),
    ),
    "finance": (
        ("markets", "accounts"),
        ("dividend", "bond", "invoice", "payroll", "mortgage", "ledger", "tariff", "annuity"),
    ),
    "genomics": (
        ("sequences", "variants"),
        ("codon", "primer", "allele", "plasmid", "genome", "exon", "haplotype", "telomere"),
    ),
    "logistics": (
        ("shipping", "warehouse"),
        ("parcel", "pallet", "freight", "courier", "manifest", "container", "dock", "route"),
    ),
    "music": (("theory", "audio"), ("chord", "tempo", "melody", "harmony", "rhythm", "timbre", "octave", "cadence")),
    "geometry": (
        ("shapes", "solids"),
        ("polygon", "ellipse", "tetrahedron", "sphere", "triangle", "prism", "torus", "cone"),
    ),
    "calendar": (
        ("dates", "holidays"),
        ("weekday", "leapyear", "holiday", "timezone", "fortnight", "quarter", "equinox", "sabbatical"),
    ),
    "linguistics": (
        ("words", "grammar"),
        ("syllable", "morpheme", "phoneme", "idiom", "synonym", "palindrome", "anagram", "etymology"),
    ),
    "medicine": (
        ("dosage", "vitals"),
        ("dose", "pulse", "bmi", "cholesterol", "glucose", "vaccine", "allergy", "prescription"),
    ),
    "agriculture": (
        ("crops", "soil"),
        ("harvest", "irrigation", "fertilizer", "seedling", "orchard", "compost", "pesticide", "silo"),
    ),
    "energy": (
        ("grid", "renewables"),
        ("turbine", "battery", "solarpanel", "kilowatt", "transformer", "inverter", "hydrogen", "geothermal"),
    ),
    "sports": (
        ("league", "training"),
        ("marathon", "scoreboard", "tournament", "referee", "stadium", "relay", "penalty", "sprint"),
    ),
    "cooking": (
        ("recipes", "pantry"),
        ("recipe", "marinade", "dough", "spice", "broth", "sourdough", "glaze", "casserole"),
    ),
    "security": (
        ("crypto", "audit"),
        ("password", "certificate", "firewall", "checksum", "cipher", "token", "vulnerability", "keypair"),
    ),
    "networking": (
        ("protocols", "addresses"),
        ("subnet", "latency", "packet", "bandwidth", "hostname", "socket", "gateway", "traceroute"),
    ),
    "oceanography": (
        ("tides", "currents"),
        ("tide", "salinity", "wave", "reef", "buoy", "trench", "upwelling", "plankton"),
    ),
    "aviation": (
        ("flights", "aircraft"),
        ("runway", "altitude", "airspeed", "fuelburn", "waypoint", "crosswind", "airfoil", "landing"),
    ),
    "retail": (
        ("inventory", "pricing"),
        ("barcode", "discount", "stock", "receipt", "coupon", "shelf", "markup", "refund"),
    ),
    "education": (
        ("grading", "courses"),
        ("grade", "syllabus", "lecture", "semester", "transcript", "rubric", "quiz", "enrollment"),
    ),
    "realestate": (
        ("property", "rentals"),
        ("lease", "appraisal", "zoning", "rent", "deed", "floorplan", "escrow", "tenant"),
    ),
    "photography": (
        ("exposure", "lenses"),
        ("aperture", "shutter", "iso", "histogram", "focallength", "bokeh", "whitebalance", "panorama"),
    ),
    "seismology": (
        ("quakes", "faults"),
        ("magnitude", "epicenter", "aftershock", "seismogram", "fault", "tsunami", "richter", "tremor"),
    ),
    "transport": (
        ("transit", "traffic"),
        ("timetable", "fare", "commute", "congestion", "tram", "ferry", "carpool", "parking"),
    ),
    "textiles": (("fabrics", "sewing"), ("yarn", "weave", "dye", "thread", "stitch", "loom", "fabric", "embroidery")),
}

# action -> the phrase its descriptions (and the queries about it) use
ACTIONS: dict[str, str] = {
    "estimate": "Estimate the {noun} figure",
    "lookup": "Look up reference data on the {noun}",
    "convert": "Convert {noun} measurements between units",
    "validate": "Validate a {noun} record",
    "summary": "Summarise the {noun} statistics",
    "forecast": "Forecast the {noun} trend",
    "rank": "Rank {noun} candidates",
    "compare": "Compare two {noun} readings",
}

_SCRIPT = '''"""{description}"""
import argparse
import hashlib
import json

parser = argparse.ArgumentParser(description={description!r})
{arguments}
args = parser.parse_args()
values = vars(args)
digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()
print(json.dumps({{"tool": {name!r}, "inputs": values, "result": int(digest[:8], 16) % 1000}}, sort_keys=True))
'''

_OPTIONAL = (
    'parser.add_argument("--amount", type=float, default=1.0, help="quantity to work with")',
    'parser.add_argument("--period", type=int, default=30, help="period in days")',
    'parser.add_argument("--unit", choices=["metric", "imperial"], default="metric", help="unit system")',
    'parser.add_argument("--detailed", action="store_true", help="include intermediate figures")',
)


@dataclass(frozen=True, kw_only=True)
class GeneratedTool:
    name: str
    package: str
    skill: str
    noun: str
    action: str
    description: str
    optional: tuple[int, ...]  # indices into _OPTIONAL

    def script(self) -> str:
        arguments = [f'parser.add_argument("--target", required=True, help="the {self.noun} to work on")']
        arguments += [_OPTIONAL[i] for i in self.optional]
        return _SCRIPT.format(description=self.description, arguments="\n".join(arguments), name=self.name)


def generated_tools() -> tuple[GeneratedTool, ...]:
    """The 200 generated tools, in a fixed order."""
    actions = list(ACTIONS)
    tools: list[GeneratedTool] = []
    for d, (package, ((skill_a, skill_b), nouns)) in enumerate(DOMAINS.items()):
        for i, noun in enumerate(nouns):
            action = actions[(i + d) % len(actions)]
            phrase = ACTIONS[action].format(noun=noun)
            tools.append(
                GeneratedTool(
                    name=f"{noun}_{action}",
                    package=package,
                    skill=skill_a if i < 4 else skill_b,
                    noun=noun,
                    action=action,
                    description=f"{phrase} for {package} work.",
                    optional=tuple(j for j in range(len(_OPTIONAL)) if (i + d + j) % 3 != 0),
                )
            )
    return tuple(tools)


def generate_repository(base: Path, root: Path) -> Path:
    """Copy the evaluation repository ``base`` to ``root`` and add the generated packages. Returns ``root``."""
    shutil.copytree(base, root, ignore=shutil.ignore_patterns("__pycache__"))
    for tool in generated_tools():
        skill_dir = root / tool.package / tool.skill
        skill_dir.mkdir(parents=True, exist_ok=True)
        skill_md = skill_dir / "SKILL.md"
        if not skill_md.exists():
            skill_md.write_text(
                f"---\nname: {tool.skill}\ndescription: {tool.skill.capitalize()} tools for {tool.package}.\n---\n"
                f"Offline {tool.package} utilities ({tool.skill}).\n"
            )
        (skill_dir / f"{tool.name}.py").write_text(tool.script())
    return root


def _action(tool: GeneratedTool, target: str) -> Action:
    task = ACTIONS[tool.action].format(noun=tool.noun).lower() + f" of {target} ({tool.package})"
    return routed(task, tool.name, target=target)


def _queries() -> tuple[Query, ...]:
    tools = generated_tools()
    out: list[Query] = []
    for q in range(40):
        tool = tools[(q * 37) % len(tools)]
        target = f"sample-{q}"
        phrase = ACTIONS[tool.action].format(noun=tool.noun)
        kind = q % 4
        events: tuple[str, ...] = ("restart",) if q == 20 else ()
        if kind == 0:  # one long-tail call
            rounds: tuple[tuple[Action, ...], ...] = ((_action(tool, target),),)
            text = f"{phrase} of {target} for my {tool.package} project."
        elif kind == 1:  # a core call and a long-tail call in parallel
            rounds = ((core("weather", city="Beijing"), _action(tool, target)),)
            text = f"Beijing weather, and {phrase.lower()} of {target} ({tool.package})."
        elif kind == 2:  # two long-tail calls of one package, one after the other
            other = next(t for t in tools if t.package == tool.package and t.name != tool.name)
            rounds = ((_action(tool, target),), (_action(other, target),))
            text = f"{phrase} of {target}, then {ACTIONS[other.action].format(noun=other.noun).lower()} too."
        else:  # a popular long-tail tool asked for again, with a core search first
            popular = tools[((q - 3) * 37) % len(tools)]
            rounds = ((core("rag_search", query="campus"),), (_action(popular, target),))
            again = ACTIONS[popular.action].format(noun=popular.noun).lower()
            text = f"Search rag_project1 for campus, then {again} of {target}."
        out.append(Query(id=f"L{q:02d}", experiment="longtail", text=text, rounds=rounds, final="Done.", events=events))
    return tuple(out)


LONGTAIL: tuple[Query, ...] = _queries()
