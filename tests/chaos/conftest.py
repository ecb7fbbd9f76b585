"""The chaos suite's scoreboard: every fault a test injects is recorded, and whether the run survived it.

``faults`` (session fixture) is a :class:`Scoreboard`; a test calls ``faults.injected(name)`` when it
injects a fault and ``faults.survived(name)`` once the run has shown it recovered (it trained past the
fault and, at the end, reached its step target with every invariant intact). The terminal summary
prints one line: every fault, injected vs survived.
"""

from __future__ import annotations

import pytest


class Scoreboard:
    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}  # fault -> [injected, survived]

    def injected(self, fault: str, n: int = 1) -> None:
        self.rows.setdefault(fault, [0, 0])[0] += n

    def survived(self, fault: str, n: int = 1) -> None:
        self.rows.setdefault(fault, [0, 0])[1] += n

    def line(self) -> str:
        cells = [f"{name} {s}/{i}" for name, (i, s) in self.rows.items()]
        total_i = sum(i for i, _ in self.rows.values())
        total_s = sum(s for _, s in self.rows.values())
        return f"chaos: faults survived/injected: {' | '.join(cells)} | total {total_s}/{total_i}"


_BOARD = Scoreboard()


@pytest.fixture(scope="session")
def faults() -> Scoreboard:
    return _BOARD


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _BOARD.rows:
        terminalreporter.write_sep("-", "chaos")
        terminalreporter.write_line(_BOARD.line())
