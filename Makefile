# The two commands of the README. Both set up whatever is missing first.
.PHONY: demo test bootstrap bench

bootstrap:
	bash scripts/bootstrap.sh

# The main job on the embedded defaults (no GPU, no external services).
demo: bootstrap
	.venv/bin/reinforge demo $(ARGS)

# Every test, against a real nats-server and real rootless Podman.
test: bootstrap
	.venv/bin/python -m pytest $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/python bench/bus.py --json
