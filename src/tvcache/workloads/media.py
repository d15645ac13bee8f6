"""The files/media workload: questions over a folder of documents and images, answered with real tools.

Like the paper's video tools, some tools write derived files (grayscale, crops, rotations) that later tools
measure, so the same measurement means different things in different rollouts. Images are generated
deterministically with Pillow; documents are HTML, Markdown and text files. Rewards compare the answer
action's real output with the output of the reference solution, executed in a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import Callable
from pathlib import Path

from ..calls import ToolCall
from ..protocol import SandboxFactory
from ..sandboxes import FolderSandbox, FolderTool
from .base import Action, Task, Workload

__all__ = ["make_media_folder", "media_workload"]

DOCUMENTS = {
    "docs/q3-report.html": "<html><head><title>Q3 Results</title></head><body><h1>Q3 Results</h1>"
    "<p>Quarterly revenue grew 12% while costs fell.</p><p>Outlook: stable.</p></body></html>",
    "docs/roadmap.md": "# Product Roadmap\n\nShip the cache server in Q4.\nQuarterly planning happens in March.\n",
    "docs/minutes.txt": "Team Minutes\n\nWe discussed hiring and the offsite.\nRevenue was not discussed.\n",
    "docs/press.html": "<html><head><title>Press Release</title></head><body><p>Our quarterly revenue "
    "report is delayed.</p></body></html>",
}


def _images(folder: Path) -> None:
    from PIL import Image, ImageDraw

    sunset = Image.new("RGB", (240, 160))
    pixels = sunset.load()
    assert pixels is not None
    for y in range(160):
        for x in range(240):
            pixels[x, y] = (255 - y, 80 + (x * 120) // 240, (y * 3) // 2)
    sunset.save(folder / "photos" / "sunset.png")
    logo = Image.new("RGB", (200, 80), (250, 250, 250))
    draw = ImageDraw.Draw(logo)
    draw.rectangle((20, 20, 120, 60), fill=(200, 30, 30))
    draw.ellipse((130, 10, 190, 70), fill=(30, 30, 200))
    logo.save(folder / "photos" / "logo.png")
    chart = Image.new("L", (128, 128), 0)
    ImageDraw.Draw(chart).polygon([(0, 127), (127, 0), (127, 127)], fill=220)
    chart.save(folder / "photos" / "chart.png")


def make_media_folder(path: Path) -> Path:
    if path.exists():
        return path
    for sub in ("docs", "photos", "work"):
        (path / sub).mkdir(parents=True)
    for name, text in DOCUMENTS.items():
        (path / name).write_text(text)
    _images(path)
    (path / "work" / ".keep").write_text("")
    return path


# ------------------------------------------------------------------ tools


def _inside(folder: Path, relative: str, *, exists: bool = True) -> Path:
    path = (folder / relative).resolve()
    if folder.resolve() not in path.parents:
        raise ValueError(f"{relative!r} is outside the working folder")
    if exists and not path.is_file():
        raise FileNotFoundError(f"no such file: {relative}")
    return path


def list_files(folder: Path) -> str:
    """List every file in the folder."""
    return "\n".join(sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()))


def read_text(folder: Path, path: str) -> str:
    """Extract the text of a document (HTML tags stripped)."""
    text = _inside(folder, path).read_text()
    if path.endswith(".html"):
        text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return " ".join(text.split())


def title(folder: Path, path: str) -> str:
    """The document's title: the HTML <title>, or its first line."""
    text = _inside(folder, path).read_text()
    match = re.search(r"<title>(.*?)</title>", text)
    return match.group(1) if match else text.splitlines()[0].lstrip("# ").strip()


def search(folder: Path, term: str) -> str:
    """Documents whose text contains ``term`` (case-insensitive)."""
    hits = [
        str(p.relative_to(folder))
        for p in sorted((folder / "docs").iterdir())
        if term.lower() in read_text(folder, str(p.relative_to(folder))).lower()
    ]
    return "\n".join(hits) or "(no match)"


def image_info(folder: Path, path: str) -> str:
    """Size and mode of an image."""
    from PIL import Image

    with Image.open(_inside(folder, path)) as image:
        return f"{image.width}x{image.height} {image.mode}"


def transform(folder: Path, path: str, op: str, out: str) -> str:
    """Apply ``op`` (grayscale, crop_center, rotate90, flip) to an image and save it as ``out``."""
    from PIL import Image, ImageOps

    with Image.open(_inside(folder, path)) as image:
        if op == "grayscale":
            result = ImageOps.grayscale(image)
        elif op == "crop_center":
            w, h = image.size
            result = image.crop((w // 4, h // 4, w - w // 4, h - h // 4))
        elif op == "rotate90":
            result = image.rotate(90, expand=True)
        elif op == "flip":
            result = ImageOps.flip(image)
        else:
            raise ValueError(f"unknown op {op!r}; use grayscale, crop_center, rotate90 or flip")
        target = _inside(folder, out, exists=False)
        result.save(target)
    return f"saved {out} ({result.width}x{result.height} {result.mode})"


def measure(folder: Path, path: str, metric: str) -> str:
    """Measure an image: mean (brightness 0-255), bright (share of pixels > 128), dominant (most common color)."""
    from PIL import Image

    with Image.open(_inside(folder, path)) as image:
        gray = image.convert("L")
        values = list(gray.getdata())
        if metric == "mean":
            return f"{sum(values) / len(values):.2f}"
        if metric == "bright":
            return f"{sum(v > 128 for v in values) / len(values):.3f}"
        if metric == "dominant":
            colors = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
            return str(max(colors)[1])
        raise ValueError(f"unknown metric {metric!r}; use mean, bright or dominant")


TOOLS = {
    "list_files": FolderTool.wrap(list_files, read_only=True, arguments={}),
    "read_text": FolderTool.wrap(read_text, read_only=True, arguments={"path": str}),
    "title": FolderTool.wrap(title, read_only=True, arguments={"path": str}),
    "search": FolderTool.wrap(search, read_only=True, arguments={"term": str}),
    "image_info": FolderTool.wrap(image_info, read_only=True, arguments={"path": str}),
    "transform": FolderTool.wrap(transform, arguments={"path": str, "op": str, "out": str}),
    "measure": FolderTool.wrap(measure, read_only=True, arguments={"path": str, "metric": str}),
}


def _a(name: str, terminal: bool = False, **arguments: str) -> Action:
    return Action(name=name, arguments=arguments, terminal=terminal)


def _matches(gold: str) -> Callable[[str | None], float]:
    return lambda output: 1.0 if output == gold else 0.0


async def _gold(factory: SandboxFactory, solution: list[Action]) -> str:
    sandbox = await factory.start()
    try:
        output = ""
        for action in solution:
            output = (await sandbox.execute(ToolCall(action.name, action.arguments))).output
        return str(output)
    finally:
        await sandbox.stop()


def media_workload(data_dir: Path) -> Workload:
    folder = make_media_folder(data_dir / "media")
    factory = FolderSandbox.factory(folder, tools=TOOLS)
    specs: list[tuple[str, str, tuple[Action, ...], list[Action]]] = [
        (
            "sunset-crop-brightness",
            "What is the mean brightness of the grayscale centre crop of photos/sunset.png?",
            (
                _a("image_info", path="photos/sunset.png"),
                _a("transform", path="photos/sunset.png", op="grayscale", out="work/g.png"),
                _a("transform", path="work/g.png", op="crop_center", out="work/c.png"),
                _a("transform", path="photos/sunset.png", op="flip", out="work/c.png"),
                _a("measure", True, path="work/c.png", metric="mean"),
                _a("measure", True, path="photos/sunset.png", metric="mean"),
            ),
            [
                _a("transform", path="photos/sunset.png", op="grayscale", out="work/g.png"),
                _a("transform", path="work/g.png", op="crop_center", out="work/c.png"),
                _a("measure", path="work/c.png", metric="mean"),
            ],
        ),
        (
            "revenue-report-title",
            "Which report says quarterly revenue grew? Answer with its title.",
            (
                _a("list_files"),
                _a("search", term="quarterly revenue"),
                _a("read_text", path="docs/q3-report.html"),
                _a("read_text", path="docs/press.html"),
                _a("title", True, path="docs/q3-report.html"),
                _a("title", True, path="docs/press.html"),
                _a("title", True, path="docs/roadmap.md"),
            ),
            [_a("title", path="docs/q3-report.html")],
        ),
        (
            "rotated-logo-size",
            "Rotate photos/logo.png by 90 degrees into work/r.png and report the rotated image's size.",
            (
                _a("image_info", path="photos/logo.png"),
                _a("transform", path="photos/logo.png", op="rotate90", out="work/r.png"),
                _a("transform", path="photos/logo.png", op="flip", out="work/r.png"),
                _a("image_info", True, path="work/r.png"),
                _a("measure", True, path="work/r.png", metric="dominant"),
            ),
            [
                _a("transform", path="photos/logo.png", op="rotate90", out="work/r.png"),
                _a("image_info", path="work/r.png"),
            ],
        ),
    ]
    tasks = []
    for task_id, prompt, actions, solution in specs:
        gold = asyncio.run(_gold(factory, solution))
        tasks.append(
            Task(id=task_id, prompt=prompt, actions=actions, reward=_matches(gold), factory=factory, horizon=5)
        )
    return Workload(
        name="media",
        tasks=tasks,
        description="documents and images in a working folder: text extraction, search, image transforms, measures",
        close=factory.close,
    )
