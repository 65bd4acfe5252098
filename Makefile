# The two commands of the README. Both set up whatever is missing first.
.PHONY: demo test bootstrap bench lock test-latest

bootstrap:
	bash scripts/bootstrap.sh

# The main job on the embedded defaults (no GPU, no external services).
demo: bootstrap
	.venv/bin/reinforge demo $(ARGS)

# Every test, against a real nats-server, real rootless Podman and headless Chromium.
test: bootstrap
	bash scripts/setup_browser.sh
	.venv/bin/python -m pytest $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/python bench/bus.py --json

# Re-resolve requirements.lock (uv) from pyproject.toml's ranges: newest allowed versions.
lock:
	bash scripts/lock.sh

# Tomorrow's releases: the newest versions pyproject.toml allows, in a throwaway venv,
# against a fast smoke subset. Run it before `make lock`, and now and then on main.
test-latest: bootstrap
	bash scripts/test_latest.sh $(PYTEST_ARGS)
