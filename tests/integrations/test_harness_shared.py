"""What the harness adapters share (``_file_trees``, ``_recorded_errors``), pinned: the upload digests are parts of
cache keys and the exception payloads are cached values, so each adapter's must stay what it was when cached."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tvcache.integrations import _swerex_shell_sandbox
from tvcache.integrations._file_trees import upload_digest
from tvcache.integrations._recorded_errors import (
    UnrecordedErrors,
    raise_recorded,
    rebuilt_described,
    recorded_exception,
    recorded_payload,
)

# Computed by each adapter's own digest function before they shared one (tvcache 0a7de54), over the tree below.
HARBOR_TREE, HARBOR_FILE = "43e90fabe765be66e8c65b086f39239e", "b910f6770b9274ed726b5945d323d350"
SWEREX_TREE, SWEREX_FILE = "e1614b6360495c2052be278042f565a5", "99847d6b2527610270188ca106bf7daa"


def fixed_tree(root: Path) -> tuple[Path, Path]:
    """A small tree (a file, a folder with an executable, a link spelled ``./a.txt``) and a lone file, with
    fixed modes; the link's spelling and the lone file's mode are where the adapters' rules differ."""
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_bytes(b"alpha\n")
    (tree / "sub" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    (tree / "link").symlink_to("./a.txt")
    os.chmod(tree / "a.txt", 0o644)
    os.chmod(tree / "sub" / "run.sh", 0o755)
    os.chmod(tree / "sub", 0o750)
    single = root / "single.bin"
    single.write_bytes(b"\x00\x01data\n")
    os.chmod(single, 0o640)
    return tree, single


def test_swerex_digests_are_what_they_were(tmp_path: Path) -> None:
    tree, single = fixed_tree(tmp_path)
    assert _swerex_shell_sandbox.tree_digest(tree) == SWEREX_TREE
    assert _swerex_shell_sandbox.tree_digest(single) == SWEREX_FILE


def test_harbor_rules_give_harbors_digests(tmp_path: Path) -> None:
    tree, single = fixed_tree(tmp_path)
    assert upload_digest(tree, whole_file_mode=False, pathlib_links=True) == HARBOR_TREE
    assert upload_digest(single, whole_file_mode=False, pathlib_links=True) == HARBOR_FILE


def test_harbor_digests_are_what_they_were(tmp_path: Path) -> None:
    pytest.importorskip("harbor", reason="the 'harbor' extra is not installed (Python >= 3.12)")
    from tvcache.integrations import harbor

    tree, single = fixed_tree(tmp_path)
    assert harbor.content_digest(tree) == HARBOR_TREE
    assert harbor.content_digest(single) == HARBOR_FILE


def test_each_rule_changes_only_what_it_names(tmp_path: Path) -> None:
    tree, single = fixed_tree(tmp_path)
    assert upload_digest(tree, whole_file_mode=True, pathlib_links=False) == SWEREX_TREE  # a tree: links only
    assert upload_digest(single, whole_file_mode=True, pathlib_links=True) == SWEREX_FILE  # a file: its mode only
    (tree / "link").unlink()
    (tree / "link").symlink_to("a.txt")
    assert upload_digest(tree, whole_file_mode=True, pathlib_links=False) == upload_digest(
        tree, whole_file_mode=False, pathlib_links=True
    )


def test_recorded_payloads_keep_each_adapters_bytes() -> None:
    """The three shapes written today (Harbor and SWE-ReX replay, SWE-ReX shell, mini-swe-agent), byte for byte,
    and what each rebuilds."""
    harness = recorded_exception(ValueError("no", 2))
    assert json.dumps(harness) == '{"raise": {"class": "builtins:ValueError", "args": ["no", 2]}}'
    shell = recorded_payload(FileNotFoundError, (2, "No such file or directory", "x"), kwargs={})
    assert json.dumps(shell) == (
        '{"raise": {"class": "builtins:FileNotFoundError", "args": [2, "No such file or directory", "x"], '
        '"kwargs": {}}}'
    )
    mini = recorded_payload(ValueError, [{"role": "exit"}], field="messages")
    assert json.dumps(mini) == '{"raise": {"class": "builtins:ValueError", "messages": [{"role": "exit"}]}}'
    with pytest.raises(ValueError, match="no") as harness_error:
        raise_recorded(json.loads(json.dumps(harness)))
    assert harness_error.value.args == ("no", 2)
    with pytest.raises(FileNotFoundError) as shell_error:
        raise_recorded(shell)
    assert (shell_error.value.errno, shell_error.value.filename) == (2, "x")
    with pytest.raises(ValueError, match="exit") as mini_error:
        raise_recorded(mini, field="messages")
    assert mini_error.value.args == ({"role": "exit"},)
    raise_recorded({"response": {}})  # no exception: returns


def test_described_oserror_is_rebuilt_through_its_constructor() -> None:
    found = {"class": "builtins:IsADirectoryError", "args": [21, "Is a directory"], "filename": "/d"}
    error = rebuilt_described(found)
    assert isinstance(error, IsADirectoryError)
    assert (error.errno, error.filename) == (21, "/d")


def test_unrecorded_errors_are_kept_and_raised_once() -> None:
    kept = UnrecordedErrors()
    unpicklable = RuntimeError(object())  # its argument is not JSON
    outcome = kept.outcome(unpicklable, timeouts=(TimeoutError,))
    assert (json.loads(outcome.output), outcome.is_error, outcome.deterministic) == ({"unrecorded": 0}, True, False)
    timed_out = kept.outcome(TimeoutError("late"), timeouts=(TimeoutError,))
    assert json.loads(timed_out.output) == {"unrecorded": 1}
    recorded = kept.outcome(ValueError("bad"), timeouts=(TimeoutError,))
    assert (recorded.output, recorded.deterministic) == (
        '{"raise": {"class": "builtins:ValueError", "args": ["bad"]}}',
        True,
    )
    with pytest.raises(RuntimeError) as raised:
        kept.raise_any(json.loads(outcome.output))
    assert raised.value is unpicklable
    with pytest.raises(ValueError, match="bad"):
        kept.raise_any(json.loads(recorded.output))
    with pytest.raises(KeyError):  # a kept exception is raised once, then forgotten
        kept.raise_any({"unrecorded": 0})
