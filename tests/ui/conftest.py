"""The UI tests' live run (see ui_runs.py)."""

from __future__ import annotations

import pytest
from ui_runs import EVIL, publish, scored, serving


@pytest.fixture
def live_ui(creds, creds_file, run_name, tmp_path):
    """`reinforge ui --review` over a run holding three scored rollouts (math: two passes;
    docqa: one fail, whose completion holds HTML and script)."""
    publish(creds, run_name, [scored("2+2", 1.0, "#### 5", answer="4"),
                              scored("3+3", 1.0, "#### 6", answer="6"),
                              scored("doc", 0.0, EVIL, domain="docqa")])
    with serving(run_name, creds_file, tmp_path) as ui:
        yield ui
