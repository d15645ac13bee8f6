"""The SQL workload: question-answering tasks over real SQLite databases, some of which must write first.

Two databases: Chinook (a real sample schema, shipped with the package, MIT licensed) and a generated
inventory database. Each task offers the policy a menu of queries: exploratory reads, writes, and candidate
answers; a rollout ends at its first answer query, and its reward is 1 when that answer's output equals the gold
output, computed by really executing the reference solution in a fresh sandbox.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..calls import ToolCall
from ..sandboxes import SQLiteSandbox
from .base import Action, Task, Workload

__all__ = ["SqlTask", "chinook_path", "make_inventory_db", "sql_tasks", "sql_workload"]


@dataclass(frozen=True, kw_only=True)
class Query:
    query: str
    answer: bool = False


@dataclass(frozen=True, kw_only=True)
class SqlTask:
    id: str
    database: Path
    question: str
    actions: tuple[Query, ...]
    solution: tuple[str, ...]  # the reference queries; the last one's output is the gold answer


def chinook_path() -> Path:
    return Path(str(resources.files("tvcache.workloads") / "data" / "chinook.sqlite"))


def make_inventory_db(path: Path, *, seed: int = 7) -> Path:
    """Generate the inventory database (deterministic for a seed) unless it already exists."""
    if path.exists():
        return path
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    connection = sqlite3.connect(tmp)
    with connection:
        connection.executescript(
            """
            CREATE TABLE warehouse (id INTEGER PRIMARY KEY, city TEXT NOT NULL);
            CREATE TABLE product (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price REAL NOT NULL);
            CREATE TABLE stock (warehouse_id INTEGER REFERENCES warehouse(id),
                                product_id INTEGER REFERENCES product(id), units INTEGER NOT NULL,
                                PRIMARY KEY (warehouse_id, product_id));
            """
        )
        cities = ["Lisbon", "Oslo", "Quito", "Perth", "Osaka", "Tunis"]
        connection.executemany("INSERT INTO warehouse VALUES (?, ?)", list(enumerate(cities, start=1)))
        products = [(i, f"part-{i:03d}", round(rng.uniform(1, 200), 2)) for i in range(1, 201)]
        connection.executemany("INSERT INTO product VALUES (?, ?, ?)", products)
        stock = [(w, p, rng.randrange(0, 500)) for w in range(1, len(cities) + 1) for p in range(1, 201)]
        connection.executemany("INSERT INTO stock VALUES (?, ?, ?)", stock)
    connection.close()
    tmp.replace(path)
    return path


def sql_tasks(data_dir: Path) -> list[SqlTask]:
    chinook = chinook_path()
    inventory = make_inventory_db(data_dir / "inventory.sqlite")
    explore_chinook = (
        Query(query="SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"),
        Query(query="SELECT GenreId, Name FROM Genre ORDER BY GenreId LIMIT 5"),
        Query(query="SELECT COUNT(*) FROM Track"),
    )
    explore_inventory = (
        Query(query="SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"),
        Query(query="SELECT * FROM warehouse ORDER BY id"),
        Query(query="SELECT COUNT(*) FROM stock"),
    )
    return [
        SqlTask(
            id="chinook-rock-tracks",
            database=chinook,
            question="How many tracks are in the Rock genre?",
            actions=(
                *explore_chinook,
                Query(query="SELECT COUNT(*) FROM Track WHERE GenreId = 2", answer=True),
                Query(
                    query="SELECT COUNT(*) FROM Track t JOIN Genre g ON t.GenreId = g.GenreId WHERE g.Name = 'Rock'",
                    answer=True,
                ),
                Query(query="SELECT COUNT(*) FROM Genre WHERE Name = 'Rock'", answer=True),
            ),
            solution=("SELECT COUNT(*) FROM Track t JOIN Genre g ON t.GenreId = g.GenreId WHERE g.Name = 'Rock'",),
        ),
        SqlTask(
            id="chinook-add-genre",
            database=chinook,
            question="Add the genre 'Synthwave' (once) and report how many genres there are.",
            actions=(
                *explore_chinook,
                Query(query="INSERT INTO Genre (Name) VALUES ('Synthwave')"),
                Query(query="SELECT COUNT(*) FROM Genre", answer=True),
                Query(query="SELECT MAX(GenreId) FROM Genre", answer=True),
            ),
            solution=("INSERT INTO Genre (Name) VALUES ('Synthwave')", "SELECT COUNT(*) FROM Genre"),
        ),
        SqlTask(
            id="chinook-reprice-album",
            database=chinook,
            question="Raise every track price of album 1 by 0.10, then report the album's total price.",
            actions=(
                Query(query="SELECT TrackId, UnitPrice FROM Track WHERE AlbumId = 1 ORDER BY TrackId"),
                Query(query="UPDATE Track SET UnitPrice = UnitPrice + 0.10 WHERE AlbumId = 1"),
                Query(query="UPDATE Track SET UnitPrice = UnitPrice * 1.10 WHERE AlbumId = 1"),
                Query(query="SELECT ROUND(SUM(UnitPrice), 2) FROM Track WHERE AlbumId = 1", answer=True),
                Query(query="SELECT ROUND(AVG(UnitPrice), 2) FROM Track WHERE AlbumId = 1", answer=True),
            ),
            solution=(
                "UPDATE Track SET UnitPrice = UnitPrice + 0.10 WHERE AlbumId = 1",
                "SELECT ROUND(SUM(UnitPrice), 2) FROM Track WHERE AlbumId = 1",
            ),
        ),
        SqlTask(
            id="inventory-ship",
            database=inventory,
            question="Ship 40 units of product 7 out of the Oslo warehouse and report the units left there.",
            actions=(
                *explore_inventory,
                Query(query="SELECT units FROM stock WHERE warehouse_id = 2 AND product_id = 7"),
                Query(query="UPDATE stock SET units = units - 40 WHERE warehouse_id = 2 AND product_id = 7"),
                Query(query="UPDATE stock SET units = units - 40 WHERE warehouse_id = 1 AND product_id = 7"),
                Query(query="SELECT units FROM stock WHERE warehouse_id = 2 AND product_id = 7", answer=True),
                Query(query="SELECT SUM(units) FROM stock WHERE product_id = 7", answer=True),
            ),
            solution=(
                "UPDATE stock SET units = units - 40 WHERE warehouse_id = 2 AND product_id = 7",
                "SELECT units FROM stock WHERE warehouse_id = 2 AND product_id = 7",
            ),
        ),
        SqlTask(
            id="inventory-top-city",
            database=inventory,
            question="Which warehouse city holds the most units in stock?",
            actions=(
                *explore_inventory,
                Query(
                    query="SELECT w.city FROM stock s JOIN warehouse w ON w.id = s.warehouse_id "
                    "GROUP BY w.city ORDER BY SUM(s.units) DESC LIMIT 1",
                    answer=True,
                ),
                Query(
                    query="SELECT w.city FROM stock s JOIN warehouse w ON w.id = s.warehouse_id "
                    "GROUP BY w.city ORDER BY SUM(s.units) ASC LIMIT 1",
                    answer=True,
                ),
            ),
            solution=(
                "SELECT w.city FROM stock s JOIN warehouse w ON w.id = s.warehouse_id "
                "GROUP BY w.city ORDER BY SUM(s.units) DESC LIMIT 1",
            ),
        ),
    ]


async def _gold(task: SqlTask) -> str:
    """Execute the reference solution in a fresh sandbox: the gold answer is real output."""
    sandbox = await SQLiteSandbox.factory(task.database).start()
    try:
        output = ""
        for query in task.solution:
            output = (await sandbox.execute(ToolCall("sql", {"query": query}))).output
        return output
    finally:
        await sandbox.stop()


def _matches(gold: str) -> Callable[[str | None], float]:
    return lambda output: 1.0 if output == gold else 0.0


def sql_workload(data_dir: Path, *, delay_seconds: float = 0.0) -> Workload:
    """The SQL workload; ``delay_seconds`` per query emulates a remote database (the paper's was ~56 ms away)."""
    tasks = []
    for spec in sql_tasks(data_dir):
        gold = asyncio.run(_gold(spec))
        factory = SQLiteSandbox.factory(spec.database, delay_seconds=delay_seconds)
        actions = tuple(Action(name="sql", arguments={"query": q.query}, terminal=q.answer) for q in spec.actions)
        tasks.append(
            Task(id=spec.id, prompt=spec.question, actions=actions, reward=_matches(gold), factory=factory, horizon=5)
        )
    notes = [f"every query is delayed {delay_seconds * 1000:g} ms (emulated remote database)"] if delay_seconds else []
    return Workload(
        name="sql",
        tasks=tasks,
        description="questions over real SQLite databases (Chinook and a generated inventory), some must write first",
        notes=notes,
    )
