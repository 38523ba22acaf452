"""What ``paratrain lint`` refuses (files that are not regular: a FIFO, ``/dev/zero``) and how its work grows
with file size: linear, measured as the number of Python function calls made, not as time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from paratrain.lint import lint_source
from paratrain.lint.cli import main


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")
def test_fifo_and_device_are_refused_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)  # opening it for reading would block forever: it must not be opened
    assert main([str(fifo)]) == 2
    err = capsys.readouterr().err
    assert "is a FIFO, not a Python source file" in err and len(err.strip().splitlines()) == 1
    if Path("/dev/zero").exists():  # reading it never ends
        assert main(["/dev/zero"]) == 2
        err = capsys.readouterr().err
        assert "/dev/zero is a device" in err and len(err.strip().splitlines()) == 1
    # inside a directory, a FIFO named *.py is skipped, the regular files are linted
    (tmp_path / "ok.py").write_text("x = 1\n")
    assert main(["--json", str(tmp_path)]) == 0
    assert '"files": 1' in capsys.readouterr().out


def _script(n: int) -> str:
    """``n`` blocks of rank-conditional collectives (paired, unpaired, after an early exit), chains of ``n``
    helpers (one issuing a collective, one seeding torch) and saves."""
    out = ["import torch", "import torch.distributed as dist", 'dist.init_process_group("gloo")']
    out += ["rank = dist.get_rank()", "t = torch.ones(1)", "", "def step(t):"]
    for i in range(n):
        out += ["    if rank == 0:", "        dist.all_reduce(t)", f"        print({i})", "    else:"]
        out += ["        dist.all_reduce(t)", f"    x{i} = t * {i}", f"    dist.broadcast(x{i}, 0)"]
        out += [
            f"def helper{i}(t):",
            f"    helper{i + 1}(t)" if i + 1 < n else "    dist.barrier()",
            "def step(t):",
        ]
    out += [
        "    if rank != 0:",
        "        return",
        "    dist.barrier()",
        "",
        "for k in range(3):",
        "    step(t)",
    ]
    for i in range(n):  # a chain of helpers, the last of which seeds torch: found through every caller
        out += [f"def seed{i}():", f"    seed{i + 1}()" if i + 1 < n else "    torch.manual_seed(0)"]
    out += ["seed0()", "model = torch.nn.Linear(2, 2)"]  # is it seeded? asks for the seeding helpers
    for i in range(n):
        out += [
            f"if rank == {i % 4}:",
            "    dist.barrier()",
            f"    helper{i}(t)",
            f"torch.save(t, 'f{i}.pt')",
        ]
    return "\n".join(out) + "\n"


def _calls(text: str) -> int:
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        lint_source(text, "big.py", select=["ALL"])
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.timeout(120)
def test_work_grows_linearly_with_file_size() -> None:
    small, large = _calls(_script(60)), _calls(_script(120))
    # twice the blocks: twice the work (quadratic growth, as before the fix, gave 2.6x here and more beyond)
    assert large / small < 2.2, (small, large)
