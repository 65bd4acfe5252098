"""reinforge: RL post-training from verifiable rewards, as an actor system over NATS.

The sub-packages live in top-level folders of the repository (see pyproject.toml):
`reinforge.core`, `reinforge.actors`, `reinforge.kernels`, `reinforge.envs`,
`reinforge.engine`. ARCHITECTURE.md is the map.
"""

__version__ = "0.1.0"
