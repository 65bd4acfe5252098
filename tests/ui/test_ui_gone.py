"""`reinforge ui --run R` when the run's nats-server goes away: the page keeps serving what it
read, says the stream cannot be read, and reads on once the server is back. A nats-server of
its own (the session's must stay up), as a real process."""

from __future__ import annotations

import time

import httpx
import pytest
from ui_runs import publish, scored, serving_ui

from reinforge.core.natsd import EmbeddedNats

pytestmark = pytest.mark.nats


def overview_once(c: httpx.Client, says: str, within_s: float) -> str:
    """The overview once it holds `says`."""
    deadline = time.monotonic() + within_s
    while True:
        page = c.get("/").text
        if says in page:
            return page
        assert time.monotonic() < deadline, f"{says!r} never appeared: {page}"
        time.sleep(0.5)


def test_the_page_outlives_its_runs_nats_server_and_reads_on_when_it_is_back(tmp_path):
    with EmbeddedNats(data_dir=tmp_path / "nats") as server:
        server.credentials.write(tmp_path / "nats.json")
        publish(server.credentials, "gone", [scored("2+2", 1.0, "#### 4")])
        with serving_ui(["--run", "gone", "--creds", str(tmp_path / "nats.json")],
                        tmp_path) as ui, \
                httpx.Client(base_url=ui.url, params={"token": ui.token}) as c:
            assert ">math</a></td><td>1</td>" in c.get("/").text
            server.stop()
            down = overview_once(c, "cannot be read since", within_s=40)
            assert ">math</a></td><td>1</td>" in down  # what it read stays shown
            assert c.get("/rollout", params={"id": "2+2:0:1"}).status_code == 200
            server.start()
            publish(server.credentials, "gone", [scored("3+3", 1.0, "#### 6")])
            back = overview_once(c, ">math</a></td><td>2</td>", within_s=40)
            assert "cannot be read" not in back
