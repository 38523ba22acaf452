"""A ``GLOO_SOCKET_IFNAME`` that Gloo cannot use is refused by ``paratrain train`` and ``launch`` before any
worker starts, in one line with ``paratrain doctor``'s diagnosis (not Gloo's C++ error once per rank)."""

from __future__ import annotations

import pytest

from paratrain.cli import main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("command", [["train", "--model", "mlp", "--steps", "2"], ["launch", "nosuch.py"]])
def test_bad_gloo_ifname_is_one_line_before_launch(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "no interface named nosuch0 on this host" in err[0] and "Fix: set GLOO_SOCKET_IFNAME" in err[0]
    monkeypatch.setenv(
        "GLOO_SOCKET_IFNAME", "lo"
    )  # a usable one passes this check (the script is refused next)
    if command[0] == "launch":
        assert main(command) == 2 and "nosuch.py" in capsys.readouterr().err
